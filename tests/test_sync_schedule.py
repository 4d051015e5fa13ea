"""The Ray backbones' pure parts, with hand-computed numbers: the trinity sync schedule and staleness bound,
data-parallel ownership, how a batch is split over actors, and the loop's prefetch hand-off and staleness log."""

from __future__ import annotations

import pytest

from astuner.backbone.ray_run import split_evenly
from astuner.backbone.trinity import check_trinity_config
from astuner.config import load_config
from astuner.errors import UserError
from astuner.backbone.sync_schedule import SyncSchedule, needed_version
from astuner.config.derived import staleness_bound
from astuner.trainer.data_parallel import owners
from astuner.loop import LoopSettings, run_loop
from astuner.selection import SelectionSettings
from astuner.monitor import staleness_metrics
from astuner.stages import Stages
from astuner.types import Episode, LLMCall, Sample, Task, TrainResult


def test_staleness_bound_and_needed_version():
    assert staleness_bound(1, 0, None) == 0  # on-policy
    assert staleness_bound(2, 0, None) == 1
    assert staleness_bound(1, 1, None) == 1  # one-step off-policy
    assert staleness_bound(4, 1, 2) == 2  # an explicit bound wins
    # step 5 trains at version 4; with bound 1 it may be rolled out at version 3 or later
    assert needed_version(5, 1) == 3
    assert needed_version(1, 3) == 0


def test_fixed_schedule_syncs_every_interval():
    s = SyncSchedule(sync_interval=2, bound=1)
    assert [t for t in range(1, 7) if s.scheduled_sync(t)] == [2, 4, 6]
    assert s.lookahead == 1
    assert s.may_start(2, explorer_version=0) and not s.may_start(3, explorer_version=0)
    assert s.sync_needed_for(3, explorer_version=0, trainer_version=2)
    assert not s.sync_needed_for(3, explorer_version=0, trainer_version=0)  # nothing newer to send
    assert not SyncSchedule(2, 1, "dynamic_by_explorer").scheduled_sync(2)  # syncs only on demand
    with pytest.raises(ValueError, match="sync_style"):
        SyncSchedule(1, 0, "sometimes")


def _sample(uid: str, n_tokens: int) -> Sample:
    return Sample([1] * (n_tokens - 1), [2], [0.0], 1.0, 1.0, uid)


def test_owners_balance_tokens_inside_each_mini_batch():
    # episodes a (10 tokens, two calls of 5), b 8, c 3, d 2; one mini-batch; longest first to the lightest rank:
    # a -> 0 (10), b -> 1 (8), c -> 1 (11), d -> 0 (12)
    samples = [_sample("a", 5), _sample("b", 8), _sample("a", 5), _sample("c", 3), _sample("d", 2)]
    assert owners(samples, 1, 2) == {"a": 0, "b": 1, "c": 1, "d": 0}
    # two mini-batches (a, b | c, d) are balanced separately
    assert owners(samples, 2, 2) == {"a": 0, "b": 1, "c": 0, "d": 1}
    assert set(owners(samples, 1, 1).values()) == {0}


def test_split_evenly():
    assert split_evenly([1, 2, 3, 4, 5], 2) == [[1, 2, 3], [4, 5]]
    assert split_evenly([1], 3) == [[1], [], []]


def _episode(task: Task, version: int) -> Episode:
    call = LLMCall(prompt_ids=[1, 2], response_ids=[3], response_logprobs=[-1.0], finish_reason="stop",
                   temperature=1.0)
    e = Episode(task=task, repeat_index=0, episode_uid=f"{task.task_id}#0", calls=[call], reward=1.0)
    e.policy_version = version
    return e


def test_staleness_metrics():
    task = Task(task_id="t", main_query="q")
    m = staleness_metrics([_episode(task, 2), _episode(task, 3)], step=5)  # trains at version 4
    assert m == {"rollout/staleness_mean": 1.5, "rollout/staleness_max": 2.0, "rollout/policy_version_min": 2.0}


class _AheadStages(Stages):
    """Records what the loop hands early; rolls out on the spot."""

    lookahead = 2

    def __init__(self) -> None:
        self.prefetched: list[tuple[int, list[str]]] = []

    def prefetch(self, step, tasks):
        self.prefetched.append((step, [t.task_id for t in tasks]))

    def rollout(self, tasks, validation, step=0, progress=None):
        return [_episode(t, max(step - 1, 0)) for t in tasks]

    def train(self, samples, objective="policy"):
        return TrainResult({}, [None] * len(samples))

    def sync_weights(self):
        pass

    def save_checkpoint(self, step, run_state):
        return None

    def step_metrics(self):
        return {"extra/metric": 1.0}


class _Monitor:
    def __init__(self) -> None:
        self.logged = []

    def log_metrics(self, step, metrics):
        self.logged.append((step, metrics))

    def save_episodes(self, *args, **kwargs):
        pass

    def step_done(self, step, metrics):
        pass


