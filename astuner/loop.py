"""THE training loop. Every backbone calls `run_loop`; a backbone only decides where each stage runs.

    for each step:
        tasks    = next batch of training tasks
        episodes = stages.rollout(tasks)                 # workflow x num_repeat, judge, madness
        samples  = episodes_to_samples(episodes)         # one per LLM call, GRPO advantage per episode
        metrics  = stages.train(samples)                 # PPO-clip step(s) on the policy
        stages.sync_weights()                            # the engine samples from the new policy
        log, validate every test_freq, checkpoint every save_freq
"""

from __future__ import annotations

import logging
import math
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Protocol

from astuner.algorithm.samples import episodes_to_samples
from astuner.types import (
    FLAG_FAILED,
    FLAG_NONSENSE,
    FLAG_OVERFLOW,
    FLAG_TIMEOUT,
    FLAG_WRONG_TOOLCALL,
    Episode,
    Sample,
    Task,
)

log = logging.getLogger(__name__)


class Stages(Protocol):
    def rollout(self, tasks: list[Task], validation: bool) -> list[Episode]: ...

    def train(self, samples: list[Sample]) -> dict[str, float]: ...

    def sync_weights(self) -> None: ...

    def save_checkpoint(self, step: int) -> Path: ...


class MonitorLike(Protocol):
    def log_metrics(self, step: int, metrics: dict[str, float]) -> None: ...

    def save_episodes(self, step: int, episodes: list[Episode], tag: str) -> None: ...

    def step_done(self, step: int, metrics: dict[str, float]) -> None: ...


@dataclass
class LoopSettings:
    train_batch_size: int
    total_epochs: int
    total_training_steps: int | None
    save_freq: int
    test_freq: int
    val_before_train: bool
    shuffle: bool
    seed: int
    adv_estimator: str
    norm_adv_by_std: bool
    adv_epsilon: float
    max_sample_per_task: int

    @classmethod
    def from_config(cls, cfg) -> "LoopSettings":
        a, tc = cfg.astuner, cfg.astuner.trainer_common
        return cls(
            train_batch_size=int(a.data.train_batch_size),
            total_epochs=int(tc.total_epochs),
            total_training_steps=None if tc.total_training_steps is None else int(tc.total_training_steps),
            save_freq=int(tc.save_freq),
            test_freq=int(tc.test_freq),
            val_before_train=bool(tc.val_before_train),
            shuffle=bool(a.data.shuffle),
            seed=int(a.seed),
            adv_estimator=str(tc.algorithm.adv_estimator),
            norm_adv_by_std=bool(tc.algorithm.norm_adv_by_std_in_grpo),
            adv_epsilon=float(tc.algorithm.epsilon),
            max_sample_per_task=int(a.rollout.multi_turn.max_sample_per_task),
        )


@dataclass
class RunSummary:
    steps: int = 0
    seconds: float = 0.0
    val_scores: dict[int, float] = field(default_factory=dict)  # step -> validation accuracy
    last_checkpoint: Path | None = None

    def line(self, name: str) -> str:
        minutes, seconds = divmod(int(self.seconds), 60)
        text = f"{name}: {self.steps} steps in {minutes}m{seconds:02d}s"
        if self.val_scores:
            first, last = min(self.val_scores), max(self.val_scores)
            start, end = self.val_scores[first], self.val_scores[last]
            text += f"; validation accuracy {start:.3f} (step {first}) -> {end:.3f} (step {last}), {end - start:+.3f}"
        if self.last_checkpoint is not None:
            text += f"; checkpoint {self.last_checkpoint}"
        return text


def count_steps(num_tasks: int, settings: LoopSettings) -> int:
    total = math.ceil(num_tasks / settings.train_batch_size) * settings.total_epochs
    if settings.total_training_steps is not None:
        total = min(total, settings.total_training_steps)
    return total


