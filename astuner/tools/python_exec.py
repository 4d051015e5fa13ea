"""Run model-written Python in a child process with a time, memory and output limit.

This is containment for mistakes (infinite loops, memory blow-ups, stray files, endless prints), not a security
boundary: the code runs as the same user and can reach the network and the file system. Run untrusted tasks
inside a container.
"""

# No `from __future__ import annotations` here: AgentScope's Toolkit builds the tool's JSON schema from the
# runtime annotations of `execute_python_code`, and string annotations would not resolve.

import asyncio
import os
import resource
import shutil
import signal
import sys
import tempfile
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from agentscope.tool import ToolResponse

# The model chooses the timeout of its own tool calls; cap it so one call cannot stall an episode.
MAX_TOOL_TIMEOUT = 120.0
_FILE_SIZE_LIMIT = 256 * 1024 * 1024  # bytes one file written by the code may reach
_READ_CHUNK = 65536


@dataclass
class PythonResult:
    returncode: int  # negative: killed by that signal (e.g. -9 after a timeout)
    stdout: str
    stderr: str
    timed_out: bool = False


class _Capture:
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


def _limit_resources(memory_mb: int) -> None:
    """Runs in the child between fork and exec."""
    memory = memory_mb * 1024 * 1024
    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    resource.setrlimit(resource.RLIMIT_FSIZE, (_FILE_SIZE_LIMIT, _FILE_SIZE_LIMIT))


def _child_env(workdir: str) -> dict[str, str]:
    """A small environment: the code needs no credentials or settings of ours. One thread per numeric library,
    since thread pools reserve address space that would count against the memory limit."""
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": workdir,
        "TMPDIR": workdir,
        "LANG": "C.UTF-8",
        "LC_ALL": "C.UTF-8",
        "MPLBACKEND": "Agg",
    }
    for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS", "NUMEXPR_NUM_THREADS"):
        env[var] = "1"
    return env


def _kill_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


async def _drain(stream: asyncio.StreamReader, capture: _Capture) -> None:
    while chunk := await stream.read(_READ_CHUNK):
        capture.feed(chunk)


async def run_python(
    code: str, timeout: float = 10.0, memory_mb: int = 1024, max_output_chars: int = 8000
) -> PythonResult:
    """Run `code` with this interpreter in a new session, in a fresh scratch directory (deleted afterwards),
    stdin closed, address space limited to `memory_mb`, killed with its whole process group after `timeout`
    seconds. stdout and stderr are each cut to `max_output_chars` (head and tail kept)."""
    root = tempfile.mkdtemp(prefix="astuner_py_")
    try:
        script = os.path.join(root, "snippet.py")
        workdir = os.path.join(root, "work")
        os.mkdir(workdir)
        with open(script, "w", encoding="utf-8") as f:
            f.write(code)
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-I",  # isolated: no PYTHON* variables, no user site, script dir not on sys.path
            "-X",
            "utf8",
            "-u",  # unbuffered, so output printed before a timeout is kept
            script,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            cwd=workdir,
            env=_child_env(workdir),
            start_new_session=True,
            preexec_fn=partial(_limit_resources, memory_mb),
        )
        limit = max_output_chars * 4  # utf-8 needs at most 4 bytes a character
        out, err = _Capture(limit), _Capture(limit)
        readers = [asyncio.ensure_future(_drain(proc.stdout, out)), asyncio.ensure_future(_drain(proc.stderr, err))]
        timed_out = False
        try:
            await asyncio.wait_for(proc.wait(), timeout)
        except asyncio.TimeoutError:
            timed_out = True
        finally:
            # Also on success or cancellation: background children of the snippet must not outlive it.
            _kill_group(proc.pid)
            if proc.returncode is None:
                await proc.wait()
            # A grandchild that left the group could keep the pipes open; do not wait on it for long.
            _, pending = await asyncio.wait(readers, timeout=2.0)
            for task in pending:
                task.cancel()
        stderr = err.text(max_output_chars)
        if timed_out:
            note = f"TimeoutError: execution exceeded {timeout:g} seconds and was killed."
            stderr = f"{stderr}\n{note}" if stderr else note
        return PythonResult(proc.returncode, out.text(max_output_chars), stderr, timed_out)
    finally:
        shutil.rmtree(root, ignore_errors=True)


async def execute_python_code(code: str, timeout: float = 10.0, **kwargs: Any) -> "ToolResponse":
    """Execute Python code in a fresh process and return its return code, standard output and standard error.
    Only printed output is returned, so `print` the values you need. The code runs in an empty temporary
    directory that is deleted afterwards.

    Args:
        code (`str`):
            The Python code to execute.
        timeout (`float`, defaults to `10.0`):
            Seconds after which the execution is killed (at most 120).

    Returns:
        `ToolResponse`:
            The return code, standard output and standard error of the execution.
    """
    from agentscope.message import TextBlock
    from agentscope.tool import ToolResponse

    # kwargs swallows extra arguments a model may invent, so they do not crash the tool call.
    try:
        seconds = min(max(float(timeout), 0.1), MAX_TOOL_TIMEOUT)
    except (TypeError, ValueError):
        seconds = 10.0
    result = await run_python(str(code), timeout=seconds)
    text = (
        f"<returncode>{result.returncode}</returncode>"
        f"<stdout>{result.stdout}</stdout>"
        f"<stderr>{result.stderr}</stderr>"
    )
    return ToolResponse(content=[TextBlock(type="text", text=text)])
