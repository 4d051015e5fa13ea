"""The stage contract: every method the loop and its driver (`run_loop`, `drive` in astuner/loop.py) call on a
backbone's stages, declared once.

A backbone subclasses `Stages` and decides where each stage runs (this process, Ray actors, explorers ahead of
the trainer). Five methods are required; the others have the defaults written here, so neither the loop nor a
driver ever asks whether a method exists.

    required   rollout(tasks, validation, step, progress)   episodes of a training batch, or greedy validation
                                                     episodes; `progress`: (description, total) -> a bar with
                                                     update() (the monitor's), or None
               rollout_sampled(tasks, step, repeats, progress)  `repeats` episodes per task at the training
                                                     temperature (pass@k validation; only when val_num_repeat > 1)
               train(samples, objective)            one optimizer step (or ppo_epochs of them): a TrainResult
                                                     (metrics, the trainer's logprobs before the update)
               sync_weights()                       the engines now sample from the trainer's weights: a
                                                     SyncReport (None where engines take them later, trinity)
               save_checkpoint(step, run_state)     a resumable checkpoint; its path
    optional   lookahead, prefetch(step, tasks)     batches handed early to stages that roll out ahead
               step_metrics()                       what the stages add to a step's log (overlap, policy versions)
               validate(tasks, step, repeats, progress)  validation metrics and the score the summary follows
               score_name                           what validate scores: "accuracy" or "loss"
               load_checkpoint(path), resumed(step) resume: the trainer's state, then the engines' weights
               shutdown()                           release engines, actors and placement
               teacher                              on-policy distillation's teacher (astuner/distill/), set by
                                                    the driver (loop.drive) where the loop runs; else None
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from pathlib import Path

from astuner.monitor import validation_metrics, void_note
from astuner.types import Episode, Sample, SyncReport, Task, TrainResult

log = logging.getLogger(__name__)


@dataclass
class Validation:
    """What a validation produced: its metrics (`val/...`), the score the run summary follows, and the episodes
    to save for the log viewer (none for offline objectives)."""

    metrics: dict[str, float]
    score_name: str  # "accuracy" (higher is better) or "loss"
    episodes: list[Episode] = field(default_factory=list)
    void: str | None = None  # why it measured nothing (monitor.void_note): most episodes failed or timed out

    @property
    def score(self) -> float:
        return math.nan if self.void else self.metrics[f"val/{self.score_name}"]


class Stages:
    lookahead: int = 0  # batches after the current one that `prefetch` may be handed
    teacher = None  # on-policy distillation's teacher (astuner/distill/teachers.py), set by loop.drive
    score_name = "accuracy"  # what `validate` scores: "accuracy" (higher is better) or "loss"

    def rollout(self, tasks: list[Task], validation: bool, step: int = 0, progress=None) -> list[Episode]:
        raise NotImplementedError(f"{type(self).__name__} must implement rollout")

    def rollout_sampled(self, tasks: list[Task], step: int, repeats: int, progress=None) -> list[Episode]:
        raise NotImplementedError(f"{type(self).__name__} has no sampled validation (pass@k): set "
                                  "astuner.trainer_common.val_num_repeat: 1")

    def train(self, samples: list[Sample], objective: str = "policy") -> TrainResult:
        raise NotImplementedError(f"{type(self).__name__} must implement train")

    def sync_weights(self) -> SyncReport | None:
        raise NotImplementedError(f"{type(self).__name__} must implement sync_weights")

    def save_checkpoint(self, step: int, run_state: dict) -> Path:
        raise NotImplementedError(f"{type(self).__name__} must implement save_checkpoint")

    def prefetch(self, step: int, tasks: list[Task]) -> None:
        """`tasks` will be step `step`'s batch: stages that roll out ahead may start it now."""

    def step_metrics(self) -> dict[str, float]:
        return {}

    def validate(self, tasks: list[Task], step: int, repeats: int, progress=None) -> Validation:
        """Greedy episodes of every task; with `repeats` > 1 also pass@k over that many sampled episodes."""
        episodes = self.rollout(tasks, validation=True, step=step, progress=progress)
        sampled = self.rollout_sampled(tasks, step, repeats, progress) if repeats > 1 else []
        metrics = validation_metrics(episodes, sampled, repeats)
        void = void_note(episodes) if metrics.get("val/void") else None  # the note's text only when there is one
        return Validation(metrics, "accuracy", episodes + sampled, void)

    def load_checkpoint(self, path: Path) -> dict:
        raise NotImplementedError(f"{type(self).__name__} cannot resume from a checkpoint")

    def resumed(self, step: int) -> None:
        """After `load_checkpoint`: the engines serve the checkpoint's weights from here on."""

    def shutdown(self) -> None:
        """Release what the stages hold (engines, actors, placement); called once, also after a failure."""


class LocalTrainerStages(Stages):
    """Stages whose trainer lives in this process (the debug backbone, offline objectives): checkpoints are
    written and read here, as experiment_dir/global_step_N. Subclasses set `trainer`, `tokenizer` and
    `experiment_dir`."""

    trainer = tokenizer = experiment_dir = None

    def save_checkpoint(self, step: int, run_state: dict) -> Path:
        path = self.experiment_dir / f"global_step_{step}"
        self.trainer.save_checkpoint(path, tokenizer=self.tokenizer, run_state=run_state)
        log.info("saved checkpoint %s", path)
        return path

    def load_checkpoint(self, path: Path) -> dict:
        return self.trainer.load_checkpoint(path)
