"""One snippet's process in the Python tool's sandbox (astuner/tools/python_exec.py starts it): what starts it
and the pipe its start is reported on, its output kept within bounds, its exit waited for, its group killed, and
what the call returns."""

# No `from __future__ import annotations`: `PythonResult` keeps the runtime annotations it had in python_exec.py.

import asyncio
import contextlib
import itertools
import os
import signal
from dataclasses import dataclass
from typing import Callable

from astuner.tools import limits

READ_CHUNK = 65536


@dataclass
class Launch:
    """What starts one snippet: argv, cwd, environment, the child's set-up, and the pipe its start is reported on."""

    argv: list[str]
    cwd: str
    env: dict[str, str]
    preexec: Callable[[], None]
    started_fd: int  # read end
    report_fd: int  # write end, handed to the child
    cgroup: limits.CallCgroup | None
    _started: bool = False

    def started(self) -> bool:
        """Whether the interpreter has reached the snippet (so far: the start byte is read once, then kept)."""
        if not self._started:
            os.set_blocking(self.started_fd, False)
            with contextlib.suppress(BlockingIOError):
                self._started = os.read(self.started_fd, 1) == b"1"
        return self._started


@dataclass
class PythonResult:
    returncode: int  # negative: killed by that signal (e.g. -9 after a timeout)
    stdout: str
    stderr: str
    timed_out: bool = False
    memory_peak_bytes: int | None = None  # the most the call held at once, where it ran in a cgroup of its own


class Capture:
    """Keeps the first and last `limit` bytes of a stream, so an endless print cannot fill our memory."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.head = bytearray()
        self.tail = bytearray()
        self.total = 0

    def feed(self, chunk: bytes) -> None:
        self.total += len(chunk)
        room = self.limit - len(self.head)
        if room > 0:
            self.head += chunk[:room]
            chunk = chunk[room:]
        if chunk:
            self.tail += chunk
            del self.tail[: max(0, len(self.tail) - self.limit)]

    def text(self, max_chars: int) -> str:
        head = self.head.decode("utf-8", errors="replace")
        tail = self.tail.decode("utf-8", errors="replace")
        if not tail and len(head) <= max_chars:
            return head
        text = head + tail
        keep = max(1, max_chars // 2)
        note = f"[output truncated: {self.total} bytes in all, the middle omitted]"
        return f"{text[:keep]}\n... {note} ...\n{text[-keep:]}"


def kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


async def drain(stream: asyncio.StreamReader, capture: Capture) -> None:
    while chunk := await stream.read(READ_CHUNK):
        capture.feed(chunk)


async def exited(proc: asyncio.subprocess.Process, timeout: float, cgroup: limits.CallCgroup | None) -> bool:
    """True once the snippet itself exited, or the kernel killed part of it for the call's memory limit (the rest
    is killed with the group: a call that outgrew its memory has ended), within `timeout`. Not `proc.wait()`: that
    also waits for its output pipes to close, which a background child still holding them would delay."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    for tick in itertools.count():
        if proc.returncode is not None or (cgroup is not None and tick % 5 == 4 and cgroup.oom_kills()):
            return True
        if loop.time() >= deadline:
            return False
        await asyncio.sleep(0.02)
    return False
