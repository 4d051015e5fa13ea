"""What bounds one call of the Python tool's sandbox (astuner/tools/python_exec.py) in total, not per process.

RLIMIT_AS bounds each process, not a call: a snippet may fork 64 children with 1 GiB each, and `memfd_create` files
count against no rlimit and no tmpfs cap (their pages are in no process's RSS, so the OOM killer would pick the
trainer or vLLM instead). A cgroup per call bounds them all: every page its processes charge, tmpfs and memfd pages
included (shmem is charged to the writer's memory cgroup), and how many tasks (processes and threads) it holds.
Chosen once per process (`cgroup_setup()`, named in the start-up line):

  v2    the unified hierarchy, when its memory and pids controllers can be enabled below this process's cgroup
        (as root, or where that cgroup is delegated to the user); astuner moves itself into a leaf of its own
        first when its cgroup holds only itself, as cgroup v2 wants processes only in leaves;
  v1    the memory and pids hierarchies, when writable (as root);
  none  only the per-process rlimits hold. The sandbox is then the OOM killer's first choice (oom_score_adj 1000,
        set in every case), and the open files it may hold are few (RLIMIT_NOFILE), so memfds stay few.

RLIMIT_NPROC counts the threads of a real uid, so concurrent calls under one uid share one budget: a fork bomb in
one episode would starve another episode's correct code. As root each call runs as a uid of its own (`uid_slot`,
from a range reserved per astuner process and released after the call); a non-root user's calls share the user's
uid, and only a cgroup's per-call pids limit keeps them apart.
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import functools
import itertools
import os
import resource
import signal
import threading
import time
from dataclasses import dataclass
from typing import Iterator

from astuner.tools import landlock as lsm

MAX_PROCESSES = 64  # threads (processes count as one each) one call may add
OPEN_FILES = 256  # each process's open files: also bounds its memfds, which no size limit sees
FILE_SIZE_LIMIT = 256 * 1024 * 1024  # bytes one file written by the code may reach
_BWRAP_TASKS = 4  # bwrap's own processes in a call's cgroup (the outer one, the namespace's init)
_UID_BASE = 2_000_000_000  # far above any distribution's users and systemd's dynamic users
_UID_SLOTS = 256  # concurrent calls per astuner process, each with its own uid
_CGROUP_FS = "/sys/fs/cgroup"


@dataclass(frozen=True)
class CgroupSetup:
    """Where this process's call cgroups go: `version` 'v2', 'v1' or '' (none usable, `why`)."""

    version: str
    parents: tuple[str, ...] = ()  # one folder (v2), or memory's and pids' (v1), holding a cgroup per call
    why: str = ""


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


def own_cgroups(proc_cgroup: str) -> dict[str, str]:
    """This process's cgroup per hierarchy, from /proc/self/cgroup's text: v1's controllers by name, v2's as ''."""
    found: dict[str, str] = {}
    for line in proc_cgroup.splitlines():
        _, controllers, path = line.split(":", 2)
        for name in controllers.split(",") if controllers else [""]:
            found[name] = path
    return found


def v1_mounts(mounts: str) -> dict[str, str]:
    """Where each v1 controller is mounted, from /proc/self/mounts' text."""
    found: dict[str, str] = {}
    for line in mounts.splitlines():
        fields = line.split()
        if len(fields) >= 4 and fields[2] == "cgroup":
            for option in fields[3].split(","):
                found.setdefault(option, fields[1])
    return found


def _make_parent(path: str, controllers: str = "") -> str:
    """Create `path` (a cgroup for this process's calls), enable `controllers` for its children (v2); return it."""
    os.makedirs(path, exist_ok=True)
    if controllers:
        _write(os.path.join(path, "cgroup.subtree_control"), controllers)
    return path


