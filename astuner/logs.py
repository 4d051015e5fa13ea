"""The run's log: loguru with a file sink (<experiment_dir>/astuner.log, INFO and up) and a console sink (WARNING
and up, written with tqdm.write so the progress bars stay whole). Records of the standard `logging` module
(astuner's own modules, libraries) are routed into loguru, and a workflow that does `from loguru import logger`
logs into the same file. Low in the layers: engines and checks log through it too.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

_SINKS: list[int] = []  # loguru sink ids added by setup_logging, removed on the next call
_LOG_PATH: list[Path] = []  # the run's log file, once setup_logging ran in this process
# Libraries whose warnings go to the log file only (their errors still reach the console): vLLM explains its own
# start-up choices at length, none of which a user acts on.
_FILE_ONLY = ("vllm", "triton")


def run_log_path() -> Path | None:
    """The run's log file in this process (None before setup_logging: a bench or a test using an engine alone)."""
    return _LOG_PATH[-1] if _LOG_PATH else None


def _for_console(record) -> bool:
    name = record["name"] or ""
    return record["level"].no >= 40 or not name.split(".")[0] in _FILE_ONLY


def setup_logging(experiment_dir: Path) -> Path:
    """Log INFO and above to <experiment_dir>/astuner.log; the console shows warnings and the progress bar."""
    from loguru import logger

    experiment_dir.mkdir(parents=True, exist_ok=True)
    path = experiment_dir / "astuner.log"
    for sink in _SINKS:
        logger.remove(sink)
    _SINKS.clear()
    try:
        logger.remove(0)  # loguru's own default stderr sink would print every INFO line a second time
    except ValueError:
        pass
    _SINKS.append(logger.add(path, level="INFO", encoding="utf-8", enqueue=False,
                             format="{time:YYYY-MM-DD HH:mm:ss.SSS} {level} {name}: {message}"))
    _SINKS.append(logger.add(_console, level="WARNING", format="astuner: {level}: {message}", colorize=False,
                             filter=_for_console))
    _LOG_PATH[:] = [path]
    root = logging.getLogger()
    root.setLevel(logging.INFO)
    for handler in list(root.handlers):
        if isinstance(handler, _InterceptHandler):
            root.removeHandler(handler)
    root.addHandler(_InterceptHandler())
    return path


def announce(message: str) -> None:
    """INFO in the log file, and on the console whatever its level filter."""
    from loguru import logger
    from tqdm import tqdm

    logger.info(message)
    tqdm.write(f"astuner: {message}", file=sys.stderr)


def _console(message) -> None:
    from tqdm import tqdm

    tqdm.write(str(message).rstrip("\n"), file=sys.stderr)


class _InterceptHandler(logging.Handler):
    """Standard logging -> loguru, keeping the record's level and logger name."""

    def emit(self, record: logging.LogRecord) -> None:
        from loguru import logger

        try:
            level: str | int = logger.level(record.levelname).name
        except ValueError:
            level = record.levelno
        text = record.getMessage()
        if record.exc_info:
            import traceback

            text += "\n" + "".join(traceback.format_exception(*record.exc_info)).rstrip()
        logger.patch(lambda r: r.update(name=record.name)).log(level, text)
