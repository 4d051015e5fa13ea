"""Run model-written Python in a sandboxed child process with a time, memory, process, file and output limit.

The code must see nothing of the user's: a policy that can read the training data learns to read the answer
instead of computing it. What it may read is this interpreter (its venv and its base installation, each bound
alone, never the folder holding it: a venv inside the project exposes the venv, not the project), the system's
/usr and the few /etc files the loader and SSL need (`_visible`). It must not be able to stop the run either.

Two levels, chosen once per process and named at start (`describe_sandbox()`):

  bubblewrap  (Debian's `bubblewrap`, when installed and usable; astuner/tools/bubblewrap.py): the code's file
              system is built from those paths alone, read-only, plus two private tmpfs, the working folder and
              /tmp, the only places it can write: no home, no project, no data, no other users' files, and
              nothing it writes reaches the host's disk. New PID, network, IPC and UTS namespaces: it sees only
              its own processes (not the trainer's /proc/<pid>/environ), cannot signal them, has no network
              (loopback included), and every process it starts dies with it; killed if astuner dies. As root, it
              runs as uid 65534 inside. All it can hold is bounded: `memory_mb` of address space (RLIMIT_AS) plus
              `_SCRATCH_BYTES` in each tmpfs (1024 + 2 x 256 MiB by default).
  process     (fallback, REFUSED unless `astuner.rollout.python_tool_unsandboxed: true`, see `allow_unsandboxed`):
              its own session and process group, a scrubbed environment, rlimits; as root it runs as uid 65534
              when that uid can run this interpreter, else as root; otherwise as the user running astuner, who
              can kill the run (`os.kill(-1, 9)`). Where the kernel offers Landlock, reads are limited to the same
              paths and writes to its working folder (on the host's temp disk, only each file capped). The network,
              loopback services included (the log viewer), is reachable, and a grandchild that starts its own
              session escapes the group kill.

At both levels: address space, threads (RLIMIT_NPROC, which Linux counts per real uid, threads included: the
limit is the threads that uid already runs + `_MAX_PROCESSES`), file size and core dumps are limited; stdin is
closed; the call returns when the snippet exits, even if something it started still holds its output.

A sandbox that cannot start is not a tool result: the snippet's interpreter reports its start on a pipe before
running the code (`_BOOT`), and when that never comes the call raises `SandboxUnavailable` (a `ToolInfraError`,
recorded for the episode: astuner/tools/failures.py) instead of handing bwrap's error to the model.
"""

# No `from __future__ import annotations` here: AgentScope's Toolkit builds the tool's JSON schema from the
# runtime annotations of `execute_python_code`, and string annotations would not resolve.

import asyncio
import contextlib
import functools
import glob
import logging
import os
import resource
import shutil
import signal
import site
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any, Callable, Iterator

from astuner.errors import UserError
from astuner.tools import bubblewrap as bw
from astuner.tools import landlock as lsm
from astuner.tools.failures import ToolInfraError, record_failure, record_start
from astuner.watchdog import watch

if TYPE_CHECKING:
    from agentscope.tool import ToolResponse

# The model chooses the timeout of its own tool calls; cap it so one call cannot stall an episode.
MAX_TOOL_TIMEOUT = 120.0
DEFAULT_MEMORY_MB = 1024
_FILE_SIZE_LIMIT = 256 * 1024 * 1024  # bytes one file written by the code may reach
_SCRATCH_BYTES = 256 * 1024 * 1024  # each tmpfs of the bubblewrap sandbox (/tmp, the working folder)
_READ_CHUNK = 65536
_MAX_PROCESSES = 64  # threads (processes count as one each) the snippet may add to those its uid already runs
_NOBODY = bw.NOBODY
_OPT_IN_KEY = "astuner.rollout.python_tool_unsandboxed"
_SYSTEM = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
# The loader's cache, SSL certificates, time zone, fonts, Debian's sitecustomize: system files, nothing of a user's.
_ETC = ("ld.so.cache", "ld.so.conf", "ld.so.conf.d", "alternatives", "ssl", "pki", "ca-certificates",
        "crypto-policies", "localtime", "fonts", "mime.types", "python3*")
