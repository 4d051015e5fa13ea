"""Run model-written Python in a sandboxed child process with a time, memory, process and output limit.

The code must see nothing of the user's: a policy that can read the training data learns to read the answer
instead of computing it. What it may read is this interpreter (its venv and its base installation, each bound
alone, never the folder holding it: a venv inside the project exposes the venv, not the project), the system's
/usr and the few /etc files the loader and SSL need (`_visible`). Its only writable place is an empty scratch
folder, deleted after the call.

Two levels, chosen once per process and named at start (`describe_sandbox()`):

  bubblewrap  (Debian's `bubblewrap`, when installed and usable): the code's file system is built from those
              paths alone, read-only, plus the scratch folder and a private /tmp: no home, no project, no data,
              no other users' files. New PID, network, IPC and UTS namespaces: it sees only its own processes
              (not the trainer's /proc/<pid>/environ), has no network (loopback included), and every process it
              starts dies with it; killed if astuner dies. As root, it runs as uid 65534 inside.
  process     (fallback): its own session and process group, killed as a group at the end; a scrubbed
              environment; rlimits. Never as root: as root it runs as uid 65534, which must be able to run this
              interpreter (it cannot run one under /root, e.g. pyenv's); if it cannot, the tool refuses
              (`SandboxRefused`, naming bubblewrap) unless `allow_unsandboxed(True)` was called. Where the kernel
              offers Landlock, reads are limited to the same paths as above and writes to the scratch folder;
              without it, every file that user may read is readable (as uid 65534: world-readable files). The
              network is reachable, and a grandchild that starts its own session escapes the group kill.

At both levels: address space, processes, file size and core dumps are limited (uid 65534 or a non-root user, so
RLIMIT_NPROC holds); stdin is closed; the call returns when the snippet exits, even if something it started still
holds its output.
"""

# No `from __future__ import annotations` here: AgentScope's Toolkit builds the tool's JSON schema from the
# runtime annotations of `execute_python_code`, and string annotations would not resolve.

import asyncio
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
from typing import TYPE_CHECKING, Any

from astuner.errors import UserError
from astuner.tools import landlock as lsm
from astuner.watchdog import watch

if TYPE_CHECKING:
    from agentscope.tool import ToolResponse

# The model chooses the timeout of its own tool calls; cap it so one call cannot stall an episode.
MAX_TOOL_TIMEOUT = 120.0
_FILE_SIZE_LIMIT = 256 * 1024 * 1024  # bytes one file written by the code may reach
_READ_CHUNK = 65536
_MAX_PROCESSES = 64  # processes (threads count too) the snippet's user may run at once, beyond those it has
_NOBODY = 65534
_INSTALL = "apt-get install bubblewrap"
_OPT_IN_KEY = "astuner.rollout.python_tool_unsandboxed"
_SYSTEM = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
# The loader's cache, SSL certificates, time zone, fonts, Debian's sitecustomize: system files, nothing of a user's.
_ETC = ("ld.so.cache", "ld.so.conf", "ld.so.conf.d", "alternatives", "ssl", "pki", "ca-certificates",
        "crypto-policies", "localtime", "fonts", "mime.types", "python3*")
_DEVICES = ("/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom")
log = logging.getLogger(__name__)
_allow_unsandboxed = False


class SandboxRefused(UserError):
    """No sandbox can keep model-written code from running as root here; the message says how to get one."""