def test_the_loop_hands_the_next_batches_early():
    tasks = [Task(task_id=str(i), main_query="q") for i in range(4)]
    settings = LoopSettings(train_batch_size=1, total_epochs=1, total_training_steps=3, save_freq=99, test_freq=99,
                            val_before_train=False, shuffle=False, seed=0,
                            selection=SelectionSettings(train_batch_size=1, adv_estimator="grpo",
                                                        norm_adv_by_std=False, adv_epsilon=1e-6,
                                                        max_sample_per_task=4, max_idle_steps=99))
    stages, monitor = _AheadStages(), _Monitor()
    run_loop(settings, stages, tasks, [], monitor)
    # before step s: steps s+1 and s+2, never past total_training_steps = 3
    assert stages.prefetched == [(2, ["1"]), (3, ["2"]), (3, ["2"])]
    train_logs = [m for _, m in monitor.logged if "train/reward_mean" in m]
    assert [m["rollout/staleness_max"] for m in train_logs] == [0.0, 0.0, 0.0]
    assert all(m["extra/metric"] == 1.0 for m in train_logs)


def test_trinity_corrects_stale_samples_or_refuses(tmp_path, tiny_model_dir):
    from test_run_contract import write_run

    yaml = write_run(tmp_path, tiny_model_dir)
    on_policy = load_config(yaml, backbone="trinity")
    assert on_policy.derived == () and on_policy.typed.astuner.trainer_common.old_logprobs == "engine"
    check_trinity_config(on_policy)  # bound 0: nothing to correct
    # Derived when the config is loaded for the backbone: the config saved and every worker's read the same values.
    stale = load_config(yaml, ["trinity.synchronizer.sync_offset=1"], backbone="trinity")
    tc = stale.typed.astuner.trainer_common
    assert (tc.old_logprobs, tc.rollout_is_cap) == ("trainer", 2.0) and "1 policy versions stale" in stale.derived[0]
    assert stale.cfg.astuner.trainer_common.old_logprobs == "trainer"
    check_trinity_config(stale)
    assert load_config(yaml, ["trinity.synchronizer.sync_offset=1"]).typed.astuner.trainer_common.old_logprobs == \
        "engine"  # loaded for no backbone (eval, serve): nothing derived
    loaded = load_config(yaml, ["trinity.synchronizer.sync_interval=3", "astuner.trainer_common.rollout_is_cap=1.5"],
                         backbone="trinity")
    assert loaded.typed.astuner.trainer_common.rollout_is_cap == 1.5
    with pytest.raises(UserError, match="old_logprobs: engine would trust"):
        load_config(yaml, ["trinity.synchronizer.sync_interval=2", "astuner.trainer_common.old_logprobs=engine"],
                    backbone="trinity")
    with pytest.raises(RuntimeError, match="backbone='trinity'"):  # stale samples the config does not correct
        check_trinity_config(load_config(yaml, ["trinity.synchronizer.sync_offset=1"]))
    with pytest.raises(UserError, match="filter_groups"):
        check_trinity_config(load_config(yaml, ["astuner.trainer_common.algorithm.filter_groups.enable=true"]))


def test_a_trinity_sync_method_that_is_not_implemented_is_refused(tmp_path, tiny_model_dir):
    from astuner.config import ConfigError
    from test_run_contract import write_run

    for method in ("nccl", "checkpoint", "memory"):
        with pytest.raises(ConfigError, match=f"sync_method' '{method}' is refused: only object_store is implemented"):
            load_config(write_run(tmp_path, tiny_model_dir), [f"trinity.synchronizer.sync_method={method}"])
    loaded = load_config(write_run(tmp_path, tiny_model_dir), ["trinity.synchronizer.sync_method=object_store"])
    assert loaded.typed.trinity.synchronizer.sync_method == "object_store"


def test_verl_reserves_tensor_parallel_gpus_per_worker_and_checks_the_total():
    from astuner.backbone.ray_cluster import missing_resources
    from astuner.backbone.verl import verl_bundles

    node = {"CPU": 64.0, "GPU": 8.0, "memory": 2.0**40}
    bundles = verl_bundles(world=8, cpus=1.0, gpus_per_process=1.0, tp=2, memory=0.0)
    assert [b.gpus for b in bundles] == [2.0] * 8  # each worker's engine spans 2 GPUs
    assert missing_resources(bundles, [node]) == ["16 GPU (the cluster has 8)"]
    assert missing_resources(bundles, [node, node]) == []  # two 8-GPU nodes hold 8 workers of 2 GPUs
    assert missing_resources(verl_bundles(4, 1.0, 1.0, 2, 0.0), [node]) == []
    assert [b.gpus for b in verl_bundles(2, 1.0, 0.0, 2, 0.0)] == [0.0, 0.0]  # a CPU cluster: no GPUs asked


def test_explorer_figures_keep_their_log_names():
    from astuner.backbone.trinity import ExplorerFigures

    figures = ExplorerFigures(policy_version=3, explorer_version=2, num_syncs=2, explorer_busy_s=4.0,
                              rollout_tokens_per_s=50.0)
    assert figures.metrics() == {"trinity/policy_version": 3.0, "trinity/explorer_version": 2.0,
                                 "trinity/num_syncs": 2.0, "time/explorer_busy_s": 4.0,
                                 "perf/rollout_tokens_per_s": 50.0}  # what a step did not measure is left out
