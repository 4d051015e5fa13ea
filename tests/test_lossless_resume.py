"""Lossless resume of an asynchronous (trinity, sync_interval 2) run: SIGKILLed during exploration, training, the
weight sync and a checkpoint, and resumed each time, the run trains every task of the data order exactly once.

The ledger is what the run leaves: trajectories/train_step_N.jsonl names the tasks step N trained, and
metrics.jsonl has one line per step. Batches rolled out ahead of a checkpoint are not in it, so the resumed run
rolls them out again from the checkpoint's data cursor; a checkpoint torn by the kill is never resumed from.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from test_run_contract import ROWS, write_run

from astuner.config import load_config
from astuner.loop import LoopSettings, task_batches
from astuner.types import Task

# The driver, killed by itself (SIGKILL: nothing flushed, no cleanup) inside `stage` of `step`: after `delay`
# seconds, or as the stage ends if that comes first. Explorers keep rolling out ahead meanwhile, and a checkpoint
# may be half written. Where it died is appended to the file named by ASTUNER_TEST_KILLS first.
KILLER = '''
import contextlib, os, signal, sys, threading
from astuner import watchdog

stage_name, step, delay = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
original = watchdog.Watchdog.stage

once = threading.Lock()

def die():
    if not once.acquire(blocking=False):
        return
    with open(os.environ["ASTUNER_TEST_KILLS"], "a") as f:
        f.write(f"{stage_name} {step}\\n")
    os.kill(os.getpid(), signal.SIGKILL)

@contextlib.contextmanager
def stage(self, name):
    chosen = name == stage_name and self._step == step
    with original(self, name):
        if chosen:
            threading.Timer(delay, die).start()
        yield
        if chosen:
            die()

watchdog.Watchdog.stage = stage
from astuner.cli import main
sys.exit(main(sys.argv[4:]))
'''
STEPS = 6  # 2 epochs of 3 batches (6 tasks, 2 per step)


def _driver(tmp_path: Path, yaml: Path, kill: tuple[str, int, float] | None) -> int:
    args = ["--conf", str(yaml), "--backbone", "trinity", f"astuner.trainer_common.total_training_steps={STEPS}",
            "astuner.trainer_common.save_freq=2", "trinity.synchronizer.sync_interval=2"]
    script = tmp_path / "killer.py"
    script.write_text(KILLER)
    stage, step, delay = kill or ("never", 0, 0.0)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "ASTUNER_TEST_KILLS": str(tmp_path / "kills.txt")}
    proc = subprocess.run([sys.executable, str(script), stage, str(step), str(delay), *args], env=env,
                          capture_output=True, text=True, timeout=300)
    if kill is None:
        assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.returncode


@pytest.mark.slow
def test_sigkill_in_every_stage_of_an_async_run_loses_and_replays_nothing(cluster, tmp_path, tiny_model_dir):
    yaml = write_run(tmp_path, tiny_model_dir, trainer_extra=", cpus_per_worker: 0.5")
    out = tmp_path / "out"
    # The first kill comes after the step-2 checkpoint (a run killed before any checkpoint starts afresh); each
    # later run resumes from the last complete checkpoint, 2 or 4.
    kills = [("rollout", 3, 0.5), ("train", 3, 0.2), ("sync", 4, 0.0), ("checkpoint", 4, 0.05)]
    for kill in kills:
        assert _driver(tmp_path, yaml, kill) == -9, kill
        assert not list(tmp_path.glob("out_*")), "a resumed run went to a new folder"
    _driver(tmp_path, yaml, None)
    # Each run died inside the stage it was told to.
    assert (tmp_path / "kills.txt").read_text().splitlines() == [f"{stage} {step}" for stage, step, _ in kills]

    assert "resumed at step 2" in (out / "astuner.log").read_text()
    # Every step's batch is the data order's, from the first epoch to the last, each step once.
    settings = LoopSettings.from_config(load_config(yaml).typed)
    tasks = [Task(str(i), r["question"]) for i, r in enumerate(ROWS)]
    expected = [sorted(t.main_query for t in batch) for batch, _, _ in task_batches(tasks, settings)]
    trained = []
    for step in range(1, STEPS + 1):
        lines = (out / "trajectories" / f"train_step_{step:06d}.jsonl").read_text().splitlines()
        assert len(lines) == 2 * 3, step  # 2 tasks x num_repeat 3, each episode once
        trained.append(sorted({json.loads(line)["query"] for line in lines}))
    assert trained == expected
    assert sorted(q for batch in trained for q in batch) == sorted(2 * [r["question"] for r in ROWS])
    assert not list((out / "trajectories").glob(f"train_step_{STEPS + 1:06d}.jsonl"))
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()
             if '"train/reward_mean"' in line]
    assert steps == list(range(1, STEPS + 1))
    state = json.loads((out / f"global_step_{STEPS}" / "astuner_resume" / "state.json").read_text())
    assert (state["step"], state["epoch"], state["position"]) == (STEPS, 1, 6)