def allow_unsandboxed(allowed: bool) -> None:
    """Let the process level run model code as root when uid 65534 cannot run this interpreter (the config key
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


# --- bubblewrap --------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def _bubblewrap_problem() -> str:
    """'' when bwrap is installed and can build its sandbox here, else why not."""
    if shutil.which("bwrap") is None:
        return "bubblewrap is not installed"
    if os.geteuid() == 0 and shutil.which("setpriv") is None:
        return "setpriv (util-linux), which bubblewrap needs to leave root, is missing"
    probe_root = tempfile.mkdtemp(prefix="astuner_py_")
    try:
        command = _bwrap_command(probe_root, probe_root, {}, [sys.executable, "-I", "-c", "pass"])
        probe = subprocess.run(command, capture_output=True, timeout=20)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"bubblewrap cannot run here ({exc})"
    finally:
        shutil.rmtree(probe_root, ignore_errors=True)
    if probe.returncode != 0:
        why = probe.stderr.decode(errors="replace").strip()[:200]
        log.warning("bubblewrap is installed but cannot run here (%s); falling back to the process sandbox", why)
        return f"bubblewrap cannot run here ({why})"
    return ""


@functools.lru_cache(maxsize=1)
def sandbox_level() -> str:
    """'bubblewrap' when bwrap is installed and can create its namespaces here, else 'process'."""
    return "process" if _bubblewrap_problem() else "bubblewrap"


@functools.lru_cache(maxsize=None)
def _bwrap_mounts(executable: str) -> tuple[tuple[str, ...], frozenset[str]]:
    """bwrap's namespaces and its file system, built from an empty root: `_visible` read-only, /dev, /proc and a
    private /tmp; and the folders that exist in it (so per-call mounts know what to create)."""
    args = [shutil.which("bwrap") or "bwrap"]
    # As root, bwrap mounts with its own privileges (no user namespace) and `setpriv` then becomes nobody inside,
    # so the snippet runs as a real unprivileged uid; otherwise bwrap runs unprivileged in a user namespace.
    if os.geteuid() == 0:
        args += ["--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts", "--unshare-cgroup-try"]
    else:
        args += ["--unshare-all"]
    args += ["--die-with-parent", "--new-session"]
    made = {"/", "/dev", "/proc", "/tmp"}
    args += ["--dev", "/dev", "--proc", "/proc", "--perms", "1777", "--tmpfs", "/tmp"]
    for src, dst in _visible(executable):
        if dst in _SYSTEM and os.path.islink(dst):
            args += ["--symlink", os.readlink(dst), dst]
        else:
            args += _make_parents(dst, made) + ["--ro-bind", src, dst]
        made.add(dst)
    return tuple(args), frozenset(made)


def _make_parents(path: str, made: set[str]) -> list[str]:
    """Folders above `path` that the sandbox lacks, made enterable (bwrap would create them 0700)."""
    args: list[str] = []
    parts = path.split(os.sep)
    for i in range(2, len(parts)):
        folder = os.sep.join(parts[:i])
        if folder not in made:
            made.add(folder)
            args += ["--perms", "0755", "--dir", folder]
    return args


def _bwrap_command(root: str, workdir: str, env: dict[str, str], command: list[str]) -> list[str]:
    mounts, made = _bwrap_mounts(sys.executable)
    made = set(made)
    setenv = [arg for key, value in env.items() for arg in ("--setenv", key, value)]
    user = []
    if os.geteuid() == 0:
        user = [shutil.which("setpriv") or "setpriv", f"--reuid={_NOBODY}", f"--regid={_NOBODY}", "--clear-groups",
                "--inh-caps=-all", "--bounding-set=-all"]
    return [*mounts, *_make_parents(root, made), "--bind", root, root, "--remount-ro", "/", "--chdir", workdir,
            "--clearenv", *setenv, "--", *user, *command]


# --- process level: uid 65534 and Landlock -----------------------------------------------------------------

def _landlock_abi() -> int:
    return lsm.abi()


def _landlock_ruleset(executable: str, scratch: str) -> int:
    """A Landlock ruleset (an fd, close it) allowing reads of `_visible`, the usual devices, and anything inside
    `scratch`; every other path is closed, whoever owns it."""
    rules = [(src, lsm.READ_ONLY) for src, _ in _visible(executable)]
    rules += [(dev, lsm.DEVICE) for dev in _DEVICES]
    return lsm.ruleset(rules, scratch)


def _drop_privileges() -> None:
    """As root, become nobody: rlimits are enforced and root-owned files (/proc/<pid>/environ) are unreadable."""
    os.setgroups([])
    os.setgid(_NOBODY)
    os.setuid(_NOBODY)


def _enter_process_sandbox(user: str, ruleset: int, memory_mb: int, base_processes: int) -> None:
    """Runs in the child between fork and exec: leave root, enter the Landlock ruleset, set the rlimits."""
    if user == "nobody":
        _drop_privileges()
    if ruleset >= 0:
        lsm.restrict_self(ruleset)
    memory = memory_mb * 1024 * 1024
    resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    resource.setrlimit(resource.RLIMIT_FSIZE, (_FILE_SIZE_LIMIT, _FILE_SIZE_LIMIT))
    # Counted per real user: nobody's other processes (or, not as root, the user's own) count against it.
    nproc = base_processes + _MAX_PROCESSES
    resource.setrlimit(resource.RLIMIT_NPROC, (nproc, nproc))


@dataclass(frozen=True)
class _ProcessPlan:
    user: str  # "nobody" (uid 65534), "self" (not root: the user running astuner), "root" (opted in), "" (refused)
    landlock: bool
    why: str = ""  # when refused: why uid 65534 cannot run the interpreter


@functools.lru_cache(maxsize=None)
def _process_plan(executable: str, allow_root: bool) -> _ProcessPlan:
    """Who runs the code at the process level, and whether Landlock holds: the first that starts the interpreter."""
    users = ["nobody", *(["root"] if allow_root else [])] if os.geteuid() == 0 else ["self"]
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
    root = tempfile.mkdtemp(prefix="astuner_py_")
    ruleset = -1
    try:
        if user == "nobody":
            os.chown(root, _NOBODY, _NOBODY)
        ruleset = _landlock_ruleset(executable, root) if landlock else -1
        probe = subprocess.run(
            [executable, "-I", "-c", "import encodings, site"], capture_output=True, timeout=30, cwd=root,
            env=_child_env(root), stdin=subprocess.DEVNULL,
            preexec_fn=partial(_enter_process_sandbox, user, ruleset, 1024, _other_processes()),
        )
    except (OSError, subprocess.SubprocessError) as exc:
        return str(exc)
    finally:
        if ruleset >= 0:
            os.close(ruleset)
        shutil.rmtree(root, ignore_errors=True)
    if probe.returncode != 0:
        return probe.stderr.decode(errors="replace").strip()[-300:] or f"exit status {probe.returncode}"
    return ""


def _other_processes() -> int:
    """Processes the snippet's user already runs (RLIMIT_NPROC counts them): none for nobody, root ignores it."""
    if os.geteuid() == 0:
        return 0
    uid = os.getuid()
    count = 0
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                count += os.stat(f"/proc/{entry}").st_uid == uid
            except OSError:
                pass
    return count


