"""The loop's own logic with fake stages: batching, schedule of validation and checkpoints, metrics, summary."""

from __future__ import annotations

from pathlib import Path

from astuner.loop import LoopSettings, count_steps, episode_metrics, run_loop, task_batches
from astuner.types import LLMCall, Episode, Task


def settings(**kw):
    base = dict(train_batch_size=2, total_epochs=2, total_training_steps=None, save_freq=2, test_freq=3,
                val_before_train=True, shuffle=True, seed=0, adv_estimator="grpo", norm_adv_by_std=True,
                adv_epsilon=1e-6, max_sample_per_task=4)
    base.update(kw)
    return LoopSettings(**base)


TASKS = [Task(f"t{i}", f"q{i}") for i in range(5)]


def test_batches_cover_every_task_once_per_epoch_with_a_short_last_batch():
    batches = list(task_batches(TASKS, settings()))
    assert [len(b) for b in batches] == [2, 2, 1, 2, 2, 1]
    for epoch in (batches[:3], batches[3:]):
        assert sorted(t.task_id for b in epoch for t in b) == [t.task_id for t in TASKS]
    assert [t.task_id for t in batches[0] + batches[1]] != [t.task_id for t in batches[3] + batches[4]]  # reshuffled
    assert list(task_batches(TASKS, settings(shuffle=False)))[0] == TASKS[:2]


def test_step_count_and_cap():
    assert count_steps(5, settings()) == 6
    assert count_steps(5, settings(total_training_steps=4)) == 4


def call(n):
    return LLMCall([1, 2], [3] * n, [-1.0] * n, "stop", 1.0)


def test_episode_metrics_by_hand():
    task = Task("t", "q")
    episodes = [
        Episode(task, 0, "a", calls=[call(2), call(4)], reward=1.0, is_success=True),
        Episode(task, 1, "b", calls=[call(3)], reward=0.0, flags=["nonsense"]),
        Episode(task, 2, "c", calls=[], flags=["failed"]),
        Episode(task, 3, "d", calls=[call(1)], reward=0.5, flags=["overflow"]),
    ]
    m = episode_metrics(episodes, "train")
    assert m["train/reward_mean"] == 0.5  # failed episodes have no reward to average
    assert abs(m["train/reward_std"] - (1 / 6) ** 0.5) < 1e-12
    assert m["train/success_rate"] == 0.25
    assert m["train/response_length"] == 10 / 4 and m["train/turns_per_episode"] == 1.0
    assert m["train/madness_rate"] == m["train/failure_rate"] == m["train/overflow_rate"] == 0.25


class FakeStages:
    def __init__(self):
        self.events = []

    def rollout(self, tasks, validation):
        self.events.append(("val" if validation else "rollout", len(tasks)))
        return [Episode(t, i, f"{t.task_id}#{i}", calls=[call(2)], reward=float(i), is_success=i > 0)
                for t in tasks for i in range(1 if validation else 2)]

    def train(self, samples):
        self.events.append(("train", len(samples)))
        return {"policy_loss": 0.0}

    def sync_weights(self):
        self.events.append(("sync",))

    def save_checkpoint(self, step):
        self.events.append(("save", step))
        return Path(f"global_step_{step}")


class FakeMonitor:
    def __init__(self):
        self.logged, self.saved, self.done = [], [], []

    def log_metrics(self, step, metrics):
        self.logged.append((step, metrics))

    def save_episodes(self, step, episodes, tag):
        self.saved.append((step, tag))

    def step_done(self, step, metrics):
        self.done.append(step)


def test_schedule_of_validation_training_and_checkpoints():
    stages, monitor = FakeStages(), FakeMonitor()
    summary = run_loop(settings(total_training_steps=4), stages, TASKS, TASKS[:3], monitor)
    kinds = [e for e in stages.events if e[0] in ("val", "save")]
    assert kinds == [("val", 3), ("save", 2), ("val", 3), ("val", 3), ("save", 4)]  # val at 0, 3, 4; save at 2, 4
    assert stages.events[1:4] == [("rollout", 2), ("train", 4), ("sync",)]  # 2 tasks x 2 episodes -> 4 samples
    assert summary.steps == 4 and sorted(summary.val_scores) == [0, 3, 4]
    assert summary.last_checkpoint == Path("global_step_4") and monitor.done == [1, 2, 3, 4]
    assert "4 steps" in summary.line("run") and "validation accuracy 0.000 (step 0)" in summary.line("run")
