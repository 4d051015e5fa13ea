"""What model-written code sees in the Python tool's sandbox (astuner/tools/python_exec.py): the paths it may read,
bound alone by bubblewrap or allowed by Landlock at the process level, and the small environment it runs with."""

import functools
import glob
import os
import site
import sys

from astuner.tools import landlock as lsm

SYSTEM = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
# The loader's cache, SSL certificates, time zone, fonts, Debian's sitecustomize: system files, nothing of a user's.
ETC = ("ld.so.cache", "ld.so.conf", "ld.so.conf.d", "alternatives", "ssl", "pki", "ca-certificates",
       "crypto-policies", "localtime", "fonts", "mime.types", "python3*")
DEVICES = ("/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom")


def within(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder.rstrip(os.sep) + os.sep)


@functools.lru_cache(maxsize=None)
def visible(executable: str) -> tuple[tuple[str, str], ...]:
    """(host path, sandbox path) pairs the code may read: /usr and the system library folders, a few /etc files,
    then this interpreter's own folders (prefixes, site-packages) and the executable itself, bound alone. A path
    reached through a symlink is bound at both its names. A pair inside another is dropped."""
    system = [p for p in SYSTEM if os.path.lexists(p)]
    etc = sorted(m for pattern in ETC for m in glob.glob(os.path.join("/etc", pattern)))
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
        covered = any(within(dst, d) for d in bound) and any(within(src, d) for d in bound)
        if not covered:
            kept.append((src, dst))
    return tuple(kept)


def own_folders(executable: str) -> list[str]:
    """The interpreter's own paths in the sandbox (named at start)."""
    return [d for _, d in visible(executable) if not any(within(d, s) for s in (*SYSTEM, "/etc"))]


def landlock_ruleset(executable: str, scratch: str) -> int:
    """A Landlock ruleset (an fd, close it) allowing reads of `visible`, the usual devices, and anything inside
    `scratch`; every other path is closed, whoever owns it."""
    rules = [(src, lsm.READ_ONLY) for src, _ in visible(executable)]
    rules += [(dev, lsm.DEVICE) for dev in DEVICES]
    return lsm.ruleset(rules, scratch)


def child_env(workdir: str) -> dict[str, str]:
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