_DEVICES = ("/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom")
# Run by `python -c` before the snippet: report the start on fd {fd} (then close it, so the code never holds it),
# and run the snippet as `python snippet.py` would (its own __main__, __file__ and argv). One line, so tracebacks
# gain one frame, `_BOOT_FRAME`, which is taken out of what the model sees.
_BOOT = ("import os, sys; os.write({fd}, b'1'); os.close({fd}); sys.argv[:] = sys.argv[1:]; __file__ = sys.argv[0]; "
         "__code = compile(open(__file__, 'rb').read(), __file__, 'exec'); del os, sys; exec(globals().pop('__code'))")
_BOOT_FRAME = 'Traceback (most recent call last):\n  File "<string>", line 1, in <module>\n'
log = logging.getLogger(__name__)
_allow_unsandboxed = False


class SandboxRefused(UserError, ToolInfraError):
    """The process fallback was not opted in; the message says what it would allow and how to get bubblewrap."""


class SandboxUnavailable(ToolInfraError):
    """The sandbox could not start the snippet's interpreter; the message quotes its error and what to do."""


def allow_unsandboxed(allowed: bool) -> None:
    """Let the process level run model code where bubblewrap cannot (the config key
    `astuner.rollout.python_tool_unsandboxed`). Call it at start, in every process that runs episodes."""
    global _allow_unsandboxed
    _allow_unsandboxed = bool(allowed)


def _within(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder.rstrip(os.sep) + os.sep)


@functools.lru_cache(maxsize=None)
def _visible(executable: str) -> tuple[tuple[str, str], ...]:
    """(host path, sandbox path) pairs the code may read: /usr and the system library folders, a few /etc files,
    then this interpreter's own folders (prefixes, site-packages) and the executable itself, bound alone. A path
    reached through a symlink is bound at both its names. A pair inside another is dropped."""
    system = [p for p in _SYSTEM if os.path.lexists(p)]
    etc = sorted(m for pattern in _ETC for m in glob.glob(os.path.join("/etc", pattern)))
    own = [sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix,
           *getattr(site, "getsitepackages", list)(), executable]
    pairs: list[tuple[str, str]] = []
    for path in system + etc + own:
        path = os.path.abspath(path)
        if not os.path.exists(path):
            continue
        real = os.path.realpath(path)
        for pair in ((real, real), (real, path)):
            if pair not in pairs:
                pairs.append(pair)
    kept: list[tuple[str, str]] = []
    for src, dst in pairs:  # system folders first, so a prefix under /usr adds nothing
        # Already visible: inside a bound folder, and so is what it resolves to (a venv's python -> the base one).
        bound = [d for s, d in kept if s == d]
        covered = any(_within(dst, d) for d in bound) and any(_within(src, d) for d in bound)
        if not covered:
            kept.append((src, dst))
    return tuple(kept)


def _own_folders(executable: str) -> list[str]:
    """The interpreter's own paths in the sandbox (named at start)."""
    return [d for _, d in _visible(executable) if not any(_within(d, s) for s in (*_SYSTEM, "/etc"))]


# --- one launch, the same for a call and for the start-up probes --------------------------------------------


def _threads_of(uid: int) -> int:
    """Threads `uid` runs now, which RLIMIT_NPROC counts (per real uid; a trainer holds hundreds); 0 for root,
    whom the limit does not bind."""
    if uid == 0:
        return 0
    count = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/status", "rb") as f:
                status = f.read()
        except OSError:
            continue
        real_uid = threads = 0
        for line in status.splitlines():
            if line.startswith(b"Uid:"):
                real_uid = int(line.split()[1])
            elif line.startswith(b"Threads:"):
                threads = int(line.split()[1])
        count += threads if real_uid == uid else 0
    return count


def _snippet_uid(user: str) -> int:
    """The uid the code runs as: user "" is bubblewrap's (nobody as root), else the process level's plan."""
    if user in ("nobody", "") and os.geteuid() == 0:
        return _NOBODY
    return 0 if user == "root" else os.getuid()


