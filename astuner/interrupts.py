"""SIGTERM as Ctrl-C: a scheduler's or a timeout's `kill` unwinds the command like an interrupt (every `finally`
runs), for `astuner` runs and `astuner serve`."""

import contextlib
import signal
import threading

TERMINATED_EXIT = 143  # 128 + SIGTERM, as a shell reports it


class Terminated(KeyboardInterrupt):
    """SIGTERM (a scheduler, a timeout, `kill`): unwinds like Ctrl-C, so every `finally` runs and the engine's
    own processes (vLLM's engine core and workers, which outlive a parent killed outright) are stopped."""


@contextlib.contextmanager
def sigterm_as_interrupt():
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(signum, frame):
        raise Terminated()

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
