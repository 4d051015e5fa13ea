"""The weight file a sync goes through: one file in /dev/shm, mapped by the trainer's process and the engine's.

Shared memory is small in containers (Docker's default /dev/shm is 64 MB), and a mapping that outgrows it does
not fail when it is made: the process dies with SIGBUS when it first writes a page that has no room. So before
the file is sized, the free space is checked and a run that would not fit stops with the figures and what to
change (`--shm-size`). The file is created mode 0600 (the weights are the user's), and files left by runs whose
process is gone (a SIGKILL skips every cleanup) are removed when a new one is made.
"""

from __future__ import annotations

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


def check_room(directory: str, needed: int, already_held: int = 0) -> None:
    """Stop with what to do when `directory` cannot hold `needed` bytes (`already_held` of them are ours)."""
    free = shutil.disk_usage(directory).free + already_held
    if needed > free:
        raise UserError(
            f"the weight sync needs {needed / 2**20:.0f} MiB in {directory}, which has {free / 2**20:.0f} MiB "
            "free. "
            "In Docker, start the container with a larger shared memory (docker run --shm-size=8g; the default is "
            "64 MB), or free space in it; writing past it would kill the run with SIGBUS.")


class SharedWeightFile:
    """One file in /dev/shm holding every synced tensor at a fixed offset, mapped once and rewritten in place.

    `write` converts to the engine's dtype while copying (fp32 master weights -> bf16 on GPU halves the bytes) and
    returns (path, manifest) for the worker: rows (name, dtype, shape, nbytes, offset), offsets 64-byte aligned.
    """

    def __init__(self, dtype: str) -> None:
        self.dtype = dtype
        self.sent: Fingerprint = {}  # the fingerprint of the last write (what the engine must now serve)
        self.previous: Fingerprint | None = None  # ... and of the write before it (what changed)
        self.fingerprint_s = 0.0  # ... and the seconds it took
        self.path: str | None = None
        self._buf = None
        self._manifest: list[tuple[str, str, list[int], int, int]] | None = None
        self._pinned = False

    def write(self, named_tensors: Iterable[tuple[str, object]]) -> tuple[str, list]:
        import torch

        target = getattr(torch, self.dtype)
        size = torch.empty((), dtype=target).element_size()
        tensors = [(name, t.detach()) for name, t in named_tensors]
        manifest, offset = [], 0
        for name, t in tensors:
            nbytes = t.numel() * size
            manifest.append((name, self.dtype, list(t.shape), nbytes, offset))
            offset += -(-nbytes // 64) * 64
        if self._manifest != manifest:  # first write (or the tensors changed): size the file
            directory = shm_dir()
            if self.path is None:
                freed = remove_stale_weight_files(directory)
                if freed:
                    log.info("removed %.0f MiB of weight files left in %s by runs that are gone", freed / 2**20,
                             directory)
                self.path = os.path.join(directory, f"{PREFIX}{os.getpid()}-{uuid.uuid4().hex[:8]}")
            held = os.path.getsize(self.path) if os.path.exists(self.path) else 0
            check_room(directory, offset, held)
            self._unpin()
            self._buf = None
            # Created private (0600) before torch maps it: from_file would create it with the umask's mode.
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
            try:
                os.ftruncate(fd, offset)
            finally:
                os.close(fd)
            self._buf = torch.from_file(self.path, shared=True, size=offset, dtype=torch.uint8)
            self._pinned = pin_host_memory(self._buf)
            self._manifest = manifest
        on_gpu = False
        sent, self.fingerprint_s = FingerprintBuilder(), 0.0
        for (name, t), (_, _, shape, nbytes, off) in zip(tensors, manifest):
            view = self._buf[off : off + nbytes].view(target).view(shape)
            if t.is_cuda:  # cast on the GPU, then one DMA copy into the pinned file pages
                on_gpu = True
                t = t.to(target)
            view.copy_(t, non_blocking=self._pinned)
            started = time.perf_counter()
            sent.add(name, t if t.is_cuda else view)  # summed where the tensor lives, in the engine's dtype
            self.fingerprint_s += time.perf_counter() - started
        if on_gpu:
            torch.cuda.synchronize()
        self.previous, self.sent = self.sent or None, sent.result()
        return self.path, manifest

    def _unpin(self) -> None:
        if getattr(self, "_pinned", False):
            import torch

            torch.cuda.cudart().cudaHostUnregister(self._buf.data_ptr())
            self._pinned = False

    def close(self) -> None:
        self._unpin()
        self._buf = None
        if self.path:
            Path(self.path).unlink(missing_ok=True)


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