def _enter_process_sandbox(user: str, ruleset: int, memory_mb: int, base_threads: int) -> None:
    """Runs in the child between fork and exec: leave root, enter the Landlock ruleset, set the rlimits."""
    if user == "nobody":
        os.setgroups([])
        os.setgid(_NOBODY)
        os.setuid(_NOBODY)  # rlimits are enforced and root-owned files (/proc/<pid>/environ) are unreadable
    if ruleset >= 0:
        lsm.restrict_self(ruleset)
    memory = memory_mb * 1024 * 1024
    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    resource.setrlimit(resource.RLIMIT_FSIZE, (_FILE_SIZE_LIMIT, _FILE_SIZE_LIMIT))
    nproc = base_threads + _MAX_PROCESSES
    resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))


@dataclass
class _Launch:
    """What starts one snippet: argv, cwd, environment, the child's set-up, and the pipe its start is reported on."""

    argv: list[str]
    cwd: str
    env: dict[str, str]
    preexec: Callable[[], None]
    started_fd: int  # read end
    report_fd: int  # write end, handed to the child

    def started(self) -> bool:
        """Whether the interpreter reached the snippet (call once the child has exited)."""
        os.set_blocking(self.started_fd, False)
        try:
            return os.read(self.started_fd, 1) == b"1"
        except BlockingIOError:
            return False


@contextlib.contextmanager
def _launch(level: str, user: str, executable: str, code: str, memory_mb: int, landlock: bool) -> Iterator[_Launch]:
    """A fresh folder holding the snippet and an empty working folder (deleted afterwards), and how to start
    `code` in it at `level` (as `user` at the process level)."""
    root = tempfile.mkdtemp(prefix="astuner_py_")
    ruleset = -1
    read_fd, write_fd = os.pipe()
    try:
        script, workdir = os.path.join(root, "snippet.py"), os.path.join(root, "work")
        os.mkdir(workdir)
        with open(script, "w", encoding="utf-8") as f:
            f.write(code)
        if os.geteuid() == 0 and user != "root":
            for path in (root, workdir, script):
                os.chown(path, _NOBODY, _NOBODY)
        env = _child_env(workdir)
        # -I: no PYTHON* variables, no user site, no script folder on sys.path.
        argv = [executable, "-I", "-X", "utf8", "-u", "-c", _BOOT.format(fd=write_fd), script]
        if level == "bubblewrap":  # bwrap gets the rlimits; setpriv leaves root inside it
            argv = bw.command(_visible(executable), _SCRATCH_BYTES, root, workdir, env, argv)
        elif landlock:
            ruleset = _landlock_ruleset(executable, root)
        preexec = partial(_enter_process_sandbox, user, ruleset, memory_mb, _threads_of(_snippet_uid(user)))
        yield _Launch(argv, workdir, env, preexec, read_fd, write_fd)
    finally:
        for fd in (read_fd, write_fd, ruleset):
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
        shutil.rmtree(root, ignore_errors=True)


def _run_probe(level: str, user: str, executable: str, landlock: bool = False) -> str:
    """'' when `executable` starts at this level, under the limits of a real call, else why not."""
    try:
        with _launch(level, user, executable, "import encodings, site", DEFAULT_MEMORY_MB, landlock) as launch:
            probe = subprocess.run(launch.argv, capture_output=True, timeout=30, cwd=launch.cwd, env=launch.env,
                                   stdin=subprocess.DEVNULL, preexec_fn=launch.preexec, pass_fds=(launch.report_fd,))
            started = launch.started()
    except (OSError, subprocess.SubprocessError) as exc:
        return str(exc)
    if probe.returncode != 0 or not started:
        return probe.stderr.decode(errors="replace").strip()[-300:] or f"exit status {probe.returncode}"
    return ""


# --- bubblewrap --------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def _bubblewrap_problem() -> str:
    """'' when bwrap is installed and can start this interpreter here, else why not."""
    if shutil.which("bwrap") is None:
        return bw.NOT_INSTALLED
    if os.geteuid() == 0 and shutil.which("setpriv") is None:
        return bw.NO_SETPRIV
    why = _run_probe("bubblewrap", "", sys.executable)
    if why:
        log.warning("bubblewrap is installed but cannot run here (%s)", why)
        return f"bubblewrap cannot run here ({why})"
    return ""


