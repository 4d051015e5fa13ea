"""Errors the CLI turns into a message instead of a traceback.

UserError: bad input (config, data, user code paths); exit code 2.
TrainingStalled: the run stopped because it would otherwise train on nothing; exit code 1.
WorkerLost: a process of a Ray backbone died or did not answer in time; exit code 1.
StageTimeout: a stage of a step ran past astuner.trainer_common.stage_timeout_s (astuner/watchdog.py); exit code 1.
EngineStartError: a rollout engine could not start (vLLM's root cause and the keys that fix it); exit code 1.
"""


class UserError(Exception):
    """Bad input: the message says what is wrong and how to fix it, in one paragraph.

    `details` (optional) is printed after the paragraph, e.g. the traceback of the user's own code.
    """

    def __init__(self, message: str, details: str | None = None) -> None:
        super().__init__(message)
        self.details = details


class TrainingStalled(RuntimeError):
    """The run stopped instead of training on nothing; the message quotes the first error seen."""


class WorkerLost(RuntimeError):
    """A Ray actor died or did not answer within its deadline; the message names who waited for whom.
    `trainer_ok`: the trainer still holds the last completed step, so a checkpoint of it is consistent."""

    def __init__(self, message: str, trainer_ok: bool = False) -> None:
        super().__init__(message)
        self.trainer_ok = trainer_ok


class EngineStartError(RuntimeError):
    """An engine could not start; the message quotes the root cause and names the astuner keys that fix it. Not a
    UserError: the run's folder, whose log holds the engine's whole output, is kept."""


class StageTimeout(RuntimeError):
    """A stage of a step ran past its deadline; the message names the stage and what it was waiting on."""


def user_code_error(what: str, path: str, exc: BaseException) -> UserError:
    """A UserError for an exception raised by the user's own module (at import or in a constructor).

    The message names the file; `details` is the traceback cut to the user's frames (astuner's and importlib's
    own frames left out), ending with the exception itself.
    """
    import traceback
    from pathlib import Path

    package = str(Path(__file__).resolve().parent)
    frames = [
        f for f in traceback.extract_tb(exc.__traceback__)
        if not f.filename.startswith(package) and "importlib" not in f.filename and not f.filename.startswith("<frozen")
    ]
    lines = ["Traceback (your code):\n"] + traceback.format_list(frames) if frames else []
    lines += traceback.format_exception_only(type(exc), exc)
    summary = " ".join(traceback.format_exception_only(type(exc), exc)[-1].split())
    return UserError(f"{what} {path} raised an error: {summary}. Fix it; the traceback follows.", "".join(lines).rstrip())