def _setup_v2() -> CgroupSetup:
    own = own_cgroups(_read("/proc/self/cgroup")).get("", "/")
    base = os.path.join(_CGROUP_FS, own.lstrip("/"))
    missing = {"memory", "pids"} - set(_read(os.path.join(base, "cgroup.controllers")).split())
    if missing:
        return CgroupSetup("", why=f"cgroup v2 does not give {base} the {' and '.join(sorted(missing))} controller")
    try:
        _write(os.path.join(base, "cgroup.subtree_control"), "+memory +pids")
    except OSError as exc:
        if exc.errno != errno.EBUSY or _read(os.path.join(base, "cgroup.procs")).split() != [str(os.getpid())]:
            return CgroupSetup("", why=f"cgroup v2: cannot enable memory and pids below {base} ({exc.strerror}); "
                                       f"run astuner in a cgroup of its own delegated to it")
        # Only leaves hold processes in cgroup v2: move astuner into one, then its cgroup may have children.
        leaf = _make_parent(os.path.join(base, f"astuner-{os.getpid()}-main"))
        _write(os.path.join(leaf, "cgroup.procs"), str(os.getpid()))
        _write(os.path.join(base, "cgroup.subtree_control"), "+memory +pids")
    return CgroupSetup("v2", (_make_parent(os.path.join(base, f"astuner-{os.getpid()}"), "+memory +pids"),))


def _setup_v1() -> CgroupSetup:
    own, mounted = own_cgroups(_read("/proc/self/cgroup")), v1_mounts(_read("/proc/self/mounts"))
    if not {"memory", "pids"} <= set(mounted):
        return CgroupSetup("", why="no cgroup v2 with memory and pids, and no cgroup v1 memory and pids hierarchies")
    parents = tuple(_make_parent(os.path.join(mounted[c], own.get(c, "/").lstrip("/"), f"astuner-{os.getpid()}"))
                    for c in ("memory", "pids"))
    return CgroupSetup("v1", parents)


@functools.lru_cache(maxsize=1)
def cgroup_setup() -> CgroupSetup:
    """The cgroups this process can give each call (module docstring), tried once: a trial call cgroup is made,
    limited and removed, so a setup that is returned works."""
    try:
        setup = _setup_v2() if os.path.exists(os.path.join(_CGROUP_FS, "cgroup.controllers")) else _setup_v1()
    except OSError as exc:
        return CgroupSetup("", why=f"no writable cgroup ({exc.strerror}: {exc.filename})")
    if setup.version:
        atexit.register(_remove_parents, setup)
        try:
            CallCgroup(setup, "probe", 64 << 20, 8).remove()
        except OSError as exc:
            return CgroupSetup("", why=f"cgroup {setup.version} is not writable here ({exc.strerror}: {exc.filename})")
    return setup


def _remove_parents(setup: CgroupSetup) -> None:
    for parent in setup.parents:
        with contextlib.suppress(OSError):
            os.rmdir(parent)


_call_numbers = itertools.count()


class CallCgroup:
    """One call's cgroup: at most `memory_bytes` charged (pages, tmpfs and memfd files, no swap) and `tasks` tasks.
    The child joins it before it execs (`join`, in its pre-exec), so no code of the snippet runs outside it."""

    def __init__(self, setup: CgroupSetup, name: str, memory_bytes: int, tasks: int) -> None:
        self.setup = setup
        self.paths = tuple(os.path.join(parent, f"{name}-{next(_call_numbers)}") for parent in setup.parents)
        for path in self.paths:
            os.mkdir(path)
        try:
            if setup.version == "v2":
                (path,) = self.paths
                _write(os.path.join(path, "memory.max"), str(memory_bytes))
                with contextlib.suppress(FileNotFoundError):  # no swap accounting on this kernel: no swap to use
                    _write(os.path.join(path, "memory.swap.max"), "0")
                _write(os.path.join(path, "pids.max"), str(tasks))
            else:
                memory, pids = self.paths
                _write(os.path.join(memory, "memory.limit_in_bytes"), str(memory_bytes))
                with contextlib.suppress(FileNotFoundError):
                    _write(os.path.join(memory, "memory.memsw.limit_in_bytes"), str(memory_bytes))
                _write(os.path.join(pids, "pids.max"), str(tasks))
        except OSError:
            self.remove()
            raise

    def join(self) -> None:
        """Move the calling process into this cgroup (runs in the child between fork and exec)."""
        for path in self.paths:
            _write(os.path.join(path, "cgroup.procs"), str(os.getpid()))

    def oom_kills(self) -> int:
        """Processes the kernel killed because the call reached its memory limit."""
        name = "memory.events" if self.setup.version == "v2" else "memory.oom_control"
        with contextlib.suppress(OSError, ValueError):
            for line in _read(os.path.join(self.paths[0], name)).splitlines():
                if line.startswith("oom_kill "):
                    return int(line.split()[1])
        return 0

    def peak_bytes(self) -> int | None:
        """The most memory the call held at once (None where the kernel does not say)."""
        name = "memory.peak" if self.setup.version == "v2" else "memory.max_usage_in_bytes"
        with contextlib.suppress(OSError, ValueError):
            return int(_read(os.path.join(self.paths[0], name)))
        return None

    def remove(self, wait_s: float = 5.0) -> None:
        """Kill whatever the call left running, then delete the cgroup."""
        deadline = time.monotonic() + wait_s
        for path in self.paths:
            while True:
                with contextlib.suppress(FileNotFoundError):
                    pids = [int(p) for p in _read(os.path.join(path, "cgroup.procs")).split()]
                    for pid in pids:
                        with contextlib.suppress(ProcessLookupError):
                            os.kill(pid, signal.SIGKILL)
                try:
                    os.rmdir(path)
                    break
                except FileNotFoundError:
                    break
                except OSError as exc:  # EBUSY until the killed processes are gone
                    if exc.errno != errno.EBUSY or time.monotonic() > deadline:
                        raise
                    time.sleep(0.01)


