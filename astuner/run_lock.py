"""One live run per run folder.

A run holds an exclusive POSIX record lock (`lockf`) on `<experiment_dir>/.astuner.lock` from its start (before
its config is saved) to its end; the file says who holds it (PID, host, start time, command). The kernel drops the
lock when the process exits, however it ends, so a crashed run never leaves a stale lock; unlike `flock`, a child
forked from the run (vLLM's engine core) does not inherit it, so a killed run's folder is free at once even while
its children wind down. A second run planning its start asks `live_holder(folder)`: a live folder is never resumed
or written into (astuner/resume.py moves a fresh run on to `<folder>_N` and refuses to resume one that a live run
writes).

A record lock is dropped when its process closes *any* descriptor of the file, so this process never opens a lock
file it holds: `live_holder` answers for those from `_HELD`.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from astuner.errors import UserError

LOCK_NAME = ".astuner.lock"


@dataclass(frozen=True)
class Holder:
    pid: int | None
    host: str
    started: str
    command: str

    def __str__(self) -> str:
        pid = "an unknown process" if self.pid is None else f"PID {self.pid}"
        where = f" on {self.host}" if self.host and self.host != socket.gethostname() else ""
        since = f", started {self.started}" if self.started else ""
        command = f": {self.command}" if self.command else ""
        return f"{pid}{where}{since}{command}"


def _read_holder(path: Path) -> Holder:
    try:
        info = json.loads(path.read_text(encoding="utf-8") or "{}")
    except (OSError, ValueError):
        info = {}
    info = info if isinstance(info, dict) else {}
    pid = info.get("pid")
    return Holder(pid if isinstance(pid, int) else None, str(info.get("host", "")), str(info.get("started", "")),
                  str(info.get("command", "")))


_HELD: dict[str, "RunLock"] = {}  # lock files this process holds, by resolved path


def live_holder(folder: Path) -> Holder | None:
    """Who runs in `folder` now, or None when no live process holds its lock."""
    path = Path(folder) / LOCK_NAME
    held = _HELD.get(str(path.resolve()))
    if held is not None:  # reading the file would close a descriptor of it, dropping the lock
        return held.holder
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.lockf(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            return _read_holder(path)
        return None  # a filesystem without record locks: no lock to honour
    else:
        return None
    finally:
        os.close(fd)  # drops the probe's shared lock too


class RunLock:
    """The lock a run holds on its folder; `release()` (or the process's end) lets the next run in."""

    def __init__(self, folder: Path, fd: int | None, created: Path | None, holder: Holder | None = None) -> None:
        self.folder = folder
        self.created = created  # the outermost folder this run created (folder or one above it), or None
        self.holder = holder
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            _HELD.pop(str((self.folder / LOCK_NAME).resolve()), None)
            os.close(self._fd)  # drops the record lock
            self._fd = None


def claim(folder: Path) -> RunLock:
    """Take `folder` for this run (creating it); UserError naming the holder when a live run has it."""
    folder = Path(folder)
    created = None
    for above in (folder, *folder.parents):
        if above.exists():
            break
        created = above
    path = folder / LOCK_NAME
    mine = _HELD.get(str(path.resolve()))
    if mine is not None:  # a second lock of this process would not conflict with the first: refuse it here
        raise busy(folder, mine.holder)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:
        raise UserError(f"cannot write into the run folder {folder}: {exc.strerror or exc}; set "
                        "astuner.experiment_dir to a writable folder.") from None
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        os.close(fd)
        if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            return RunLock(folder, None, created)  # no record locks on this filesystem: nothing to hold
        raise busy(folder, _read_holder(path)) from None
    info = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%d %H:%M:%S"),
            "command": " ".join(sys.argv)}
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(info).encode(), 0)
    held = RunLock(folder, fd, created, Holder(info["pid"], info["host"], info["started"], info["command"]))
    _HELD[str(path.resolve())] = held
    return held


def busy(folder: Path, holder: Holder) -> UserError:
    n = 1
    while folder.with_name(f"{folder.name}_{n}").exists():
        n += 1
    return UserError(
        f"{folder} is in use by a live run ({holder}). A second run there would overwrite its config and "
        "checkpoints. Wait for it to end (this command then resumes from its latest checkpoint), stop it, or give "
        f"this run a folder of its own: astuner.experiment_dir={folder.with_name(f'{folder.name}_{n}')}.")