@functools.lru_cache(maxsize=1)
def sandbox_level() -> str:
    """'bubblewrap' when bwrap is installed and can start the interpreter here, else 'process'."""
    return "process" if _bubblewrap_problem() else "bubblewrap"


# --- process level: opted in only; uid 65534 and Landlock --------------------------------------------------

def _landlock_abi() -> int:
    return lsm.abi()


def _landlock_ruleset(executable: str, scratch: str) -> int:
    """A Landlock ruleset (an fd, close it) allowing reads of `_visible`, the usual devices, and anything inside
    `scratch`; every other path is closed, whoever owns it."""
    rules = [(src, lsm.READ_ONLY) for src, _ in _visible(executable)]
    rules += [(dev, lsm.DEVICE) for dev in _DEVICES]
    return lsm.ruleset(rules, scratch)


@dataclass(frozen=True)
class _ProcessPlan:
    user: str  # "nobody" (uid 65534), "self" (not root: the user running astuner), "root", "" (refused)
    landlock: bool
    why: str = ""  # when refused: why


@functools.lru_cache(maxsize=None)
def _process_plan(executable: str, opted_in: bool) -> _ProcessPlan:
    """Who runs the code at the process level, and whether Landlock holds: refused unless opted in, else the
    first that starts the interpreter (as root: uid 65534 before root)."""
    if not opted_in:
        return _ProcessPlan("", False, f"{_OPT_IN_KEY} is false")
    users = ["nobody", "root"] if os.geteuid() == 0 else ["self"]
    errors = []
    for user in users:
        for landlock in ([True, False] if _landlock_abi() else [False]):
            error = _probe_process(executable, user, landlock)
            if not error:
                if not landlock and _landlock_abi():
                    log.warning("python tool: Landlock is available but the interpreter cannot start under it "
                                "(%s); the process sandbox runs without it", errors[-1])
                return _ProcessPlan(user, landlock)
            errors.append(error)
    return _ProcessPlan("", False, errors[-1] if errors else "")


def _probe_process(executable: str, user: str, landlock: bool) -> str:
    """'' when `executable` starts under this process-level setup, else why not."""
    return _run_probe("process", user, executable, landlock)


