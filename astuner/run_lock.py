"""One live run per run folder.

A run holds an exclusive `flock` on `<experiment_dir>/.astuner.lock` from its start (before its config is saved)
to its end; the file says who holds it (PID, host, start time, command). The kernel drops the lock when the
process (and any child it forked) exits, however it ends, so a crashed run never leaves a stale lock. A second
run planning its start asks `live_holder(folder)`: a live folder is never resumed or written into
(astuner/resume.py moves a fresh run on to `<folder>_N` and refuses to resume one that a live run writes).
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


def live_holder(folder: Path) -> Holder | None:
    """Who runs in `folder` now, or None when no live process holds its lock."""
    path = Path(folder) / LOCK_NAME
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            return _read_holder(path)
        return None  # a filesystem without flock: no lock to honour
    else:
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


class RunLock:
    """The lock a run holds on its folder; `release()` (or the process's end) lets the next run in."""

    def __init__(self, folder: Path, fd: int | None, created: Path | None) -> None:
        self.folder = folder
        self.created = created  # the outermost folder this run created (folder or one above it), or None
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the only descriptor drops the flock
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
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:
        raise UserError(f"cannot write into the run folder {folder}: {exc.strerror or exc}; set "
                        "astuner.experiment_dir to a writable folder.") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        os.close(fd)
        if exc.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            return RunLock(folder, None, created)  # no flock on this filesystem: nothing to hold
        raise busy(folder, _read_holder(path)) from None
    info = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.strftime("%Y-%m-%d %H:%M:%S"),
            "command": " ".join(sys.argv)}
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps(info).encode(), 0)
    return RunLock(folder, fd, created)


def busy(folder: Path, holder: Holder) -> UserError:
    from astuner.resume import fresh_folder

    return UserError(
        f"{folder} is in use by a live run ({holder}). A second run there would overwrite its config and "
        "checkpoints. Wait for it to end (this command then resumes from its latest checkpoint), stop it, or give "
        f"this run a folder of its own: astuner.experiment_dir={fresh_folder(folder)}.")
