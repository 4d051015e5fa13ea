"""Why the Python tool's sandbox (astuner/tools/python_exec.py) ran no snippet: both are `ToolInfraError`s,
recorded for the episode (astuner/tools/failures.py), never handed to the model as its tool's output."""

import sys

from astuner.errors import UserError
from astuner.tools import bubblewrap as bw
from astuner.tools.failures import ToolInfraError


class SandboxRefused(UserError, ToolInfraError):
    """The process fallback was not opted in; the message says what it would allow and how to get bubblewrap."""


class SandboxUnavailable(ToolInfraError):
    """The sandbox could not start the snippet's interpreter; the message quotes its error and what to do."""


def unavailable(level: str, returncode: int | None, stderr: str) -> SandboxUnavailable:
    fix = (f"check that bwrap can start it here as this user ({bw.how_to_enable(stderr)})" if level == "bubblewrap"
           else "check the process sandbox's start-up line")
    return SandboxUnavailable(
        f"the Python tool's sandbox ({level}) could not start the interpreter {sys.executable} (exit status "
        f"{returncode}): {stderr.strip()[-500:] or 'no error output'}. This is not the model's doing: {fix}; the "
        f"start-up block's 'python tool sandbox' line says what was found at start")
