"""The bubblewrap command line of the Python tool's sandbox (astuner/tools/python_exec.py), and what to do when
bwrap cannot build it here.

The sandbox's file system starts empty: the given (host, sandbox) paths read-only, /dev (read-only, so its tmpfs
cannot hold files), /proc, and two tmpfs that are the only writable places, each capped at `scratch_bytes`: a
private /tmp and the working folder. Nothing the code writes reaches the host's disk; what bounds its memory in
total is the call's cgroup, where there is one (astuner/tools/limits.py).
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
from pathlib import Path

# --size (a tmpfs's cap) came in bubblewrap 0.6.0, --perms and --clearenv in 0.5.0; Debian 11 ships 0.4.1 and
# Ubuntu 20.04 0.4.0, where the sandbox would fail with "Unknown option".
MIN_VERSION = (0, 6, 0)
NOT_INSTALLED = "bubblewrap is not installed"
NO_SETPRIV = "setpriv (util-linux), which bubblewrap needs to leave root, is missing"
_SYSTEM_LINKS = ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")


@functools.lru_cache(maxsize=None)
def mounts(visible: tuple[tuple[str, str], ...], scratch_bytes: int) -> tuple[tuple[str, ...], frozenset[str]]:
    """bwrap's namespaces and its file system, built from an empty root (module docstring); and the folders that
    exist in it (so per-call mounts know what to create)."""
    args = [shutil.which("bwrap") or "bwrap"]
    # As root, bwrap mounts with its own privileges (no user namespace) and `setpriv` then becomes nobody inside,
    # so the snippet runs as a real unprivileged uid; otherwise bwrap runs unprivileged in a user namespace.
    if os.geteuid() == 0:
        args += ["--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts", "--unshare-cgroup-try"]
    else:
        args += ["--unshare-all"]
    args += ["--die-with-parent", "--new-session"]
    made = {"/", "/dev", "/proc", "/tmp"}
    args += ["--dev", "/dev", "--proc", "/proc", "--perms", "1777", "--size", str(scratch_bytes), "--tmpfs", "/tmp"]
    for src, dst in visible:
        if dst in _SYSTEM_LINKS and os.path.islink(dst):
            args += ["--symlink", os.readlink(dst), dst]
        else:
            args += make_parents(dst, made) + ["--ro-bind", src, dst]
        made.add(dst)
    return tuple(args), frozenset(made)


def make_parents(path: str, made: set[str]) -> list[str]:
    """Folders above `path` that the sandbox lacks, made enterable (bwrap would create them 0700)."""
    args: list[str] = []
    parts = path.split(os.sep)
    for i in range(2, len(parts)):
        folder = os.sep.join(parts[:i])
        if folder not in made:
            made.add(folder)
            args += ["--perms", "0755", "--dir", folder]
    return args


def command(visible: tuple[tuple[str, str], ...], scratch_bytes: int, root: str, workdir: str,
            env: dict[str, str], argv: list[str], uid: int | None = None) -> list[str]:
    """The full command: `root` (holding the snippet, on the host) read-only, `workdir` inside it a fresh capped
    tmpfs, the environment `env` alone, then `argv` (as `uid`, which astuner running as root must give)."""
    fixed, made = mounts(visible, scratch_bytes)
    made = set(made)
    setenv = [arg for key, value in env.items() for arg in ("--setenv", key, value)]
    user: list[str] = []
    if os.geteuid() == 0:
        user = [shutil.which("setpriv") or "setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups",
                "--inh-caps=-all", "--bounding-set=-all"]
    return [*fixed, *make_parents(root, made), "--ro-bind", root, root,
            "--perms", "1777", "--size", str(scratch_bytes), "--tmpfs", workdir,
            "--remount-ro", "/", "--remount-ro", "/dev", "--chdir", workdir, "--clearenv", *setenv, "--", *user, *argv]


def parse_version(text: str) -> tuple[int, ...] | None:
    """(major, minor, patch) from `bwrap --version`'s output ("bubblewrap 0.8.0"), None when it names none."""
    found = re.search(r"(\d+)\.(\d+)(?:\.(\d+))?", text)
    return tuple(int(part or 0) for part in found.groups()) if found else None


def version_problem(version_text: str) -> str:
    """'' when this bwrap (its `--version` output) is recent enough for the sandbox, else why not."""
    version = parse_version(version_text)
    if version is None or version >= MIN_VERSION:
        return ""  # an unknown version is tried: the start-up probe says whether it works
    return (f"bubblewrap {'.'.join(map(str, version))} is too old (the sandbox needs "
            f"{'.'.join(map(str, MIN_VERSION))}, for --size)")


def installed_version_problem(bwrap: str) -> str:
    """version_problem for the installed bwrap."""
    try:
        done = subprocess.run([bwrap, "--version"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return ""
    return version_problem(done.stdout + done.stderr)


def _sysctl(name: str) -> str | None:
    try:
        return Path("/proc/sys", *name.split(".")).read_text().strip()
    except OSError:
        return None


def how_to_enable(problem: str) -> str:
    """What lets bwrap build its sandbox here, given why it cannot (`problem`) and this host's own settings."""
    if problem == NOT_INSTALLED:
        return "install it (apt-get install bubblewrap)"
    if problem == NO_SETPRIV:
        return "apt-get install util-linux"
    if "is too old" in problem or "Unknown option" in problem:
        minimum = ".".join(map(str, MIN_VERSION))
        return (f"upgrade bubblewrap to >= {minimum} (Debian 12 and Ubuntu 22.04 ship one; or build it from "
                f"https://github.com/containers/bubblewrap)")
    if "Resource temporarily unavailable" in problem:  # EAGAIN from clone: a per-user limit, not a permission
        return ("this user runs too many threads for its process limit (ulimit -u), or has used up "
                "user.max_user_namespaces: raise the one that is reached")
    if os.geteuid() == 0:
        # Without a user namespace bwrap needs CAP_SYS_ADMIN to mount; a container usually withholds it.
        return ("run astuner as a user other than root, or give this container the right to mount (docker run "
                "--cap-add SYS_ADMIN --security-opt seccomp=unconfined --security-opt apparmor=unconfined)")
    # Unprivileged, bwrap needs a user namespace; each of these settings can forbid it.
    fixes = []
    if _sysctl("kernel.unprivileged_userns_clone") == "0":
        fixes.append("sysctl -w kernel.unprivileged_userns_clone=1")
    if _sysctl("user.max_user_namespaces") == "0":
        fixes.append("sysctl -w user.max_user_namespaces=15000")
    if _sysctl("kernel.apparmor_restrict_unprivileged_userns") == "1":  # Ubuntu 23.10 and later
        fixes.append("sysctl -w kernel.apparmor_restrict_unprivileged_userns=0 (or an AppArmor profile for bwrap "
                     "that grants userns)")
    if not fixes:
        fixes.append("allow unprivileged user namespaces (in a container: docker run --security-opt "
                     "seccomp=unconfined --security-opt apparmor=unconfined)")
    return "as root: " + "; ".join(fixes)
