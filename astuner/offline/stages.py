"""The stages of `algorithm.type: sft | dpo | orpo`: the same loop as a GRPO run, with the data as its rollout.

    rollout    the batch of conversations (sft) or pairs (dpo, orpo) read from offline_data, as it is
    train      one optimizer step of the SFT loss, or of the preference loss (offline/steps.py)
    sync       nothing: there is no engine
    validate   `val/loss` (and the preference statistics) on offline_data.val_file; the summary follows the loss

So schedule, checkpoints (global_step_N, resumable at the exact batch), validation and the summary line are the
loop's own (astuner/loop.py); the selection policies OfflineSFT and OfflinePreference (astuner/selection.py) turn
the batch into what the trainer takes.
"""

from __future__ import annotations

import logging
from pathlib import Path

from astuner.algorithm.catalog import AlgorithmType
from astuner.stages import LocalTrainerStages, Validation
from astuner.types import TrainResult

log = logging.getLogger(__name__)


class OfflineStages(LocalTrainerStages):
    score_name = "loss"

    def __init__(self, trainer, tokenizer, kind: AlgorithmType, beta: float, experiment_dir: Path) -> None:
        self.trainer, self.tokenizer, self.kind, self.beta = trainer, tokenizer, kind, beta
        self.experiment_dir = experiment_dir

    def rollout(self, tasks: list, validation: bool, step: int = 0) -> list:
        return tasks

    def train(self, samples: list, objective: str = "sft") -> TrainResult:
        from astuner.offline.steps import preference_step

        if objective == "sft":
            return self.trainer.train(samples, objective="sft")
        return TrainResult(preference_step(self.trainer, samples, objective, self.beta), [None] * len(samples))

    def sync_weights(self) -> None:
        """No engine: the next step reads the data, not the policy."""

    def validate(self, tasks: list, step: int, repeats: int) -> Validation:
        from astuner.offline.steps import preference_step, sft_validation_loss

        if self.kind.data == "conversations":
            loss = sft_validation_loss(self.trainer, [x.as_sample(f"val{i}") for i, x in enumerate(tasks)])
            return Validation({"val/loss": loss}, "loss")
        stats = preference_step(self.trainer, tasks, self.kind.objective, self.beta, train=False)
        return Validation({f"val/{k}": v for k, v in stats.items()
                           if k not in ("train_tokens", "train_tokens_per_s", "num_pairs")}, "loss")
