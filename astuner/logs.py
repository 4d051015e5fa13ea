"""The run's log: loguru with a file sink (<experiment_dir>/astuner.log) and a console sink (WARNING and up, written
with tqdm.write so the progress bars stay whole). Records of the standard `logging` module (astuner's own modules,
libraries) are routed into loguru, and a workflow that does `from loguru import logger` logs into the same file.
Low in the layers: engines and checks log through it too.

What the file keeps: INFO and up from everyone, and DEBUG from the user's code only: loguru lines from a file
outside the installed packages and astuner (`is_user_file`), and the standard loggers of the workflow's and judge's
modules (set to DEBUG by `debug_from_user_modules` when they load). Libraries' DEBUG (HTTP clients, torch, vLLM) stays out: it
would bury the user's lines, and the root logger stays at INFO so libraries never build those records at all.

What an episode's code prints (an agent framework echoing every reply, the user's own `print`) goes to the file
too, a line at a time as `[episode uid] print: ...`, not to the console, on every backbone (in a Ray actor, Ray
would otherwise forward each line to the driver's console): `sys.stdout` is replaced by `_EpisodeStdout`, which
sends writes made while `EPISODE` is set (the episode's asyncio task, and threads it starts through
`asyncio.to_thread`, which copy its context) to the log and everything else to the real stdout.
"""

from __future__ import annotations

import contextvars
import functools
import io
import os
import logging
import sys
import threading
import sysconfig
from pathlib import Path
from types import ModuleType

_SINKS: list[int] = []  # loguru sink ids added by setup_logging, removed on the next call
_LOG_PATH: list[Path] = []  # the run's log file, once setup_logging ran in this process
# Libraries whose warnings go to the log file only (their errors still reach the console): vLLM explains its own
# start-up choices at length, none of which a user acts on.
_FILE_ONLY = ("vllm", "triton")


# The episode whose code is running in this context (rollout.py sets it in each episode's task).
EPISODE: contextvars.ContextVar[str | None] = contextvars.ContextVar("astuner_episode", default=None)


class _EpisodeStdout(io.TextIOBase):
    """sys.stdout: an episode's writes into the run's log, a line at a time; anyone else's to the real stdout."""

    PARTIAL_LIMIT = 65536  # characters held for an unfinished line (a progress bar redrawn with \r) before writing

    def __init__(self, console) -> None:
        super().__init__()
        self.console = console
        self._partial: dict[str, str] = {}  # episode -> text after its last newline
        self._lock = threading.Lock()

    def _episode(self) -> str | None:
        return EPISODE.get() if _LOG_PATH else None

    def write(self, text: str) -> int:
        episode = self._episode()
        if episode is None:
            return self.console.write(text)
        with self._lock:
            *lines, rest = (self._partial.pop(episode, "") + text).split("\n")
            if len(rest) > self.PARTIAL_LIMIT:
                lines.append(rest)
                rest = ""
            if rest:
                self._partial[episode] = rest
        for line in lines:
            self._log(episode, line)
        return len(text)

    def _log(self, episode: str, line: str) -> None:
        try:
            _print_line(episode, line)
        except OSError:  # the log file gone (its folder removed): the console, rather than losing the line
            self.console.write(line + "\n")

    def end_episode(self, episode: str) -> None:
        with self._lock:
            rest = self._partial.pop(episode, "")
        if rest:
            self._log(episode, rest)

    def flush(self) -> None:
        self.console.flush()

    def fileno(self) -> int:
        return self.console.fileno()

    def writable(self) -> bool:
        return True

    def isatty(self) -> bool:
        # An episode writes into a file: no colours or cursor moves meant for a terminal.
        return self._episode() is None and self.console.isatty()

    @property
    def encoding(self):
        return getattr(self.console, "encoding", "utf-8")

    @property
    def errors(self):
        return getattr(self.console, "errors", "strict")

    def __getattr__(self, name: str):
        # What TextIOBase lacks (buffer, reconfigure, line_buffering): the real stdout's.
        return getattr(self.console, name)