def describe_sandbox() -> str:
    """The start-up line: exactly what model-written code can and cannot reach here."""
    folders = ", ".join(_own_folders(sys.executable)) or "in /usr"
    if sandbox_level() == "bubblewrap":
        uid = _NOBODY if os.geteuid() == 0 else os.getuid()
        return (f"python tool sandbox: bubblewrap: the code sees only this interpreter ({folders}) and the system's "
                f"/usr, read-only, an empty working folder and a private /tmp; no home, no project, no data, no "
                f"other users' files; uid {uid}, no network, own PID namespace, process and memory limits")
    plan = _process_plan(sys.executable, _allow_unsandboxed)
    why = _bubblewrap_problem() or "bubblewrap not in use"
    if not plan.user:
        return (f"python tool sandbox: REFUSED: {why}, and uid {_NOBODY} cannot run this interpreter "
                f"({sys.executable}: {plan.why.splitlines()[-1] if plan.why else 'no access'}), so model code would "
                f"run as root. Install bubblewrap ({_INSTALL}), or set {_OPT_IN_KEY}: true to run it as root")
    who = {"nobody": f"runs as uid {_NOBODY} (nobody)", "self": f"runs as you (uid {os.getuid()})",
           "root": f"RUNS AS ROOT, UNSANDBOXED ({_OPT_IN_KEY}: true)"}[plan.user]
    if plan.landlock:
        files = (f"Landlock limits its reads to this interpreter ({folders}) and /usr, and its writes to an empty "
                 f"working folder")
    else:
        files = {"nobody": "files only you can read are out of reach, but WORLD-READABLE FILES ARE READABLE (a "
                           "project or data set under /srv, /opt or a home folder others may enter)",
                 "self": "YOUR FILES ARE READABLE (the project, its data, your home)",
                 "root": "EVERY FILE IS READABLE AND WRITABLE"}[plan.user]
    return (f"python tool sandbox: process level ({why}): {who}; {files}; the network is reachable; own session, "
            f"scrubbed environment, process and memory limits. Install bubblewrap ({_INSTALL}) for isolation")


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
    code: str, timeout: float = 10.0, memory_mb: int = 1024, max_output_chars: int = 8000
) -> PythonResult:
    """Run `code` with this interpreter in the sandbox (module docstring), in a fresh scratch directory (deleted
    afterwards), killed with everything it started after `timeout` seconds. stdout and stderr are each cut to
    `max_output_chars` (head and tail kept). Raises `SandboxRefused` where only root could run it (see
    `describe_sandbox`)."""
    with watch("tool", "python"):
        return await _run_python(code, timeout, memory_mb, max_output_chars)


async def _run_python(code: str, timeout: float, memory_mb: int, max_output_chars: int) -> PythonResult:
    level = sandbox_level()
    is_root = os.geteuid() == 0
    user = "" if level == "bubblewrap" else _process_plan(sys.executable, _allow_unsandboxed).user
    if level == "process" and not user:
        raise SandboxRefused(describe_sandbox().removeprefix("python tool sandbox: "))
    root = tempfile.mkdtemp(prefix="astuner_py_")
    ruleset = -1
    try:
        script = os.path.join(root, "snippet.py")
        workdir = os.path.join(root, "work")
        os.mkdir(workdir)
        with open(script, "w", encoding="utf-8") as f:
            f.write(code)
        if is_root and user != "root":
            for path in (root, workdir, script):
                os.chown(path, _NOBODY, _NOBODY)
        env = _child_env(workdir)
        command = [sys.executable, "-I", "-X", "utf8", "-u", script]  # -I: no PYTHON* variables, no user site
        if level == "bubblewrap":  # bwrap gets the rlimits; setpriv leaves root inside it
            command = _bwrap_command(root, workdir, env, command)
        elif _process_plan(sys.executable, _allow_unsandboxed).landlock:
            ruleset = _landlock_ruleset(sys.executable, root)
        try:
            proc = await asyncio.create_subprocess_exec(
                *command,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                cwd=workdir,
                env=env,
                start_new_session=True,
                preexec_fn=partial(_enter_process_sandbox, user, ruleset, memory_mb, _other_processes()),
            )
        finally:
            if ruleset >= 0:
                os.close(ruleset)
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
