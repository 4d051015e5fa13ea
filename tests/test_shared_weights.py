"""The shared-memory weight file of the vLLM sync: room checked before it is sized (a full /dev/shm would kill the
run with SIGBUS), created private, and files of dead runs removed."""

from __future__ import annotations

import os
import subprocess
import sys
from collections import namedtuple

import pytest
import torch

from astuner.engine import shared_weights
from astuner.engine.shared_weights import SharedWeightFile, check_room, remove_stale_weight_files
from astuner.errors import UserError

Usage = namedtuple("Usage", "total used free")


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_files_of_dead_runs_are_removed_and_live_ones_kept(tmp_path):
    dead = tmp_path / f"astuner-weights-{_dead_pid()}-aa11"
    live = tmp_path / f"astuner-weights-{os.getpid()}-bb22"
    other = tmp_path / "astuner-weights-notapid"
    for path in (dead, live, other):
        path.write_bytes(b"x" * 100)
    assert remove_stale_weight_files(str(tmp_path)) == 100
    assert not dead.exists() and live.exists() and other.exists()


def test_a_small_shm_stops_with_the_figures_and_what_to_do(monkeypatch, tmp_path):
    monkeypatch.setattr(shared_weights.shutil, "disk_usage", lambda d: Usage(64 << 20, 0, 64 << 20))
    with pytest.raises(UserError, match=r"needs 538 MiB in .*, which has 64 MiB free.*--shm-size"):
        check_room(str(tmp_path), 538 << 20)
    check_room(str(tmp_path), 100 << 20, already_held=40 << 20)  # our own file's bytes count as room


def test_weight_file_is_private_and_refused_before_it_is_made(monkeypatch, tmp_path):
    monkeypatch.setattr(shared_weights, "shm_dir", lambda: str(tmp_path))
    weights = [("a", torch.arange(6, dtype=torch.float32).reshape(2, 3)), ("b", torch.ones(5))]
    shared = SharedWeightFile("float32")
    path, manifest = shared.write(weights)
    assert os.stat(path).st_mode & 0o777 == 0o600
    data = torch.from_file(path, shared=False, size=os.path.getsize(path), dtype=torch.uint8)
    name, _, shape, nbytes, offset = manifest[0]
    assert torch.equal(data[offset: offset + nbytes].view(torch.float32).view(shape), weights[0][1])
    shared.close()
    assert not os.path.exists(path)

    monkeypatch.setattr(shared_weights.shutil, "disk_usage", lambda d: Usage(1 << 20, 0, 16))
    with pytest.raises(UserError, match="--shm-size"):
        SharedWeightFile("float32").write(weights)
    assert list(tmp_path.iterdir()) == []  # nothing was mapped
