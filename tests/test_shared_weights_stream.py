"""The weight file's write streams (one gathered tensor alive at a time, the layout learnt while writing) and
allocates its pages up front (posix_fallocate), so a full /dev/shm stops the run with what to do, not SIGBUS."""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef

from astuner.engine import shared_weights
from astuner.engine.shared_weights import SharedWeightFile
from astuner.errors import UserError


def _read(path: str, manifest: list) -> dict[str, torch.Tensor]:
    data = torch.from_file(path, shared=False, size=os.path.getsize(path), dtype=torch.uint8)
    return {name: data[off : off + nbytes].view(getattr(torch, dtype)).view(shape).clone()
            for name, dtype, shape, nbytes, off in manifest}


def test_a_write_holds_one_gathered_tensor_at_a_time(monkeypatch, tmp_path):
    """Each tensor is made only after the one before it is gone (a sharded trainer gathers one at a time)."""
    made: list[StorageWeakRef] = []
    alive_when_made: list[int] = []

    def gather(i):
        alive_when_made.append(sum(not ref.expired() for ref in made))
        t = torch.full((100 + i, 7), float(i))
        made.append(StorageWeakRef(t.untyped_storage()))
        return t

    def gathered():  # as the trainer's: the generator keeps no reference to what it yielded
        for i in range(6):
            yield f"w{i}", gather(i)

    monkeypatch.setattr(shared_weights, "shm_dir", lambda: str(tmp_path))
    shared = SharedWeightFile("float32")
    path, manifest = shared.write(gathered())
    assert alive_when_made == [0] * 6, f"tensors still held when the next was made: {alive_when_made}"
    assert {n: t[0, 0].item() for n, t in _read(path, manifest).items()} == {f"w{i}": float(i) for i in range(6)}
    shared.close()


def test_the_layout_is_learnt_while_writing_and_rewritten_in_place(monkeypatch, tmp_path):
    """Offsets as before streaming (64-byte aligned, in order); the file grows (here through several remaps) on
    the first write, keeps its mapping while the tensors keep their sizes, and fits a smaller set exactly."""
    monkeypatch.setattr(shared_weights, "GROW_MIN", 4096)  # several doublings with small tensors
    weights = {"empty": torch.ones(0, 4), **{f"w{i}": torch.randn(3 + i, 50 + 13 * i) for i in range(12)}}
    shared = SharedWeightFile("float32", directory=str(tmp_path))
    path, manifest = shared.write(weights.items())
    offset = 0
    for (name, dtype, shape, nbytes, off), (want, t) in zip(manifest, weights.items()):
        assert (name, dtype, shape, nbytes, off) == (want, "float32", list(t.shape), t.numel() * 4, offset)
        offset += -(-nbytes // 64) * 64
    assert os.path.getsize(path) == offset == shared._reserved
    assert all(torch.equal(_read(path, manifest)[n], t) for n, t in weights.items())

    mapping = shared._buf.data_ptr()
    moved = {n: t + 1 for n, t in weights.items()}
    assert shared.write(moved.items()) == (path, manifest)
    assert shared._buf.data_ptr() == mapping  # rewritten in place, no remap
    assert all(torch.equal(_read(path, manifest)[n], t) for n, t in moved.items())

    fewer = dict(list(moved.items())[:4])
    path, manifest = shared.write(fewer.items())
    assert os.path.getsize(path) == manifest[-1][4] + -(-manifest[-1][3] // 64) * 64  # the tail is freed
    assert all(torch.equal(_read(path, manifest)[n], t) for n, t in fewer.items())
    shared.close()
    assert not os.path.exists(path)


def test_the_pages_are_reserved_and_enospc_stops_with_what_to_do(tmp_path):
    """posix_fallocate covers every byte written; its ENOSPC becomes the room check's message and the half-made
    file is removed (its shared memory freed)."""
    reserved: list[tuple[int, int]] = []
    shared = SharedWeightFile("float32", directory=str(tmp_path),
                              reserve=lambda fd, off, n: (reserved.append((off, n)), os.posix_fallocate(fd, off, n)))
    _, manifest = shared.write([("a", torch.ones(300)), ("b", torch.ones(40, 3)), ("c", torch.ones(5))])
    assert reserved == [(0, 1216), (1216, 512), (1728, 64)]  # each tensor's aligned bytes, contiguous from 0
    shared.close()

    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    shared = SharedWeightFile("float32", directory=str(tmp_path), reserve=full)
    with pytest.raises(UserError, match=rf"needs at least 0 MiB in {tmp_path}, which has \d+ MiB free\..*--shm-size"):
        shared.write([("a", torch.ones(300))])
    assert list(tmp_path.iterdir()) == []


_RACE = textwrap.dedent("""
    import os, shutil, sys, types
    import torch
    from astuner.engine import shared_weights
    from astuner.errors import UserError

    directory = sys.argv[1]
    shared_weights.shm_dir = lambda: directory

    def racing_usage(d):
        # The room is there when checked, then another process takes it before the pages are touched.
        usage = shutil.disk_usage(d)
        if not racing_usage.raced:
            racing_usage.raced = True
            fd = os.open(f"{directory}/other-process", os.O_WRONLY | os.O_CREAT)
            try:
                while os.write(fd, bytes(4096)):
                    pass
            except OSError:  # ENOSPC: the tmpfs is full
                pass
            os.close(fd)
        return usage
    racing_usage.raced = False
    shared_weights.shutil = types.SimpleNamespace(disk_usage=racing_usage)
    try:
        shared_weights.SharedWeightFile("float32").write([(f"w{i}", torch.ones(16384)) for i in range(4)])
    except UserError as exc:
        print("STOPPED:", exc)
""")


def test_a_full_tmpfs_after_the_room_check_stops_the_run_instead_of_sigbus(tmp_path):
    """On a real 1 MiB tmpfs: the check passes, the room goes, and the write must fail cleanly (before
    posix_fallocate the process died with SIGBUS). Mounting needs root, which CI has."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root (CI runs as root); the ENOSPC test above covers the logic")
    mnt = tmp_path / "shm"
    mnt.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], capture_output=True,
                             text=True)
    assert mounted.returncode == 0, f"root could not mount a tmpfs: {mounted.stderr}"
    try:
        proc = subprocess.run([sys.executable, "-c", _RACE, str(mnt)], capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, f"the write died (signal {-proc.returncode}): {proc.stderr[-2000:]}"
        assert f"STOPPED: the weight sync needs at least 0 MiB in {mnt}, which has" in proc.stdout, proc.stdout
        assert sorted(p.name for p in mnt.iterdir()) == ["other-process"]
    finally:
        subprocess.run(["umount", str(mnt)], check=True)