_PRINTS_LOCK = threading.Lock()


def _print_line(episode: str, line: str) -> None:
    """Append the line to the run's log file itself, in the file sink's format: not through loguru, whose
    handlers are not re-entrant (a user's `logger.add(sys.stdout)` sink writing here would call back into it)."""
    import datetime

    stamp = datetime.datetime.now().strftime("%Y-%m-%d %H:%M:%S.%f")[:-3]
    try:
        with _PRINTS_LOCK, open(_LOG_PATH[-1], "a", encoding="utf-8") as f:
            f.write(f"{stamp} INFO print: [{episode}] print: {line.rstrip()}\n")
    except FileNotFoundError:  # an earlier run's folder, since removed: the line still reaches the console
        sys.__stdout__.write(line if line.endswith("\n") else line + "\n")


def route_episode_prints() -> None:
    """Install `_EpisodeStdout` as sys.stdout (once; module docstring)."""
    if not isinstance(sys.stdout, _EpisodeStdout):
        sys.stdout = _EpisodeStdout(sys.stdout)


def end_episode_prints(episode: str) -> None:
    """Write out what the episode printed after its last newline."""
    if isinstance(sys.stdout, _EpisodeStdout):
        sys.stdout.end_episode(episode)


def run_log_path() -> Path | None:
    """The run's log file in this process (None before setup_logging: a bench or a test using an engine alone)."""
    return _LOG_PATH[-1] if _LOG_PATH else None


def _for_console(record) -> bool:
    name = record["name"] or ""
    return record["level"].no >= 40 or not name.split(".")[0] in _FILE_ONLY


