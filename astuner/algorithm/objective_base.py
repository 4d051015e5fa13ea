"""What every objective is to the trainer: a micro-batch as flat response tokens (`TokenBatch`) and the
interface `Trainer.forward_backward` calls (`TokenObjective`). The objectives themselves: objectives.py (policy
gradient, SFT) and preference.py (DPO, ORPO)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from astuner.algorithm.distillation import carries_advantage, token_advantages, topk_rows
from astuner.step_plan import offsets
from astuner.types import Sample


@dataclass
class TokenBatch:
    """One micro-batch, flattened to its response tokens R (b: the sample a token belongs to)."""

    samples: list[Sample]
    logprobs_R: Tensor  # with gradient
    entropy_R: Tensor | None  # with gradient only when the objective asks (`entropy_grad`)
    old_logprobs_R: Tensor
    advantages_R: Tensor
    weights_R: Tensor  # token weight x loss mask
    mask_R: Tensor
    seq_index_R: Tensor
    ref_logprobs_R: Tensor | None  # the frozen initial policy's, when `needs_reference`
    # With `teacher_topk`: the student's raw logprobs of the teacher's top-k ids at each token (with gradient) and
    # the teacher's renormalised probabilities of them (algorithm/distillation.py: topk_rows).
    topk_student_R_K: Tensor | None = None
    topk_teacher_R_K: Tensor | None = None

    @classmethod
    def of(cls, samples: list[Sample], weights_B: list[float], logprobs_R: Tensor, entropy_R: Tensor | None,
           ref_logprobs_R: Tensor | None, topk_R_K: Tensor | None = None) -> TokenBatch:
        """The micro-batch `samples` with their token weights (one per sample) and forward results."""
        dev = logprobs_R.device
        teacher_R_K = None
        if topk_R_K is not None:
            teacher_R_K = torch.tensor(topk_rows(samples, topk_R_K.shape[-1])[1], device=dev, dtype=torch.float32)
        lengths = [len(s.response_ids) for s in samples]
        mask_R = torch.tensor([m for s in samples for m in (s.loss_mask or [1] * len(s.response_ids))],
                              device=dev, dtype=torch.float32)
        w_R = torch.tensor([w for w, n in zip(weights_B, lengths) for _ in range(n)], device=dev)
        return cls(
            samples, logprobs_R, entropy_R,
            old_logprobs_R=torch.tensor([x for s in samples for x in s.old_logprobs], device=dev, dtype=torch.float32),
            advantages_R=torch.tensor([a for s in samples for a in token_advantages(s)], device=dev,
                                      dtype=torch.float32),
            weights_R=w_R * mask_R, mask_R=mask_R,
            seq_index_R=torch.tensor([b for b, n in enumerate(lengths) for _ in range(n)], device=dev),
            ref_logprobs_R=ref_logprobs_R, topk_student_R_K=topk_R_K, topk_teacher_R_K=teacher_R_K,
        )

    def per_sample(self, values_R: Tensor) -> list[list[float]]:
        """A flat R tensor back as one list per sample."""
        flat = values_R.detach().cpu().tolist()
        return [flat[start : start + len(s.response_ids)]
                for s, start in zip(self.samples, offsets([len(s.response_ids) for s in self.samples]))]


class TokenObjective:
    """What the trainer asks of an objective; the defaults are those of a plain supervised loss."""

    name: ClassVar[str]
    loss_metric: ClassVar[str]  # the step's mean mini-batch loss is reported under this name
    stat_keys: tuple[str, ...] = ()  # token sums `loss` returns
    max_stats: tuple[str, ...] = ()  # among them, those combined by max instead of sum
    needs_reference = False  # forward the frozen initial policy too
    trains_zero_advantage = True  # forward samples whose advantage is 0 (else their gradient is exactly 0)
    entropy_grad = False  # the entropy enters the loss (keep its gradient)
    epochs = 1  # passes over the step's samples
    recomputes_old_logprobs = False  # old logprobs: the trainer's, before the update, instead of the engine's
    checks_mismatch = False  # the first forward before any update measures trainer vs engine logprobs
    weighted_metrics: tuple[str, ...] = ()  # reported as means over every loss-weighted token, forwarded or not
    paired = False  # samples come as (chosen, rejected) pairs that share micro-batches (preference.py)
    entropy_metric = True  # forward the token entropies for the `entropy` metric
    teacher_topk = 0  # k > 0: forward the student's raw logprobs of the samples' teacher top-k ids too

    def reported(self) -> tuple[str, ...]:
        """Token means the step reports (over the forwarded tokens, or those of `weighted_metrics`)."""
        return ("entropy",)

    def forwards(self, sample: Sample, weight: float) -> bool:
        """Whether a sample of the mini-batch is forwarded: zero-weight samples contribute nothing, zero-advantage
        ones nothing either unless the objective trains them."""
        return weight > 0 and (self.trains_zero_advantage or carries_advantage(sample))

    def mean_over(self, key: str, tally) -> float:
        """What a reported stat's sum over a step is divided by (`tally`: the step's counts, trainer/step.py)."""
        return tally.weighted_tokens if key in self.weighted_metrics else tally.response_tokens

    def bound(self, samples: list[Sample]) -> TokenObjective:
        """The objective for the mini-batch `samples` (those that divide by mini-batch counts fix them here)."""
        return self

    def loss(self, batch: TokenBatch) -> tuple[Tensor, dict[str, Tensor]]:
        raise NotImplementedError
