"""Landlock (linux/landlock.h): a process may limit the files it and its children can open, whoever owns
them. The Python tool's process level uses it, where the kernel offers it, to show model code only the paths
bubblewrap would (astuner/tools/python_exec.py). Plain ctypes over syscall(2): the same syscall numbers on every
architecture (x86-64, arm64, ...)."""

from __future__ import annotations

import ctypes
import functools
import os
import sys
from typing import Any, Iterable

_SYS_LANDLOCK_CREATE_RULESET, _SYS_LANDLOCK_ADD_RULE, _SYS_LANDLOCK_RESTRICT_SELF = 444, 445, 446
_PR_SET_NO_NEW_PRIVS = 38
_LL_EXECUTE, _LL_WRITE_FILE, _LL_READ_FILE, _LL_READ_DIR = 1 << 0, 1 << 1, 1 << 2, 1 << 3
_LL_V1 = (1 << 13) - 1  # ABI 1's rights: execute, write and read files, read folders, remove and make entries
_LL_REFER, _LL_TRUNCATE, _LL_IOCTL_DEV = 1 << 13, 1 << 14, 1 << 15
READ_ONLY = _LL_EXECUTE | _LL_READ_FILE | _LL_READ_DIR
DEVICE = _LL_READ_FILE | _LL_WRITE_FILE | _LL_TRUNCATE | _LL_IOCTL_DEV


class _PathBeneath(ctypes.Structure):
    _pack_ = 1
    _fields_ = [("allowed_access", ctypes.c_uint64), ("parent_fd", ctypes.c_int32)]


@functools.lru_cache(maxsize=1)
def _libc() -> Any:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    return libc


def _syscall(number: int, *args: Any) -> int:
    """syscall(2) with every integer passed as a full long (it reads its arguments as longs)."""
    return _libc().syscall(*(ctypes.c_long(a) if isinstance(a, int) else a for a in (number, *args)))


@functools.lru_cache(maxsize=1)
def abi() -> int:
    """The kernel's Landlock ABI version; 0 when it has none (or it is disabled, or not Linux)."""
    if not sys.platform.startswith("linux"):
        return 0
    try:
        version = _syscall(_SYS_LANDLOCK_CREATE_RULESET, None, 0, 1)  # 1: LANDLOCK_CREATE_RULESET_VERSION
    except (OSError, AttributeError):
        return 0
    return max(int(version), 0)


def _rights(version: int) -> tuple[int, int]:
    """(every file system right this ABI knows, those that apply to a file rather than a folder)."""
    every = _LL_V1 | (_LL_REFER if version >= 2 else 0) | (_LL_TRUNCATE if version >= 3 else 0)
    every |= _LL_IOCTL_DEV if version >= 5 else 0
    return every, every & (_LL_EXECUTE | _LL_WRITE_FILE | _LL_READ_FILE | _LL_TRUNCATE | _LL_IOCTL_DEV)


def ruleset(rules: Iterable[tuple[str, int]], writable: str) -> int:
    """A Landlock ruleset (an fd, close it) allowing each (path, rights) of `rules` and anything inside
    `writable`; every other path is closed. Paths that do not exist are skipped."""
    every, file_rights = _rights(abi())
    handled = ctypes.c_uint64(every)  # struct landlock_ruleset_attr, its first field only (valid on every ABI)
    fd_set = _syscall(_SYS_LANDLOCK_CREATE_RULESET, ctypes.byref(handled), ctypes.sizeof(handled), 0)
    if fd_set < 0:
        raise OSError(ctypes.get_errno(), "landlock_create_ruleset failed")
    try:
        for path, rights in [*rules, (writable, every)]:
            try:
                fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
            except OSError:
                continue
            try:
                allowed = rights & (every if os.path.isdir(path) else file_rights)
                rule = _PathBeneath(allowed, fd)
                if _syscall(_SYS_LANDLOCK_ADD_RULE, fd_set, 1, ctypes.byref(rule), 0):  # 1: RULE_PATH_BENEATH
                    raise OSError(ctypes.get_errno(), f"landlock_add_rule failed for {path}")
            finally:
                os.close(fd)
    except BaseException:
        os.close(fd_set)
        raise
    return fd_set


def restrict_self(fd_set: int) -> None:
    """Enter the ruleset (no new privileges first, as the kernel requires); for a child between fork and exec."""
    no_new_privs = _libc().prctl(ctypes.c_int(_PR_SET_NO_NEW_PRIVS), *map(ctypes.c_ulong, (1, 0, 0, 0)))
    if no_new_privs or _syscall(_SYS_LANDLOCK_RESTRICT_SELF, fd_set, 0):
        raise OSError(ctypes.get_errno(), "landlock_restrict_self failed")
