"""The weight file a sync goes through: one file in /dev/shm, mapped by the trainer's process and the engine's.

Shared memory is small in containers (Docker's default /dev/shm is 64 MB), and a mapping that outgrows it does
not fail when it is made: the process dies with SIGBUS when it first writes a page that has no room. A free-space
check alone does not prevent that (`ftruncate` reserves nothing, and another process may take the room between the
check and the writes), so the file's pages are also allocated up front with `posix_fallocate`; either way a run
that would not fit stops with the figures and what to change (`--shm-size`). The file is created mode 0600 (the
weights are the user's), and files left by runs whose process is gone (a SIGKILL skips every cleanup) are removed
when a new one is made.

A write streams: each tensor is copied into the file as the iterable yields it and then dropped, so a sync holds
one gathered tensor at a time (a sharded trainer gathers one parameter at a time), never the whole model beside
the awake engine. The layout is therefore learnt while writing: the file grows as tensors arrive on the first
write (or when the tensors change), and later writes rewrite the same pages in place.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import tempfile
import time
import uuid
from pathlib import Path
from typing import Callable, Iterable

from astuner.engine.fingerprint import Fingerprint, FingerprintBuilder
from astuner.errors import UserError

log = logging.getLogger(__name__)

PREFIX = "astuner-weights-"
GROW_MIN = 64 << 20  # the mapping grows by doubling from here: a first write remaps a few times, not per tensor
ALIGN = 64  # bytes; each tensor's offset in the file


def shm_dir() -> str:
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def stale_weight_files(directory: str, alive: Callable[[int], bool] = pid_alive) -> list[Path]:
    """Weight files (astuner-weights-<pid>-<id>) whose process is gone."""
    stale = []
    for path in Path(directory).glob(PREFIX + "*"):
        pid = path.name[len(PREFIX):].split("-", 1)[0]
        if pid.isdigit() and not alive(int(pid)):
            stale.append(path)
    return stale


def remove_stale_weight_files(directory: str) -> int:
    """Remove what dead runs left; the number of bytes freed."""
    freed = 0
    for path in stale_weight_files(directory):
        try:
            size = path.stat().st_size
            path.unlink()
            freed += size
        except OSError:  # raced with another run's cleanup, or not ours to remove
            continue
    return freed


def no_room(directory: str, needed: int, free: int, at_least: bool = False) -> UserError:
    return UserError(
        f"the weight sync needs {'at least ' if at_least else ''}{needed / 2**20:.0f} MiB in {directory}, which has "
        f"{free / 2**20:.0f} MiB free. "
        "In Docker, start the container with a larger shared memory (docker run --shm-size=8g; the default is "
        "64 MB), or free space in it; writing past it would kill the run with SIGBUS.")


def check_room(directory: str, needed: int, already_held: int = 0, at_least: bool = False) -> None:
    """Stop with what to do when `directory` cannot hold `needed` bytes (`already_held` of them are ours)."""
    free = shutil.disk_usage(directory).free + already_held
    if needed > free:
        raise no_room(directory, needed, free, at_least)


def reserve_space(fd: int, offset: int, length: int) -> None:
    """Allocate bytes [offset, offset + length) of the file now (on tmpfs: its shared-memory pages), so running out
    is an ENOSPC here instead of a SIGBUS at the first store into a page that has no room. Where the call does not
    exist (macOS) nothing is reserved, as with ftruncate."""
    if length > 0 and hasattr(os, "posix_fallocate"):
        os.posix_fallocate(fd, offset, length)


class SharedWeightFile:
    """One file in /dev/shm holding every synced tensor at a fixed offset, mapped once and rewritten in place.

    `write` converts to the engine's dtype while copying (fp32 master weights -> bf16 on GPU halves the bytes) and
    returns (path, manifest) for the worker: rows (name, dtype, shape, nbytes, offset), offsets 64-byte aligned, in
    the order the tensors came. `directory` (default: /dev/shm, else the temp dir) and `reserve` (how pages are
    allocated, `reserve_space`) can be given, for tests.
    """

    def __init__(self, dtype: str, directory: str | None = None,
                 reserve: Callable[[int, int, int], None] = reserve_space) -> None:
        self.dtype = dtype
        self.sent: Fingerprint = {}  # the fingerprint of the last write (what the engine must now serve)
        self.previous: Fingerprint | None = None  # ... and of the write before it (what changed)
        self.fingerprint_s = 0.0  # ... and the seconds it took
        self.path: str | None = None
        self._directory = directory
        self._reserve = reserve
        self._buf = None
        self._mapped = 0  # bytes mapped = the file's size (beyond `_reserved` a sparse tail, never touched)
        self._reserved = 0  # bytes allocated (fallocate) from the start of the file
        self._manifest: list[tuple[str, str, list[int], int, int]] | None = None
        self._pinned = False

    def write(self, named_tensors: Iterable[tuple[str, object]]) -> tuple[str, list]:
        import torch

        target = getattr(torch, self.dtype)
        size = torch.empty((), dtype=target).element_size()
        manifest, offset, on_gpu = [], 0, False
        sent, self.fingerprint_s = FingerprintBuilder(), 0.0
        for name, t in named_tensors:
            t = t.detach()
            nbytes = t.numel() * size
            stop = offset + -(-nbytes // ALIGN) * ALIGN
            if stop > self._reserved:  # the first write, or the tensors grew: room for this one
                self._grow(stop)
            if nbytes:
                view = self._buf[offset : offset + nbytes].view(target).view(t.shape)
            else:  # nothing mapped yet if it comes first
                view = torch.empty(t.shape, dtype=target)
            if t.is_cuda:  # cast on the GPU, then one DMA copy into the pinned file pages
                on_gpu = True
                t = t.to(target)
            view.copy_(t, non_blocking=self._pinned)
            started = time.perf_counter()
            sent.add(name, t if t.is_cuda else view)  # summed where the tensor lives, in the engine's dtype
            self.fingerprint_s += time.perf_counter() - started
            manifest.append((name, self.dtype, list(t.shape), nbytes, offset))
            offset = stop
            del t, view  # before the next one is gathered: one tensor in flight (a CUDA copy is stream-ordered)
        if on_gpu:
            torch.cuda.synchronize()
        if self._mapped != offset:  # the layout is settled: map exactly the file, pinned (DMA from the next write)
            self._fit(offset)
        if self._buf is not None and not self._pinned:
            self._pinned = pin_host_memory(self._buf)
        self._manifest = manifest
        started = time.perf_counter()
        self.previous, self.sent = self.sent or None, sent.result()  # the host tensors' prints still being summed
        self.fingerprint_s += time.perf_counter() - started
        return self.path, manifest

    def _name(self) -> str:
        """The file's path, chosen on first use (when files of dead runs are removed, so their room counts)."""
        if self.path is None:
            directory = self._directory = self._directory or shm_dir()
            freed = remove_stale_weight_files(directory)
            if freed:
                log.info("removed %.0f MiB of weight files left in %s by runs that are gone", freed / 2**20, directory)
            self.path = os.path.join(directory, f"{PREFIX}{os.getpid()}-{uuid.uuid4().hex[:8]}")
        return self.path

    def _open(self) -> int:
        """Created private (0600) before torch maps it: from_file would create it with the umask's mode."""
        return os.open(self._name(), os.O_RDWR | os.O_CREAT, 0o600)

    def _grow(self, stop: int) -> None:
        """Make bytes [0, stop) of the file ours: room checked, pages allocated, mapped. The mapping (and the file's
        sparse size) doubles, so a first write remaps O(log size) times; what is reserved is exactly what is used."""
        self._name()
        directory = self._directory
        check_room(directory, stop, self._reserved, at_least=True)  # before anything is made
        fd = self._open()
        try:
            self._reserve(fd, self._reserved, stop - self._reserved)
        except OSError as exc:
            os.close(fd)
            if exc.errno not in (errno.ENOSPC, errno.EDQUOT):
                raise
            error = no_room(directory, stop, shutil.disk_usage(directory).free + self._reserved, at_least=True)
            self.close()  # leave no half-written file holding shared memory: the run stops here
            raise error from exc
        try:
            self._reserved = stop
            if stop > self._mapped:
                self._remap(fd, max(stop, 2 * self._mapped, GROW_MIN))
        finally:
            os.close(fd)

    def _fit(self, size: int) -> None:
        """Cut the file (and its reservation) to `size` bytes and map exactly that."""
        fd = self._open()
        try:
            self._reserved = min(self._reserved, size)
            self._remap(fd, size)
        finally:
            os.close(fd)

    def _remap(self, fd: int, size: int) -> None:
        import torch

        self._unpin()
        self._buf = None
        os.ftruncate(fd, size)
        self._mapped = size
        if size:
            self._buf = torch.from_file(self.path, shared=True, size=size, dtype=torch.uint8)

    def _unpin(self) -> None:
        if getattr(self, "_pinned", False):
            import torch

            torch.cuda.synchronize()  # no copy may still be landing in the pages being unregistered
            torch.cuda.cudart().cudaHostUnregister(self._buf.data_ptr())
            self._pinned = False

    def close(self) -> None:
        self._unpin()
        self._buf = None
        self._mapped = self._reserved = 0
        if self.path:
            Path(self.path).unlink(missing_ok=True)
            self.path = None


def pin_host_memory(buf) -> bool:
    """Page-lock `buf` (a file mapping) for the GPU, so copies to and from it are DMA (several times faster than
    from pageable memory). False without CUDA or when the driver refuses."""
    import torch

    if not torch.cuda.is_available():
        return False
    try:
        return torch.cuda.cudart().cudaHostRegister(buf.data_ptr(), buf.numel(), 0) == 0
    except Exception:  # an old driver or a mapping CUDA cannot register: pageable copies still work
        return False
