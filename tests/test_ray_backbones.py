"""The verl and trinity backbones on a real local Ray cluster (2 CPUs, small object store), tiny model:
the same parameters as the debug backbone where the math says so, versions and a staleness bound where it does
not, a clean stop with the error when an actor dies, and exit 2 when the cluster cannot hold the placement.

Rollouts match across backbones because sampling seeds come from (seed, step, episode uid), never from which
engine serves an episode; so whole runs, not just one train step, can be compared."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import ray
import torch
from safetensors.torch import load_file

from astuner.cli import main
from test_run_contract import write_run
from tolerances import assert_adam_close

SMALL = ", cpus_per_worker: 0.5"


def run(folder: Path, model_dir: Path, backbone: str, *overrides: str, trainer_extra: str = SMALL,
        steps: int = 4) -> int:
    yaml = write_run(folder, model_dir, trainer_extra=trainer_extra)
    args = ["--conf", str(yaml), "--backbone", backbone, f"astuner.trainer_common.total_training_steps={steps}",
            *overrides]
    return main(args)


def params(folder: Path, step: int) -> dict[str, torch.Tensor]:
    return load_file(folder / "out" / f"global_step_{step}" / "model.safetensors")


def metrics(folder: Path) -> list[dict]:
    lines = (folder / "out" / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if '"train/reward_mean"' in line]


def assert_same_params(a: dict, b: dict, exact: bool = False) -> None:
    """Weights of two runs that took the same 4 Adam steps (lr 1e-3) with gradients that differ only in float
    summation order (tests/tolerances.py: Adam may move a rounding-level-gradient weight differently, within its
    step bound); a wrong gradient (a worker's share missing, counted twice, or wrongly weighted) moves most weights
    by ~1e-3. `exact`: the same computation resumed, equal to one ulp."""
    assert a.keys() == b.keys()
    for name in a:
        if exact:
            torch.testing.assert_close(a[name], b[name], atol=1e-6, rtol=0, msg=lambda m: f"{name}: {m}")
        else:
            assert_adam_close(a[name], b[name], lr=1e-3, steps=4, what=name)


@pytest.fixture(scope="module")
def debug_run(tmp_path_factory, tiny_model_dir):
    folder = tmp_path_factory.mktemp("debug")
    assert run(folder, tiny_model_dir, "debug") == 0
    return folder


@pytest.mark.slow
def test_verl_two_data_parallel_workers_equal_debug(cluster, debug_run, tmp_path, tiny_model_dir):
    assert run(tmp_path, tiny_model_dir, "verl", "astuner.trainer_common.n_gpus_per_node=2") == 0
    ours, theirs = metrics(tmp_path), metrics(debug_run)
    # Same episodes (seeds follow the episode, not the worker) ...
    assert [m["train/reward_mean"] for m in ours] == [m["train/reward_mean"] for m in theirs]
    # ... and the gradients summed over the two gloo workers give the one-process step.
    assert_same_params(params(tmp_path, 4), params(debug_run, 4))
    assert params(tmp_path, 4)["model.norm.weight"].ne(1.0).any()  # it did train
    assert all(m["rollout/staleness_max"] == 0 for m in ours + theirs)


@pytest.mark.slow
def test_verl_fsdp2_equals_debug_and_resumes_exactly(cluster, debug_run, tmp_path, tiny_model_dir):
    # Sharded: each worker holds half of every parameter, its gradient and its Adam moments (astuner/trainer/fsdp.py).
    workers = ("astuner.trainer_common.n_gpus_per_node=2", "astuner.trainer_common.strategy=fsdp2")
    assert run(tmp_path, tiny_model_dir, "verl", *workers) == 0
    assert "2 trainer workers, strategy fsdp2" in (tmp_path / "out" / "astuner.log").read_text()
    ours, theirs = metrics(tmp_path), metrics(debug_run)
    assert [m["train/reward_mean"] for m in ours] == [m["train/reward_mean"] for m in theirs]
    assert_same_params(params(tmp_path, 4), params(debug_run, 4))
    # The checkpoint is whole (gathered from the shards) and resumes into shards exactly: weights and moments.
    first = tmp_path / "out" / "global_step_4"
    first.rename(tmp_path / "first_run_step_4")
    assert run(tmp_path, tiny_model_dir, "verl", *workers,
               f"astuner.trainer_common.resume_mode={tmp_path / 'out' / 'global_step_2'}") == 0
    assert_same_params(params(tmp_path, 4), load_file(tmp_path / "first_run_step_4" / "model.safetensors"), exact=True)
    assert_same_params(params(tmp_path, 4), params(debug_run, 4))


@pytest.mark.slow
def test_trinity_on_policy_equals_debug(cluster, debug_run, tmp_path, tiny_model_dir):
    # Two sharded trainer workers: the weights the explorer gets are gathered from both (every rank takes part).
    assert run(tmp_path, tiny_model_dir, "trinity", "trinity.synchronizer.sync_interval=1",
               "astuner.trainer_common.n_gpus_per_node=2", "astuner.trainer_common.strategy=fsdp2") == 0
    assert "2 trainer workers, strategy fsdp2" in (tmp_path / "out" / "astuner.log").read_text()
    ours = metrics(tmp_path)
    assert [m["train/reward_mean"] for m in ours] == [m["train/reward_mean"] for m in metrics(debug_run)]
    assert_same_params(params(tmp_path, 4), params(debug_run, 4))
    assert [m["trinity/num_syncs"] for m in ours] == [1, 2, 3, 4]
    assert all(m["rollout/staleness_max"] == 0 for m in ours)


@pytest.mark.slow
def test_trinity_sync_interval_2_versions_and_bound(cluster, tmp_path, tiny_model_dir):
    # Two explorers share each batch; one trainer (1.5 of the cluster's 2 CPUs).
    assert run(tmp_path, tiny_model_dir, "trinity", "trinity.synchronizer.sync_interval=2",
               "astuner.trainer_common.trinity_only__n_vllm_engine=2") == 0
    ours = metrics(tmp_path)
    assert len(ours) == 4
    # bound = sync_interval - 1 = 1: some batches ran on the previous weights, none on older ones.
    assert max(m["rollout/staleness_max"] for m in ours) == 1
    assert all(m["rollout/staleness_max"] <= 1 for m in ours)
    versions = [json.loads(line)["policy_version"]
                for step in range(1, 5)
                for line in (tmp_path / "out" / "trajectories" / f"train_step_{step:06d}.jsonl").read_text().splitlines()]
    assert set(versions) <= {0, 2} and 2 in versions  # synced after step 2 only (and on demand, never here)
    # Stale samples were corrected: the trainer recomputed old logprobs and weighted them (rollout_is_cap 2).
    assert all("actor/is_weight_mean" in m for m in ours)
    assert any(m["perf/rollout_overlap_fraction"] > 0 for m in ours)


@pytest.mark.slow
def test_a_killed_explorer_stops_cleanly_and_the_run_resumes_exactly(cluster, debug_run, tmp_path, tiny_model_dir,
                                                                     capsys):
    yaml = write_run(tmp_path, tiny_model_dir, trainer_extra=SMALL)
    workflow = (tmp_path / "wf.py").read_text()
    (tmp_path / "wf.py").write_text('''
import os
from astuner import Workflow, WorkflowOutput

CALLS = [0]

class EchoWorkflow(Workflow):
    async def execute(self, workflow_task, model_tuner):
        CALLS[0] += 1
        if CALLS[0] > 12:  # the first episode of step 3 (2 tasks x 3 repeats a step): the process dies
            os._exit(3)
        reply = await model_tuner.chat([{"role": "user", "content": workflow_task.task.main_query}])
        return WorkflowOutput(reward=None, metadata={"final_answer": reply["content"]})
''')
    code = main(["--conf", str(yaml), "--backbone", "trinity", "astuner.trainer_common.total_training_steps=4",
                 "astuner.trainer_common.save_freq=99"])
    err = capsys.readouterr().err
    assert code == 1
    assert "explorer 0" in err and "died" in err and "roll out step 3" in err
    # The trainer still held step 2, so it was checkpointed before the stop (save_freq alone would not have).
    state = json.loads((tmp_path / "out" / "global_step_2" / "astuner_resume" / "state.json").read_text())
    assert state["step"] == 2
    # Resumed from that checkpoint, the run ends where an uninterrupted one does.
    (tmp_path / "wf.py").write_text(workflow)
    assert main(["--conf", str(yaml), "--backbone", "trinity", "astuner.trainer_common.total_training_steps=4",
                 "astuner.trainer_common.save_freq=99"]) == 0
    assert [m["train/reward_mean"] for m in metrics(tmp_path)] == [m["train/reward_mean"] for m in metrics(debug_run)]
    assert_same_params(params(tmp_path, 4), params(debug_run, 4))


def test_a_placement_the_cluster_cannot_hold_exits_2(cluster, tmp_path, tiny_model_dir, capsys, monkeypatch):
    # 8 ranks' host copies may not fit this machine's free memory (a busy one: the memory check refuses first)
    monkeypatch.setenv("ASTUNER_SKIP_MEMORY_CHECK", "1")
    code = run(tmp_path, tiny_model_dir, "verl", "astuner.trainer_common.n_gpus_per_node=8",
               trainer_extra=", cpus_per_worker: 1")
    err = capsys.readouterr().err
    assert code == 2
    assert "8 CPU (the cluster has 2)" in err and "n_gpus_per_node" in err


def test_with_ray_joins_the_cluster_at_ray_address_or_says_nothing_answers(cluster):
    script = ("from astuner.backbone.ray_cluster import connect; import ray; started = connect(); "
              "print(started, ray.cluster_resources()['CPU'])")
    address = ray.get_runtime_context().gcs_address
    env = {**os.environ, "RAY_ADDRESS": address}
    joined = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert joined.stdout.split() == ["False", "2.0"], joined.stderr[-2000:]  # joined (not started) the 2-CPU one
    env["RAY_ADDRESS"] = "127.0.0.1:9"
    script = ("from astuner.backbone.ray_cluster import connect\nfrom astuner.errors import UserError\n"
              "try:\n    connect()\nexcept UserError as e:\n    print(e)")
    refused = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60)
    assert "RAY_ADDRESS=127.0.0.1:9: nothing answers there" in refused.stdout


def test_without_ray_address_only_the_cluster_ray_start_recorded_is_joined(cluster):
    # This module's cluster is private (ray.init, no `ray start`): Ray's address="auto" finds it among the machine's
    # processes all the same, and a run that joined it would die with it (seen: another test's cluster, mid-run).
    script = ("from astuner.backbone.ray_cluster import connect\nfrom astuner.errors import UserError\nimport ray\n"
              "try:\n    print(connect(start_local=False), ray.cluster_resources()['CPU'])\n"
              "except UserError as e:\n    print(e)")
    temp = Path(tempfile.mkdtemp(prefix="rt", dir="/tmp"))  # short: Ray's socket paths live under it
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"} | {"RAY_TMPDIR": str(temp)}

    def connect_in_a_new_process():
        return subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)

    try:
        refused = connect_in_a_new_process()
        assert "no Ray cluster to join" in refused.stdout, refused.stdout + refused.stderr[-2000:]
        # The record `ray start --head` writes: its cluster is joined (here, this module's 2-CPU one)
        (temp / "ray").mkdir()
        (temp / "ray" / "ray_current_cluster").write_text(ray.get_runtime_context().gcs_address)
        joined = connect_in_a_new_process()
        assert joined.stdout.split() == ["False", "2.0"], joined.stderr[-2000:]
        # A stale record (its cluster stopped without `ray stop`): none, said in the log, and no minutes of retries
        (temp / "ray" / "ray_current_cluster").write_text("127.0.0.1:9")
        stale = connect_in_a_new_process()
        assert "no Ray cluster to join" in stale.stdout and "does not answer" in stale.stderr, stale.stderr[-2000:]
    finally:
        shutil.rmtree(temp, ignore_errors=True)


@pytest.mark.slow
def test_a_stuck_actor_stops_the_run_at_its_deadline(cluster, tmp_path, tiny_model_dir, capsys):
    # 45 s: loading the model fits (it has the same deadline; on a busy 2-core CI machine it once took over 20 s);
    # the workflow does not.
    yaml = write_run(tmp_path, tiny_model_dir, trainer_extra=SMALL + ", actor_timeout_s: 45")
    (tmp_path / "wf.py").write_text('''
import time
from astuner import Workflow

class EchoWorkflow(Workflow):
    async def execute(self, workflow_task, model_tuner):
        time.sleep(300)  # blocks the explorer's event loop: no episode deadline can fire
''')
    assert main(["--conf", str(yaml), "--backbone", "trinity"]) == 1
    err = capsys.readouterr().err
    assert "the driver waited 45 s for explorer 0 to roll out step 1, in vain" in err