@functools.lru_cache(maxsize=1)
def _library_dirs() -> tuple[str, ...]:
    """Folders whose code is not the user's: the standard library, installed packages, astuner itself."""
    import site

    dirs = {sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")}
    dirs.update(site.getsitepackages() if hasattr(site, "getsitepackages") else [])
    dirs.add(site.getusersitepackages())
    dirs.add(str(Path(__file__).resolve().parent))
    return tuple(str(Path(d).resolve()) + "/" for d in dirs if d)


# Pseudo-paths of code that no user file holds: frozen standard modules, exec'd and compiled strings.
_PSEUDO_PATHS = ("<frozen", "<string>")
_INSTALL_DIRS = frozenset({"site-packages", "dist-packages"})


@functools.lru_cache(maxsize=1)
def _distribution_roots() -> frozenset[str]:
    """The top-level files and folders of every installed distribution (those installed with --target or on
    PYTHONPATH included) and the package folders of editable installs: library code outside site-packages.
    Read once per process (a fraction of a second): metadata per record would cost that on every line."""
    import importlib.metadata
    import importlib.util
    import json

    roots: set[str] = set()
    for dist in importlib.metadata.distributions():
        # A distribution's files share a few top-level names (torch's 15,000 files: a handful): resolved once each.
        for top in _top_names(dist):
            if not top.endswith((".dist-info", ".egg-info")):
                roots.add(str(Path(dist.locate_file(top)).resolve()))
        try:
            url = json.loads(dist.read_text("direct_url.json") or "{}")
        except ValueError:
            continue
        if not url.get("dir_info", {}).get("editable"):
            continue
        for name in (dist.read_text("top_level.txt") or "").split():
            try:
                spec = importlib.util.find_spec(name)  # finds without importing a top-level package
            except (ImportError, ValueError):
                spec = None
            if spec is not None and spec.origin:
                origin = Path(spec.origin).resolve()
                roots.add(str(origin.parent if spec.submodule_search_locations else origin))
    return frozenset(roots)


def _top_names(dist) -> set[str]:
    """The first path parts of a distribution's files. Read from RECORD as CSV text: `dist.files` builds a path
    object per file (a third of a second per process start for this environment's 120,000 files)."""
    import csv

    record = dist.read_text("RECORD")
    if record is None:  # an egg-info install: its SOURCES.txt, as importlib reads it
        tops = {f.parts[0] for f in dist.files or [] if f.parts}
    else:
        tops = {row[0].split("/", 1)[0] for row in csv.reader(record.splitlines()) if row and row[0]}
    tops.discard("..")
    return tops


@functools.lru_cache(maxsize=1024)
def _is_library_folder(folder: Path) -> bool:
    """Whether `folder` lies inside a distribution's files (cached by folder: a module's records share one)."""
    roots = _distribution_roots()
    return any(str(d) in roots for d in (folder, *folder.parents))


@functools.lru_cache(maxsize=1024)
def is_user_file(path: str | None) -> bool:
    """Whether `path` is user code: a real file outside the standard library, installed packages (any
    site-packages or dist-packages folder, any installed distribution's files, editable installs) and astuner."""
    if not path or path.startswith(_PSEUDO_PATHS):
        return False
    resolved = Path(path).resolve()
    if _INSTALL_DIRS.intersection(resolved.parts) or str(resolved).startswith(_library_dirs()):
        return False
    return str(resolved) not in _distribution_roots() and not _is_library_folder(resolved.parent)


def _for_file(record) -> bool:
    level = record["level"].no
    if level >= logging.INFO:
        return True
    if level < logging.DEBUG:
        return False
    # A standard record reaches DEBUG only from a logger set to DEBUG: the user's modules, or one the user chose.
    return record["extra"].get("stdlib", False) or is_user_file(record["file"].path)


def user_module_names(module: ModuleType | None) -> list[str]:
    """The names of a workflow's (or judge's) modules: its own and the modules loaded from its folder (the
    siblings it imports); none when it is library or astuner code."""
    path = getattr(module, "__file__", None)
    if not is_user_file(path):
        return []
    names = {module.__name__}
    try:
        home = os.stat(Path(path).resolve().parent)
    except OSError:  # its folder is gone: no sibling to find
        return sorted(names)
    # Folders compared by identity (os.path.samestat): one stat per folder of the ~4,000 modules a run has
    # loaded, cheaper than resolving each folder's path.
    same: dict[str, bool] = {}
    for name, other in list(sys.modules.items()):
        other_path = getattr(other, "__file__", None)
        if not isinstance(other_path, str) or not other_path:
            continue
        if os.path.islink(other_path):  # a module file linked from elsewhere lives where its target does
            other_path = os.path.realpath(other_path)
        folder = os.path.dirname(other_path) or "."
        if folder not in same:
            try:
                same[folder] = os.path.samestat(os.stat(folder), home)
            except OSError:
                same[folder] = False
        if same[folder]:
            names.add(name)
    return sorted(names)


def debug_from_user_modules(module: ModuleType | None) -> None:
    """Let the standard loggers of `module` and its siblings emit DEBUG (into the log file, never the console)."""
    for name in user_module_names(module):
        logging.getLogger(name).setLevel(logging.DEBUG)


def setup_logging(experiment_dir: Path, file_name: str = "astuner.log") -> Path:
    """Log INFO and above, and the user's DEBUG, to <experiment_dir>/<file_name>; the console shows warnings and
    the progress bar."""
    from loguru import logger

    experiment_dir.mkdir(parents=True, exist_ok=True)
    path = experiment_dir / file_name
    for sink in _SINKS:
        logger.remove(sink)
    _SINKS.clear()
    try:
        logger.remove(0)  # loguru's own default stderr sink would print every INFO line a second time
    except ValueError:
        pass
    _SINKS.append(logger.add(path, level="DEBUG", encoding="utf-8", enqueue=False, filter=_for_file,
                             format="{time:YYYY-MM-DD HH:mm:ss.SSS} {level} {name}: {message}"))
    _SINKS.append(logger.add(_console, level="WARNING", format="astuner: {level}: {message}", colorize=False,
                             filter=_for_console))
    _LOG_PATH[:] = [path]
    route_episode_prints()
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
        logger.patch(lambda r: r.update(name=record.name)).bind(stdlib=True).log(level, text)
