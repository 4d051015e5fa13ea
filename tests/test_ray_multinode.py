"""The verl and trinity backbones on a Ray cluster of two nodes (two raylets on this machine), driven as a user
drives them: `astuner --conf ... --with-ray` in its own process, joining through RAY_ADDRESS.

Each node offers 1 CPU and each worker asks for 1 (cpus_per_worker), so a placement of two workers must use both
nodes. Where each actor runs is read from the run's placement line and from the workflow itself (the node id Ray
gives the process), and compared with the node ids of the two raylets started here.

This module starts no Ray in the test process: the cluster's processes are its own, and it leaves Ray as it found
it for the modules that run after it (their `cluster` fixture starts a local one)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

from astuner.cli import main
from test_run_contract import write_run
from tolerances import assert_adam_close

NODE = dict(num_cpus=1, object_store_memory=100 * 2**20)
# Deadlines well beyond what a 2-core CI machine needs, so a regression stops the run with its message (the
# deadline machinery: actor_timeout_s) instead of hanging the suite; none of them is an assertion on time.
ACTOR_TIMEOUT_S = 240
RUN_TIMEOUT_S = 600

STEPS = 2
# Each episode appends the node it ran on (in a Ray worker). The verl workers get one task x 3 repeats a step each,
# so a worker's 4th episode is its first of step 2: it writes `held_<node>` and waits for `go` (the test removes a
# node meanwhile).
WORKFLOW = '''
import asyncio
from pathlib import Path

import ray
from astuner import Workflow, WorkflowOutput

FOLDER = Path({folder!r})
HOLD_AT = {hold_at}
CALLS = [0]

class EchoWorkflow(Workflow):
    async def execute(self, workflow_task, model_tuner):
        CALLS[0] += 1
        node = ray.get_runtime_context().get_node_id() if ray.is_initialized() else "no ray"
        with open(FOLDER / "episode_nodes.txt", "a") as f:
            f.write(node + "\\n")
        if CALLS[0] == HOLD_AT:
            (FOLDER / f"held_{{node}}").touch()
            while not (FOLDER / "go").exists():
                await asyncio.sleep(0.1)
        reply = await model_tuner.chat([{{"role": "user", "content": workflow_task.task.main_query}}])
        return WorkflowOutput(reward=None, metadata={{"final_answer": reply["content"]}})
'''


class TwoNodes:
    """A head raylet (it also holds the GCS) and a second raylet that a test may remove and add back."""

    def __init__(self) -> None:
        from ray.cluster_utils import Cluster

        self.cluster = Cluster(initialize_head=True, head_node_args={**NODE, "include_dashboard": False})
        # The run joins through RAY_ADDRESS alone: a ray.init() without an address elsewhere on this machine must
        # not join this cluster through the address file Cluster writes (/tmp/ray/ray_current_cluster).
        from ray._common.utils import reset_ray_address

        reset_ray_address()
        self.worker = self.cluster.add_node(**NODE)

    @property
    def head_id(self) -> str:
        return self.cluster.head_node.node_id

    def add_worker(self) -> None:
        self.worker = self.cluster.add_node(**NODE)

    def remove_worker(self) -> None:
        self.cluster.remove_node(self.worker)

    def env(self) -> dict[str, str]:
        return {**os.environ, "RAY_ADDRESS": self.cluster.address, "RAY_AUTH_MODE": "disabled"}


@pytest.fixture(scope="module")
def two_nodes():
    import ray

    assert not ray.is_initialized(), "a module before this one left Ray initialised in the test process"
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # Ray 2.60 writes an auth token otherwise
    nodes = TwoNodes()
    try:
        yield nodes
    finally:
        nodes.cluster.shutdown()
    assert not ray.is_initialized()


def astuner(folder: Path, nodes: TwoNodes, backbone: str, *overrides: str) -> subprocess.Popen:
    """`astuner --conf tiny.yaml --backbone <backbone> --with-ray <overrides>` in its own process; its stderr goes
    to a file (a pipe left unread while the test waits could fill and stall the run)."""
    args = [sys.executable, "-m", "astuner.cli", "--conf", str(folder / "tiny.yaml"), "--backbone", backbone,
            "--with-ray", *overrides]
    with open(folder / "stderr.txt", "w") as err:
        return subprocess.Popen(args, env={**nodes.env(), "PYTHONUNBUFFERED": "1"}, stdout=subprocess.DEVNULL,
                                stderr=err, text=True)


@pytest.fixture()
def start_run(two_nodes):
    """`start_run(folder, backbone, *overrides)`: `astuner(...)` on the two nodes; a run still going when the test
    ends (it failed) is killed."""
    procs: list[subprocess.Popen] = []

    def start(folder: Path, *args: str) -> subprocess.Popen:
        procs.append(astuner(folder, two_nodes, *args))
        return procs[-1]

    yield start
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def finish(proc: subprocess.Popen, folder: Path) -> tuple[int, str]:
    """(exit code, stderr) of the run, once it has stopped."""
    try:
        proc.wait(timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        pytest.fail(f"the run did not stop within {RUN_TIMEOUT_S} s; its stderr ends:\n"
                    f"{(folder / 'stderr.txt').read_text()[-3000:]}")
    return proc.returncode, (folder / "stderr.txt").read_text()


def wait_for(condition, proc: subprocess.Popen, folder: Path, what: str) -> None:
    """Poll `condition` while the run goes on; the run ending first, or RUN_TIMEOUT_S passing, fails the test."""
    start = time.monotonic()
    while not condition():
        ended = proc.poll() is not None
        if ended or time.monotonic() - start > RUN_TIMEOUT_S:
            proc.kill()
            pytest.fail(f"the run {'ended' if ended else 'stalled'} before {what} (exit {proc.wait()}); its stderr "
                        f"ends:\n{(folder / 'stderr.txt').read_text()[-3000:]}")
        time.sleep(0.2)


def placements(folder: Path) -> list[dict[str, str]]:
    """Every placement line of the run's log (one per start): {actor name: node id}."""
    log_file = folder / "out" / "astuner.log"
    log = log_file.read_text() if log_file.exists() else ""
    return [dict(re.findall(r"(\w[\w ]*?) on node (\w+) \(", line.split("placement: ", 1)[1]))
            for line in log.splitlines() if "placement: " in line]


