"""Run model-written Python in a sandboxed child process with a time, memory, process, file and output limit.

The code must see nothing of the user's: a policy that can read the training data learns to read the answer
instead of computing it. What it may read is this interpreter (its venv and its base installation, each bound
alone, never the folder holding it: a venv inside the project exposes the venv, not the project), the system's
/usr and the few /etc files the loader and SSL need (`sandbox_view.visible`). It must not be able to stop the run
either.

Two levels, chosen once per process and named at start (`describe_sandbox()`):

  bubblewrap  (Debian's `bubblewrap`, when installed and usable; astuner/tools/bubblewrap.py): the code's file
              system is built from those paths alone, read-only, plus two private tmpfs, the working folder and
              /tmp, the only places it can write: no home, no project, no data, no other users' files, and
              nothing it writes reaches the host's disk. New PID, network, IPC and UTS namespaces: it sees only
              its own processes (not the trainer's /proc/<pid>/environ), cannot signal them, has no network
              (loopback included), and every process it starts dies with it; killed if astuner dies. As root, it
              runs inside as a uid of its own per call (astuner/tools/limits.py).
  process     (fallback, REFUSED unless `astuner.rollout.python_tool_unsandboxed: true`, see `allow_unsandboxed`):
              its own session and process group, a scrubbed environment, rlimits; as root it runs as a uid of its
              own per call when such a uid can run this interpreter, else as root; otherwise as the user running astuner, who
              can kill the run (`os.kill(-1, 9)`). Where the kernel offers Landlock, reads are limited to the same
              paths and writes to its working folder (on the host's temp disk, only each file capped). The network,
              loopback services included (the log viewer), is reachable, and a grandchild that starts its own
              session escapes the group kill.

At both levels (astuner/tools/limits.py): each call gets its own cgroup where one is writable, holding everything
it starts, its files in memory included, to `memory_mb` + 2 x `_SCRATCH_BYTES` and `MAX_PROCESSES` more tasks;
every process is limited in address space, threads (RLIMIT_NPROC, per real uid: the threads that uid already runs
+ `MAX_PROCESSES`), open files, file size and core dumps, and is the OOM killer's first choice. stdin is closed;
the call returns when the snippet exits, even if something it started still holds its output.

The model's timeout counts from the snippet's start (the start byte below), not from bwrap's: a start that takes
longer than `STARTUP_LIMIT_S` is the infrastructure's failure, whatever timeout the model chose.

A sandbox that cannot start is not a tool result: the snippet's interpreter reports its start on a pipe before
running the code (`_BOOT`), and when that never comes the call raises `SandboxUnavailable` (a `ToolInfraError`,
recorded for the episode: astuner/tools/failures.py) instead of handing bwrap's error to the model.
"""

# No `from __future__ import annotations` here: AgentScope's Toolkit builds the tool's JSON schema from the
# runtime annotations of `execute_python_code`, and string annotations would not resolve.

import asyncio
import contextlib
import functools
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterator

from astuner.tools import bubblewrap as bw
from astuner.tools import landlock as lsm
from astuner.tools import limits
from astuner.tools.failures import record_failure, record_start

# The sandbox's parts (what the code sees, its process, its errors), also under the names they had here.
from astuner.tools.sandbox_child import READ_CHUNK as _READ_CHUNK  # noqa: F401
from astuner.tools.sandbox_child import Capture as _Capture
from astuner.tools.sandbox_child import Launch as _Launch
from astuner.tools.sandbox_child import PythonResult
from astuner.tools.sandbox_child import drain as _drain
from astuner.tools.sandbox_child import exited as _exited
from astuner.tools.sandbox_child import kill_group as _kill_group
from astuner.tools.sandbox_errors import SandboxRefused, SandboxUnavailable  # noqa: F401
from astuner.tools.sandbox_errors import unavailable as _unavailable
from astuner.tools.sandbox_view import DEVICES as _DEVICES  # noqa: F401
from astuner.tools.sandbox_view import ETC as _ETC  # noqa: F401
from astuner.tools.sandbox_view import SYSTEM as _SYSTEM  # noqa: F401
from astuner.tools.sandbox_view import child_env as _child_env
from astuner.tools.sandbox_view import landlock_ruleset as _landlock_ruleset
from astuner.tools.sandbox_view import own_folders as _own_folders
from astuner.tools.sandbox_view import visible as _visible
from astuner.tools.sandbox_view import within as _within  # noqa: F401
from astuner.watchdog import watch

if TYPE_CHECKING:
    from agentscope.tool import ToolResponse

