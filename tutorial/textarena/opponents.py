"""Scripted players for the other seat of a two-player TextArena game (`task_reader.textarena.opponent:
'tutorial/textarena/opponents.py->random_move'`): a function from the observation text to a move."""

import random
import re


def random_move(observation: str) -> str:
    """Any of the moves the latest board lists (TextArena's "Available Moves: '[0]', '[4]', ..."), at random."""
    latest = observation.rsplit("Available Moves", 1)[-1]
    moves = re.findall(r"'(\[[^\]]+\])'", latest)
    return random.choice(moves) if moves else "[0]"