def task_batches(tasks: list[Task], settings: LoopSettings) -> Iterator[list[Task]]:
    """Epochs of (optionally shuffled) tasks cut into batches; the last batch of an epoch may be smaller."""
    rng = random.Random(settings.seed)
    for _ in range(settings.total_epochs):
        order = list(tasks)
        if settings.shuffle:
            rng.shuffle(order)
        for start in range(0, len(order), settings.train_batch_size):
            yield order[start : start + settings.train_batch_size]


def episode_metrics(episodes: list[Episode], prefix: str) -> dict[str, float]:
    n = max(len(episodes), 1)
    rewards = [e.reward for e in episodes if e.trainable] or [0.0]
    mean = sum(rewards) / len(rewards)
    calls = [c for e in episodes for c in e.calls]
    return {
        f"{prefix}/reward_mean": mean,
        f"{prefix}/reward_std": math.sqrt(sum((r - mean) ** 2 for r in rewards) / len(rewards)),
        f"{prefix}/success_rate": sum(e.is_success for e in episodes) / n,
        f"{prefix}/response_length": sum(len(c.response_ids) for c in calls) / max(len(calls), 1),
        f"{prefix}/turns_per_episode": len(calls) / n,
        f"{prefix}/madness_rate": sum(any(f in e.flags for f in (FLAG_NONSENSE, FLAG_WRONG_TOOLCALL)) for e in episodes) / n,
        f"{prefix}/failure_rate": sum(FLAG_FAILED in e.flags or FLAG_TIMEOUT in e.flags for e in episodes) / n,
        f"{prefix}/overflow_rate": sum(FLAG_OVERFLOW in e.flags for e in episodes) / n,
        f"{prefix}/generated_tokens": float(sum(len(c.response_ids) for c in calls)),
    }


def run_loop(
    settings: LoopSettings,
    stages: Stages,
    train_tasks: list[Task],
    val_tasks: list[Task],
    monitor: MonitorLike,
) -> RunSummary:
    summary = RunSummary()
    total_steps = count_steps(len(train_tasks), settings)
    started = time.perf_counter()

    def validate(step: int) -> None:
        if not val_tasks:
            return
        t0 = time.perf_counter()
        episodes = stages.rollout(val_tasks, validation=True)
        metrics = episode_metrics(episodes, "val")
        metrics["val/accuracy"] = metrics["val/success_rate"]
        metrics["time/validation_s"] = time.perf_counter() - t0
        summary.val_scores[step] = metrics["val/accuracy"]
        monitor.log_metrics(step, metrics)
        monitor.save_episodes(step, episodes, "val")
        log.info("step %d validation accuracy %.3f over %d tasks", step, metrics["val/accuracy"], len(episodes))

    if settings.val_before_train:
        validate(0)

    for step, tasks in enumerate(task_batches(train_tasks, settings), start=1):
        if step > total_steps:
            break
        t0 = time.perf_counter()
        episodes = stages.rollout(tasks, validation=False)
        t1 = time.perf_counter()
        samples = episodes_to_samples(
            episodes,
            adv_estimator=settings.adv_estimator,
            norm_by_std=settings.norm_adv_by_std,
            epsilon=settings.adv_epsilon,
            max_sample_per_task=settings.max_sample_per_task,
        )
        train_metrics = stages.train(samples) if samples else {}
        t2 = time.perf_counter()
        stages.sync_weights()
        t3 = time.perf_counter()

        metrics = episode_metrics(episodes, "train")
        metrics.update({f"actor/{k}": v for k, v in train_metrics.items()})
        metrics.update({
            "time/rollout_s": t1 - t0,
            "time/train_s": t2 - t1,
            "time/sync_s": t3 - t2,
            "perf/rollout_tokens_per_s": metrics["train/generated_tokens"] / max(t1 - t0, 1e-9),
            "train/num_samples": float(len(samples)),
        })
        monitor.log_metrics(step, metrics)
        monitor.save_episodes(step, episodes, "train")
        summary.steps = step

        if step % settings.test_freq == 0 or step == total_steps:
            validate(step)
        if step % settings.save_freq == 0 or step == total_steps:
            summary.last_checkpoint = stages.save_checkpoint(step)
        monitor.step_done(step, metrics)

    summary.seconds = time.perf_counter() - started
    return summary
