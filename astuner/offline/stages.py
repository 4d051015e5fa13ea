"""The stages of `algorithm.type: sft | dpo | orpo`: the same loop as a GRPO run, with the data as its batch.

    batch      the conversations (sft) or pairs (dpo, orpo) of offline_data; the selection policies OfflineSFT and
               OfflinePreference (astuner/selection.py) turn them into samples, nothing is rolled out
    train      one step of the catalog's objective through `Trainer.train`, like every objective
    sync       nothing: there is no engine
    validate   `val/loss` (and the preference statistics) on offline_data.val_file through `Trainer.forward`;
               the summary follows the loss

So schedule, checkpoints (global_step_N, resumable at the exact batch), validation and the summary line are the
loop's own (astuner/loop.py).
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

    def __init__(self, trainer, tokenizer, kind: AlgorithmType, experiment_dir: Path) -> None:
        self.trainer, self.tokenizer, self.kind = trainer, tokenizer, kind
        self.experiment_dir = experiment_dir

    def rollout(self, tasks: list, validation: bool, step: int = 0, progress=None) -> list:
        raise TypeError(f"algorithm.type {self.kind.name} trains on offline_data: it has no rollouts")

    def train(self, samples: list, objective: str = "sft") -> TrainResult:
        return self.trainer.train(samples, objective)

    def sync_weights(self) -> None:
        """No engine: the next step reads the data, not the policy."""

    def validate(self, tasks: list, step: int, repeats: int, progress=None) -> Validation:
        """The validation set's loss: the token-mean NLL (sft), or the pair loss and its means over pairs."""
        from astuner.algorithm.objectives import token_objective
        from astuner.algorithm.preference import pair_samples

        objective = token_objective(self.kind.objective, self.trainer.settings)
        if objective.paired:
            sums = self.trainer.forward(pair_samples(tasks, "val"), objective, trained_only=True)
            metrics = {"loss": sums["loss"], **{k: sums[k] / len(tasks) for k in objective.reported()}}
        else:
            sums = self.trainer.forward([x.as_sample(f"val{i}") for i, x in enumerate(tasks)], objective,
                                        trained_only=True)
            metrics = {"loss": sums["nll"] / max(sums["response_tokens"], 1)}
        return Validation({f"val/{k}": v for k, v in metrics.items()}, "loss")
