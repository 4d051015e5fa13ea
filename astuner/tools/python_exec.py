"""Run model-written Python in a sandboxed child process with a time, memory, process and output limit.

Two levels, chosen once per process and named at start (`sandbox_level()`):

  bubblewrap  (Debian's `bubblewrap`, when installed and usable): new PID, network, IPC and UTS namespaces, so
              the code sees only its own processes (not the trainer's /proc/<pid>/environ), has no network
              (loopback included), and every process it starts dies with it; the system is mounted read-only,
              /tmp is a private tmpfs, the scratch folder is the only writable place; killed if astuner dies.
  process     (fallback): its own session and process group, killed as a group at the end; a scrubbed
              environment; rlimits. Weaker: the file system and the network are reachable, and a grandchild
              that starts its own session escapes the group kill. Install bubblewrap for the first level.

At both levels: the code runs as an unprivileged user (uid 65534 when astuner runs as root), so rlimits hold
(RLIMIT_NPROC caps fork bombs; root ignores it) and files of the user running astuner stay out of reach;
address space, file size and core dumps are limited; stdin is closed; the call returns when the snippet exits,
even if something it started still holds its output.
"""

# No `from __future__ import annotations` here: AgentScope's Toolkit builds the tool's JSON schema from the
# runtime annotations of `execute_python_code`, and string annotations would not resolve.

import asyncio
import functools
import logging
import os
import resource
import shutil
import signal
import subprocess
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
_MAX_PROCESSES = 64  # processes (threads count too) the snippet's user may run at once, beyond those it has
_NOBODY = 65534
log = logging.getLogger(__name__)


@functools.lru_cache(maxsize=1)
def sandbox_level() -> str:
    """'bubblewrap' when bwrap is installed and can create its namespaces here, else 'process'."""
    bwrap = shutil.which("bwrap")
    if bwrap is None or (os.geteuid() == 0 and shutil.which("setpriv") is None):
        return "process"
    try:
        probe = subprocess.run(
            [*_bwrap_prefix(), "--", *_bwrap_user(), sys.executable, "-I", "-c", "pass"],
            capture_output=True, timeout=20,
        )
    except (OSError, subprocess.SubprocessError):
        return "process"
    if probe.returncode != 0:
        log.warning("bubblewrap is installed but cannot run here (%s); falling back to the process sandbox",
                    probe.stderr.decode(errors="replace").strip()[:200])
        return "process"
    return "bubblewrap"


def describe_sandbox() -> str:
    level = sandbox_level()
    if level == "bubblewrap":
        return ("python tool sandbox: bubblewrap (no network, own PID namespace, read-only system, private /tmp, "
                "unprivileged user, process and memory limits)")
    return ("python tool sandbox: process only (own session, scrubbed environment, unprivileged user, process and "
            "memory limits); the network and the file system are reachable: install bubblewrap "
            "(apt-get install bubblewrap) for isolation")


def _bwrap_prefix() -> list[str]:
    """bwrap and its namespaces and mounts; the scratch folder and the command are added per call.

    As root, bwrap mounts with its own privileges (no user namespace) and `setpriv` then becomes nobody inside,
    so the snippet runs as a real unprivileged uid; otherwise bwrap runs unprivileged in a user namespace."""
    args = [shutil.which("bwrap") or "bwrap", "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc",
            "--perms", "1777", "--tmpfs", "/tmp"]
    if os.geteuid() == 0:
        args += ["--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts", "--unshare-cgroup-try"]
    else:
        args += ["--unshare-all"]
    return args + list(_interpreter_mounts()) + ["--die-with-parent", "--new-session"]


def _bwrap_user() -> list[str]:
    if os.geteuid() != 0:
        return []
    return [shutil.which("setpriv") or "setpriv", f"--reuid={_NOBODY}", f"--regid={_NOBODY}", "--clear-groups",
            "--inh-caps=-all", "--bounding-set=-all"]


@functools.lru_cache(maxsize=1)
def _interpreter_mounts() -> tuple[str, ...]:
    """bwrap arguments that keep this interpreter runnable inside the sandbox. Its prefixes (a venv, the base
    installation) may lie under /tmp, which the sandbox replaces by a private tmpfs, or, when astuner runs as
    root, under a folder others cannot enter (e.g. /root/.pyenv), which becomes an empty tmpfs (hiding the rest
    of it). Either way the prefixes are bound back in, read-only."""
    paths = {os.path.realpath(p) for p in (sys.prefix, sys.base_prefix, os.path.dirname(
        os.path.realpath(sys.executable)))}
    needed = sorted(p for p in paths if not any(p.startswith(q + os.sep) for q in paths))
    masked: list[str] = ["/tmp"]
    if os.geteuid() == 0:  # only root's bwrap can bind what an unprivileged user cannot reach
        for path in needed:
            parts = path.split(os.sep)
            for i in range(2, len(parts) + 1):
                ancestor = os.sep.join(parts[:i])
                try:
                    if not os.stat(ancestor).st_mode & 0o001:
                        if not any(ancestor == m or ancestor.startswith(m + os.sep) for m in masked):
                            masked.append(ancestor)
                        break
                except OSError:
                    break
    args: list[str] = []
    for folder in masked[1:]:  # /tmp is made by _bwrap_prefix
        args += ["--perms", "0755", "--tmpfs", folder]
    made: set[str] = set()
    for path in needed:
        base = next((m for m in masked if path.startswith(m + os.sep)), None)
        if base is None:
            continue
        # Folders between the tmpfs and the bound prefix, made enterable (bwrap would create them 0700).
        rel = path[len(base) + 1 :].split(os.sep)[:-1]
        for i in range(1, len(rel) + 1):
            folder = os.path.join(base, *rel[:i])
            if folder not in made:
                made.add(folder)
                args += ["--perms", "0755", "--dir", folder]
        args += ["--ro-bind", path, path]
    return tuple(args)