def write(folder: Path, model_dir: Path, hold_at: int = 0) -> None:
    write_run(folder, model_dir, trainer_extra=f", cpus_per_worker: 1, actor_timeout_s: {ACTOR_TIMEOUT_S}")
    (folder / "wf.py").write_text(WORKFLOW.format(folder=str(folder), hold_at=hold_at))


def steps_logged(folder: Path) -> list[int]:
    lines = (folder / "out" / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line)["step"] for line in lines if '"train/reward_mean"' in line]


def assert_weights_equal_debug(folder: Path, debug: Path) -> None:
    """The run's last weights are those of the one-process run (tests/test_ray_backbones.py: episodes are seeded
    by (seed, step, episode), never by the worker or node that ran them)."""
    ours, theirs = (load_file(f / "out" / f"global_step_{STEPS}" / "model.safetensors") for f in (folder, debug))
    assert ours.keys() == theirs.keys()
    for name in ours:
        assert_adam_close(ours[name], theirs[name], lr=1e-3, steps=STEPS, what=name)


@pytest.fixture(scope="module")
def debug_run(tmp_path_factory, tiny_model_dir) -> Path:
    folder = tmp_path_factory.mktemp("debug")
    write(folder, tiny_model_dir)
    assert main(["--conf", str(folder / "tiny.yaml"), "--backbone", "debug",
                 f"astuner.trainer_common.total_training_steps={STEPS}"]) == 0
    return folder


@pytest.mark.slow
def test_trinity_places_explorer_and_trainer_on_different_nodes_and_syncs_across_them(two_nodes, start_run, debug_run,
                                                                                       tmp_path, tiny_model_dir):
    write(tmp_path, tiny_model_dir)
    proc = start_run(tmp_path, "trinity", f"astuner.trainer_common.total_training_steps={STEPS}",
                     "trinity.synchronizer.sync_interval=1")
    code, err = finish(proc, tmp_path)
    assert code == 0, err[-3000:]
    [placed] = placements(tmp_path)
    both = {two_nodes.head_id, two_nodes.worker.node_id}
    assert set(placed) == {"explorer 0", "trainer 0"} and set(placed.values()) == both
    # Every episode ran on the explorer's node, and step 2's on the weights the trainer sent across after step 1.
    assert set((tmp_path / "episode_nodes.txt").read_text().split()) == {placed["explorer 0"]}
    step_2 = (tmp_path / "out" / "trajectories" / "train_step_000002.jsonl").read_text().splitlines()
    assert {json.loads(line)["policy_version"] for line in step_2} == {1}
    assert steps_logged(tmp_path) == [1, 2]
    assert_weights_equal_debug(tmp_path, debug_run)


@pytest.mark.slow
def test_verl_on_two_nodes_a_node_lost_after_step_1_stops_the_run_naming_its_worker_and_the_run_resumes(
        two_nodes, start_run, debug_run, tmp_path, tiny_model_dir):
    write(tmp_path, tiny_model_dir, hold_at=4)
    command = ("verl", "astuner.trainer_common.nnodes=2", f"astuner.trainer_common.total_training_steps={STEPS}",
               "astuner.trainer_common.save_freq=1")
    proc = start_run(tmp_path, *command)
    removed = two_nodes.worker.node_id
    wait_for(lambda: placements(tmp_path), proc, tmp_path, "placing its workers")
    [placed] = placements(tmp_path)
    assert set(placed.values()) == {two_nodes.head_id, removed}, placed  # one worker a node
    held = [tmp_path / f"held_{node}" for node in (two_nodes.head_id, removed)]
    wait_for(lambda: all(h.exists() for h in held), proc, tmp_path, "step 2")  # both workers are in its rollout
    assert set((tmp_path / "episode_nodes.txt").read_text().split()) == {two_nodes.head_id, removed}
    lost = next(name for name, node in placed.items() if node == removed)

    two_nodes.remove_worker()
    (tmp_path / "go").touch()
    code, err = finish(proc, tmp_path)
    assert code == 1, err[-3000:]
    assert f"lost {lost} while waiting for it to roll out step 2: the actor died" in err, err[-3000:]
    assert steps_logged(tmp_path) == [1]

    # The node is back: the same command resumes from step 1's checkpoint and finishes, on both nodes again.
    two_nodes.add_worker()
    code, err = finish(start_run(tmp_path, *command), tmp_path)
    assert code == 0, err[-3000:]
    assert "resumed at step 1" in (tmp_path / "out" / "astuner.log").read_text()
    assert set(placements(tmp_path)[-1].values()) == {two_nodes.head_id, two_nodes.worker.node_id}
    assert steps_logged(tmp_path) == [1, 2]
    assert_weights_equal_debug(tmp_path, debug_run)  # nothing of step 2 lost or trained twice