# The model chooses the timeout of its own tool calls; cap it so one call cannot stall an episode.
MAX_TOOL_TIMEOUT = 120.0
DEFAULT_MEMORY_MB = 1024
# Seconds bwrap and the interpreter may take to reach the snippet (the start-up probe's limit too); the model's
# timeout starts after that.
STARTUP_LIMIT_S = 30.0
_SCRATCH_BYTES = 256 * 1024 * 1024  # each tmpfs of the bubblewrap sandbox (/tmp, the working folder)
_OPT_IN_KEY = "astuner.rollout.python_tool_unsandboxed"
# Run by `python -c` before the snippet: report the start on fd {fd} (then close it, so the code never holds it),
# and run the snippet as `python snippet.py` would (its own __main__, __file__ and argv). One line, so tracebacks
# gain one frame, `_BOOT_FRAME`, which is taken out of what the model sees.
_BOOT = ("import os, sys; os.write({fd}, b'1'); os.close({fd}); sys.argv[:] = sys.argv[1:]; __file__ = sys.argv[0]; "
         "__code = compile(open(__file__, 'rb').read(), __file__, 'exec'); del os, sys; exec(globals().pop('__code'))")
_BOOT_FRAME = 'Traceback (most recent call last):\n  File "<string>", line 1, in <module>\n'
log = logging.getLogger(__name__)
_allow_unsandboxed = False


def allow_unsandboxed(allowed: bool) -> None:
    """Let the process level run model code where bubblewrap cannot (the config key
    `astuner.rollout.python_tool_unsandboxed`). Call it at start, in every process that runs episodes."""
    global _allow_unsandboxed
    _allow_unsandboxed = bool(allowed)


# --- one launch, the same for a call and for the start-up probes --------------------------------------------


@contextlib.contextmanager
def _launch(level: str, user: str, executable: str, code: str, memory_mb: int, landlock: bool) -> Iterator[_Launch]:
    """A fresh folder holding the snippet and an empty working folder (deleted afterwards), and how to start
    `code` in it at `level` (as `user` at the process level), in a cgroup of its own where there is one (removed
    afterwards, with whatever still runs in it). Blocking: enter and leave it off the event loop."""
    root = tempfile.mkdtemp(prefix="astuner_py_")
    ruleset = -1
    read_fd, write_fd = os.pipe()
    cgroup = None
    try:
        with limits.uid_slot() as slot:
            script, workdir = os.path.join(root, "snippet.py"), os.path.join(root, "work")
            os.mkdir(workdir)
            with open(script, "w", encoding="utf-8") as f:
                f.write(code)
            # As root the code runs as this call's own uid: bubblewrap's setpriv, or the process level's set-up.
            uid = slot if user in ("nobody", "") else (0 if user == "root" else os.getuid())
            if os.geteuid() == 0 and user != "root":
                for path in (root, workdir, script):
                    os.chown(path, uid, uid)
            env = _child_env(workdir)
            # -I: no PYTHON* variables, no user site, no script folder on sys.path.
            argv = [executable, "-I", "-X", "utf8", "-u", "-c", _BOOT.format(fd=write_fd), script]
            if level == "bubblewrap":  # bwrap gets the rlimits; setpriv leaves root inside it
                argv = bw.command(_visible(executable), _SCRATCH_BYTES, root, workdir, env, argv,
                                  uid if os.geteuid() == 0 else None)
            elif landlock:
                ruleset = _landlock_ruleset(executable, root)
            cgroup = limits.call_cgroup(memory_mb * 1024 * 1024 + 2 * _SCRATCH_BYTES)
            child = limits.ChildLimits(memory_mb, limits.nproc_limit(uid, cgroup), cgroup,
                                       uid if level == "process" and user == "nobody" else None, ruleset)
            yield _Launch(argv, workdir, env, child.enter, read_fd, write_fd, cgroup)
    finally:
        for fd in (read_fd, write_fd, ruleset):
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
        if cgroup is not None:
            cgroup.remove()
        shutil.rmtree(root, ignore_errors=True)


