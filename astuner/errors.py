"""Errors caused by the user's input (config, data, user code paths). The CLI prints them and exits with 2."""


class UserError(Exception):
    """Bad input: the message says what is wrong and how to fix it, in one paragraph."""