def describe_sandbox() -> str:
    """The start-up line: exactly what model-written code can and cannot reach here."""
    folders = ", ".join(_own_folders(sys.executable)) or "in /usr"
    mib = 1024 * 1024
    if sandbox_level() == "bubblewrap":
        uid = _NOBODY if os.geteuid() == 0 else os.getuid()
        return (f"python tool sandbox: bubblewrap: the code sees only this interpreter ({folders}) and the system's "
                f"/usr, read-only, and writes only to its working folder and a private /tmp, both in memory; no "
                f"home, no project, no data, no other users' files, nothing written to disk; uid {uid}, no network, "
                f"own PID namespace; at most {DEFAULT_MEMORY_MB} MiB of address space + 2 x "
                f"{_SCRATCH_BYTES // mib} MiB of files, {_MAX_PROCESSES} more threads")
    why = _bubblewrap_problem() or "bubblewrap not in use"
    plan = _process_plan(sys.executable, _allow_unsandboxed)
    if not plan.user:
        if os.geteuid() == 0:
            risk = ("as uid 65534 (or as root where that uid cannot run this interpreter), and reach this machine's "
                    "loopback services (the log viewer included)")
        else:
            risk = (f"as you (uid {os.getuid()}): able to kill this run and its workers (os.kill(-1, 9)), read your "
                    f"files where the kernel lacks Landlock, and reach this machine's loopback services (the log "
                    f"viewer included)")
        opted = (f"; {_OPT_IN_KEY} is true but no user could start {sys.executable} ({plan.why.splitlines()[-1]})"
                 if _allow_unsandboxed and plan.why else "")
        return (f"python tool sandbox: REFUSED: {why}{opted}. Without bubblewrap the code would run {risk}. To use "
                f"bubblewrap: {bw.how_to_enable(why)}; or set {_OPT_IN_KEY}: true to accept the process sandbox")
    who = {"nobody": f"runs as uid {_NOBODY} (nobody), which cannot signal this run",
           "self": f"RUNS AS YOU (uid {os.getuid()}): IT CAN KILL THIS RUN (os.kill(-1, 9))",
           "root": "RUNS AS ROOT, UNSANDBOXED"}[plan.user]
    if plan.landlock:
        files = (f"Landlock limits its reads to this interpreter ({folders}) and /usr, and its writes to an empty "
                 f"working folder")
    else:
        files = {"nobody": "files only you can read are out of reach, but WORLD-READABLE FILES ARE READABLE (a "
                           "project or data set under /srv, /opt or a home folder others may enter)",
                 "self": "YOUR FILES ARE READABLE (the project, its data, your home)",
                 "root": "EVERY FILE IS READABLE AND WRITABLE"}[plan.user]
    return (f"python tool sandbox: process level ({why}; {_OPT_IN_KEY}: true): {who}; {files}; THE NETWORK IS "
            f"REACHABLE, loopback services included (the log viewer); its files go to {tempfile.gettempdir()}, "
            f"{_FILE_SIZE_LIMIT // mib} MiB each, with no total bound; own session, scrubbed environment, "
            f"{DEFAULT_MEMORY_MB} MiB of address space, {_MAX_PROCESSES} more threads. For isolation: "
            f"{bw.how_to_enable(why)}")


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
    code: str, timeout: float = 10.0, memory_mb: int = DEFAULT_MEMORY_MB, max_output_chars: int = 8000
) -> PythonResult:
    """Run `code` with this interpreter in the sandbox (module docstring), in a fresh working folder (deleted
    afterwards), killed with everything it started after `timeout` seconds. stdout and stderr are each cut to
    `max_output_chars` (head and tail kept). Raises `SandboxRefused` where the process fallback is not opted in
    and `SandboxUnavailable` where the sandbox cannot start the interpreter (both `ToolInfraError`, recorded for
    the running episode)."""
    with watch("tool", "python"):
        return await _run_python(code, timeout, memory_mb, max_output_chars)


async def _run_python(code: str, timeout: float, memory_mb: int, max_output_chars: int) -> PythonResult:
    level = sandbox_level()
    plan = _process_plan(sys.executable, _allow_unsandboxed) if level == "process" else _ProcessPlan("", False)
    if level == "process" and not plan.user:
        raise record_failure(SandboxRefused(describe_sandbox().removeprefix("python tool sandbox: ")))
    with _launch(level, plan.user, sys.executable, code, memory_mb, plan.landlock) as launch:
        try:
            proc = await asyncio.create_subprocess_exec(
                *launch.argv,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                cwd=launch.cwd,
                env=launch.env,
                start_new_session=True,
                preexec_fn=launch.preexec,
                pass_fds=(launch.report_fd,),
            )
        except (OSError, subprocess.SubprocessError) as exc:
            raise record_failure(_unavailable(level, -1, str(exc))) from exc
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
        started = launch.started()
    stderr = err.text(max_output_chars)
    if not started:  # bwrap, setpriv or the interpreter failed before the code ran: not the model's doing
        raise record_failure(_unavailable(level, proc.returncode, stderr))
    record_start()
    stderr = stderr.replace(_BOOT_FRAME, _BOOT_FRAME.split("\n")[0] + "\n")
    if timed_out:
        note = f"TimeoutError: execution exceeded {timeout:g} seconds and was killed."
        stderr = f"{stderr}\n{note}" if stderr else note
    return PythonResult(proc.returncode, out.text(max_output_chars), stderr, timed_out)


def _unavailable(level: str, returncode: int | None, stderr: str) -> SandboxUnavailable:
    fix = (f"check that bwrap can start it here as this user ({bw.how_to_enable('')})" if level == "bubblewrap"
           else "check the process sandbox's start-up line")
    return SandboxUnavailable(
        f"the Python tool's sandbox ({level}) could not start the interpreter {sys.executable} (exit status "
        f"{returncode}): {stderr.strip()[-500:] or 'no error output'}. This is not the model's doing: {fix}; the "
        f"start-up block's 'python tool sandbox' line says what was found at start")


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