def _run_probe(level: str, user: str, executable: str, landlock: bool = False) -> str:
    """'' when `executable` starts at this level, under the limits of a real call, else why not."""
    try:
        with _launch(level, user, executable, "import encodings, site", DEFAULT_MEMORY_MB, landlock) as launch:
            probe = subprocess.run(launch.argv, capture_output=True, timeout=STARTUP_LIMIT_S, cwd=launch.cwd,
                                   env=launch.env,
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
    too_old = bw.installed_version_problem(shutil.which("bwrap") or "bwrap")
    if too_old:
        return too_old
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


def describe_sandbox(unsandboxed: bool | None = None) -> str:
    """The start-up line: exactly what model-written code can and cannot reach here, for a run whose
    `astuner.rollout.python_tool_unsandboxed` is `unsandboxed` (None: this process's setting, `allow_unsandboxed`).
    The start-up plan passes the config's, so describing a run changes nothing in the process that describes it."""
    unsandboxed = _allow_unsandboxed if unsandboxed is None else unsandboxed
    folders = ", ".join(_own_folders(sys.executable)) or "in /usr"
    mib = 1024 * 1024
    if sandbox_level() == "bubblewrap":
        return (f"python tool sandbox: bubblewrap: the code sees only this interpreter ({folders}) and the system's "
                f"/usr, read-only, and writes only to its working folder and a private /tmp, both in memory "
                f"({_SCRATCH_BYTES // mib} MiB each); no home, no project, no data, no other users' files, nothing "
                f"written to disk; {_who_and_bounds()}; no network, own PID namespace")
    why = _bubblewrap_problem() or "bubblewrap not in use"
    plan = _process_plan(sys.executable, unsandboxed)
    if not plan.user:
        if os.geteuid() == 0:
            risk = ("as a uid of its own (or as root where such a uid cannot run this interpreter), and reach this "
                    "machine's loopback services (the log viewer included)")
        else:
            risk = (f"as you (uid {os.getuid()}): able to kill this run and its workers (os.kill(-1, 9)), read your "
                    f"files where the kernel lacks Landlock, and reach this machine's loopback services (the log "
                    f"viewer included)")
        opted = (f"; {_OPT_IN_KEY} is true but no user could start {sys.executable} ({plan.why.splitlines()[-1]})"
                 if unsandboxed and plan.why else "")
        return (f"python tool sandbox: REFUSED: {why}{opted}. Without bubblewrap the code would run {risk}. To use "
                f"bubblewrap: {bw.how_to_enable(why)}; or set {_OPT_IN_KEY}: true to accept the process sandbox")
    who = {"nobody": "runs as a uid of its own per call, which cannot signal this run",
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
            f"{limits.FILE_SIZE_LIMIT // mib} MiB each, with no total bound on that disk; own session, scrubbed "
            f"environment; {_who_and_bounds()}. For isolation: {bw.how_to_enable(why)}")


def _who_and_bounds() -> str:
    """What bounds one call in total, or that nothing does (astuner/tools/limits.py), for the start-up line."""
    mib = 1024 * 1024
    setup = limits.cgroup_setup()
    uid = "a uid of its own per call" if os.geteuid() == 0 else f"uid {os.getuid()}"
    if setup.version:
        total = DEFAULT_MEMORY_MB + 2 * _SCRATCH_BYTES // mib
        return (f"{uid}; each call in a cgroup ({setup.version}) of its own: at most {total} MiB in all (every "
                f"process it starts and the files it holds in memory) and {limits.MAX_PROCESSES} more tasks, each "
                f"process {DEFAULT_MEMORY_MB} MiB of address space")
    threads = (f"{limits.MAX_PROCESSES} more threads per call" if os.geteuid() == 0 else
               f"{limits.MAX_PROCESSES} more threads, a budget SHARED by this user's concurrent calls")
    return (f"{uid}; NO TOTAL MEMORY BOUND ({setup.why}): each process it starts may hold {DEFAULT_MEMORY_MB} MiB "
            f"of address space and in-memory files (memfd) up to {limits.OPEN_FILES} open files, so a call may "
            f"fork and hold several GiB; the OOM killer picks the sandbox first; {threads}")


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
    # Set-up and clean-up write files, read every /proc/*/status and wait for a cgroup to empty: off the loop.
    stack = contextlib.ExitStack()
    entering = asyncio.ensure_future(asyncio.to_thread(
        stack.enter_context, _launch(level, plan.user, sys.executable, code, memory_mb, plan.landlock)))
    try:
        launch = await asyncio.shield(entering)
    except asyncio.CancelledError:
        entering.add_done_callback(lambda _: stack.close())
        raise
    try:
        return await _supervise(launch, level, timeout, max_output_chars)
    finally:
        await asyncio.to_thread(stack.close)


async def _supervise(launch: _Launch, level: str, timeout: float, max_output_chars: int) -> PythonResult:
    """Start the launch, give it `STARTUP_LIMIT_S` to reach the snippet and the snippet `timeout`, and collect."""
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
    timed_out = started = missed = False
    try:
        started = await _start_reported(proc, launch)
        missed = not started and proc.returncode is None
        timed_out = started and not await _exited(proc, timeout, launch.cgroup)
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
    if not started:  # bwrap, setpriv or the interpreter failed (or hung) before the code ran: not the model's doing
        slow = f"it did not reach the snippet within {STARTUP_LIMIT_S:g} s (killed). " if missed else ""
        raise record_failure(_unavailable(level, proc.returncode, slow + stderr))
    record_start()
    stderr = stderr.replace(_BOOT_FRAME, _BOOT_FRAME.split("\n")[0] + "\n")
    notes = []
    if timed_out:
        notes.append(f"TimeoutError: execution exceeded {timeout:g} seconds and was killed.")
    if launch.cgroup is not None and launch.cgroup.oom_kills():
        total = DEFAULT_MEMORY_MB + 2 * _SCRATCH_BYTES // (1024 * 1024)
        notes.append(f"MemoryError: the code and the processes it started held more than {total} MiB in all "
                     f"(memory and in-memory files) and were killed.")
    stderr = "\n".join([stderr, *notes] if stderr else notes)
    peak = launch.cgroup.peak_bytes() if launch.cgroup is not None else None
    return PythonResult(proc.returncode, out.text(max_output_chars), stderr, timed_out, peak)


async def _start_reported(proc: asyncio.subprocess.Process, launch: _Launch) -> bool:
    """True once the interpreter reports reaching the snippet; False if it exits first or misses STARTUP_LIMIT_S."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + STARTUP_LIMIT_S
    while not launch.started() and proc.returncode is None and loop.time() < deadline:
        await asyncio.sleep(0.01)
    return launch.started()


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