def _interpreter_reachable_by_others() -> bool:
    path = os.path.realpath(sys.executable)
    parts = path.split(os.sep)
    return all(os.stat(os.sep.join(parts[:i]) or os.sep).st_mode & 0o001 for i in range(2, len(parts)))


def _drop_privileges() -> None:
    """As root, become nobody: rlimits are enforced and root-owned files (/proc/<pid>/environ) are unreadable."""
    os.setgroups([])
    os.setgid(_NOBODY)
    os.setuid(_NOBODY)


def _own_process_count() -> int:
    uid = os.getuid()
    count = 0
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                count += os.stat(f"/proc/{entry}").st_uid == uid
            except OSError:
                pass
    return count


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


def _limit_resources(memory_mb: int, as_root: bool, base_processes: int) -> None:
    """Runs in the child between fork and exec."""
    if as_root:
        _drop_privileges()
    memory = memory_mb * 1024 * 1024
    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    resource.setrlimit(resource.RLIMIT_FSIZE, (_FILE_SIZE_LIMIT, _FILE_SIZE_LIMIT))
    # Counted per real user: nobody's other processes (or, not as root, the user's own) count against it.
    nproc = base_processes + _MAX_PROCESSES
    resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))


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
    """Run `code` with this interpreter in the sandbox (module docstring), in a fresh scratch directory (deleted
    afterwards), killed with everything it started after `timeout` seconds. stdout and stderr are each cut to
    `max_output_chars` (head and tail kept)."""
    root = tempfile.mkdtemp(prefix="astuner_py_")
    level = sandbox_level()
    is_root = os.geteuid() == 0
    # The process level drops to nobody only when nobody can reach the interpreter; bubblewrap drops inside.
    drop_now = is_root and level == "process" and _interpreter_reachable_by_others()
    try:
        script = os.path.join(root, "snippet.py")
        workdir = os.path.join(root, "work")
        os.mkdir(workdir)
        with open(script, "w", encoding="utf-8") as f:
            f.write(code)
        if is_root:
            for path in (root, workdir, script):
                os.chown(path, _NOBODY, _NOBODY)
        env = _child_env(workdir)
        command = [sys.executable, "-I", "-X", "utf8", "-u", script]  # -I: no PYTHON* variables, no user site
        if level == "bubblewrap":
            setenv = [arg for key, value in env.items() for arg in ("--setenv", key, value)]
            command = [*_bwrap_prefix(), "--bind", root, root, "--chdir", workdir, "--clearenv", *setenv, "--",
                       *_bwrap_user(), *command]
        proc = await asyncio.create_subprocess_exec(
            *command,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            cwd=workdir,
            env=env,
            start_new_session=True,
            preexec_fn=partial(_limit_resources, memory_mb, drop_now, 0 if is_root else _own_process_count()),
        )
        limit = max_output_chars * 4  # utf-8 needs at most 4 bytes a character
        out, err = _Capture(limit), _Capture(limit)
        readers = [asyncio.ensure_future(_drain(proc.stdout, out)), asyncio.ensure_future(_drain(proc.stderr, err))]
        timed_out = False
        try:
            timed_out = not await _exited(proc, timeout)
        finally:
            # Also on success or cancellation: background children of the snippet must not outlive it.
            _kill_group(proc.pid)
            if proc.returncode is None:
                await proc.wait()
            # Something that left the group could keep the pipes open; do not wait on it for long.
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


async def _exited(proc: asyncio.subprocess.Process, timeout: float) -> bool:
    """True once the snippet itself exited, within `timeout`. Not `proc.wait()`: that also waits for its output
    pipes to close, which a background child still holding them would delay until the timeout."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while proc.returncode is None:
        if loop.time() >= deadline:
            return False
        await asyncio.sleep(0.02)
    return True


# The Python tool as an OpenAI tool schema, for agents that are not AgentScope agents (run it with python_tool_text).
PYTHON_TOOL_SCHEMA = {
    "type": "function",
    "function": {
        "name": "execute_python_code",
        "description": "Execute Python code and return its return code, standard output and standard error. "
                       "Only printed output is returned, so print the values you need.",
        "parameters": {"type": "object", "properties": {"code": {"type": "string", "description": "The code."}},
                       "required": ["code"]},
    },
}


async def python_tool_text(code: str, timeout: float = 10.0) -> str:
    """The Python tool's answer as text (what execute_python_code returns, without AgentScope types)."""
    result = await run_python(str(code), timeout=min(max(float(timeout), 0.1), MAX_TOOL_TIMEOUT))
    return (f"<returncode>{result.returncode}</returncode><stdout>{result.stdout}</stdout>"
            f"<stderr>{result.stderr}</stderr>")


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
    return ToolResponse(content=[TextBlock(type="text", text=await python_tool_text(str(code), seconds))])