# --- one uid per call, as root -------------------------------------------------------------------------------

_taken: set[int] = set()
_taken_lock = threading.Lock()


@contextlib.contextmanager
def uid_slot() -> Iterator[int]:
    """A uid for one call: as root, one no other running call of any astuner process has (its RLIMIT_NPROC is then
    the call's own), released afterwards; not root, the user's own uid (shared by concurrent calls)."""
    if os.geteuid() != 0:
        yield os.getuid()
        return
    first = _UID_BASE + (os.getpid() % (1 << 22)) * _UID_SLOTS  # below 2**32 - 1 for every pid Linux gives
    with _taken_lock:
        free = [k for k in range(_UID_SLOTS) if k not in _taken]
        k = free[0] if free else len(_taken) % _UID_SLOTS  # more calls at once than slots: two share a uid
        _taken.add(k)
    try:
        yield first + k
    finally:
        with _taken_lock:
            _taken.discard(k)


def threads_of(uid: int) -> int:
    """Threads `uid` runs now, which RLIMIT_NPROC counts (per real uid; a trainer holds hundreds); 0 for root,
    whom the limit does not bind. Reads every /proc/*/status: call it off the event loop."""
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


@dataclass(frozen=True)
class ChildLimits:
    """What the child sets between fork and exec, in this order: join the call's cgroup (while still privileged),
    become the OOM killer's first choice, leave root (process level), enter Landlock, set the rlimits."""

    memory_mb: int
    nproc: int | None  # RLIMIT_NPROC; None where a cgroup's pids limit is the call's own and the uid is shared
    cgroup: CallCgroup | None = None
    uid: int | None = None  # process level as root: the uid to become
    landlock_ruleset: int = -1

    def enter(self) -> None:
        if self.cgroup is not None:
            self.cgroup.join()
        with contextlib.suppress(OSError):  # anyone may raise their own score
            _write("/proc/self/oom_score_adj", "1000")
        if self.uid is not None:
            os.setgroups([])
            os.setgid(self.uid)
            os.setuid(self.uid)  # rlimits are enforced and root-owned files (/proc/<pid>/environ) are unreadable
        if self.landlock_ruleset >= 0:
            lsm.restrict_self(self.landlock_ruleset)
        memory = self.memory_mb * 1024 * 1024
        resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        resource.setrlimit(resource.RLIMIT_FSIZE, (FILE_SIZE_LIMIT, FILE_SIZE_LIMIT))
        resource.setrlimit(resource.RLIMIT_NOFILE, (OPEN_FILES, OPEN_FILES))
        if self.nproc is not None:
            resource.setrlimit(resource.RLIMIT_NPROC, (self.nproc, self.nproc))


def nproc_limit(uid: int, cgroup: CallCgroup | None) -> int | None:
    """RLIMIT_NPROC for a call as `uid`: the threads that uid runs now + MAX_PROCESSES. Not set for a user's own uid
    where the call has a cgroup: that budget is shared with the user's other calls, the cgroup's is the call's own."""
    if cgroup is not None and os.geteuid() != 0:
        return None
    return threads_of(uid) + MAX_PROCESSES


def call_cgroup(memory_bytes: int) -> CallCgroup | None:
    """A fresh cgroup for one call where this process has cgroups to give (else None)."""
    setup = cgroup_setup()
    return CallCgroup(setup, "call", memory_bytes, MAX_PROCESSES + _BWRAP_TASKS) if setup.version else None
