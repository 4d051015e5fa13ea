"""Token objectives: what `Trainer.forward_backward(batch, objective)` minimises, as small objects.

An objective sees one micro-batch as flattened response tokens R (`TokenBatch`): logp_t = log pi_theta of the
token, w_t = its sample's weight from `loss.token_weights` times its loss mask. Every loss is a plain weighted
token sum over the mini-batch, so summing micro-batch losses (accumulating their gradients) is exact.

    PolicyGradient   L = sum_t w_t * l_t,   l_t = rho_t * pg_t + kl_coef * KL_t - entropy_coeff * H_t
                     pg_t: the PPO-clip token loss (or GSPO's sequence ratio), KL_t: k1/k3 to the frozen initial
                     policy, H_t: the token entropy (all in `loss.py`); rho_t = min(exp(old_t - engine_t), cap)
                     with rollout_is_cap (old logprobs recomputed by the trainer, `mismatch.py`), else 1;
                     on-policy distillation with distill_topk adds topk_coef * sum_t w_t * KL~_t, the forward KL to
                     the teacher's top-k (`distillation.py`, `loss.topk_kl_loss`)
    SFT              L = -sum_t w_t * logp_t   over the trained (assistant) tokens; advantages and old
                     logprobs are not used
    DPO, ORPO        sequence-pair losses over sums of the same token logprobs (`preference.py`)

`TOKEN_OBJECTIVES` names every objective; `token_objective(name, settings)` builds one from the trainer's settings
(the stages name them: `train(samples, objective="sft")`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from astuner.algorithm.loss import policy_loss, sft_loss, topk_kl_loss
from astuner.algorithm.mismatch import truncated_is_weights
from astuner.algorithm.objective_base import TokenBatch, TokenObjective
from astuner.algorithm.preference import DPO, ORPO

if TYPE_CHECKING:
    from astuner.trainer.settings import TrainerSettings

__all__ = ["TOKEN_OBJECTIVES", "PolicyGradient", "SFT", "TokenBatch", "TokenObjective", "token_objective"]


class SFT(TokenObjective):
    """L = -sum_t w_t * logp_t over the samples' trained tokens (`loss_mask`), aggregated like the policy loss;
    stats: `nll`, the token sum of -logp."""

    name = "sft"
    loss_metric = "sft_loss"
    stat_keys = ("nll",)

    @classmethod
    def from_settings(cls, settings: TrainerSettings) -> SFT:
        return cls()

    def reported(self) -> tuple[str, ...]:
        return ("nll", "entropy")

    def loss(self, batch: TokenBatch) -> tuple[Tensor, dict[str, Tensor]]:
        return sft_loss(batch.logprobs_R, batch.weights_R, batch.mask_R)


class PolicyGradient(TokenObjective):
    """PPO-clip / GRPO: L = sum_t w_t * (rho_t * pg_t + kl_coef * KL_t - entropy_coeff * H_t) (module docstring;
    pg_t, KL_t and the clip statistics in `loss.py`). `epochs` passes over the same old logprobs: from the second
    optimizer step on the ratio leaves 1 and the clip acts."""

    name = "policy"
    loss_metric = "policy_loss"
    stat_keys = ("clip_fraction", "clip_fraction_lower", "approx_kl_old", "ratio_mean", "kl_ref", "logprob_abs_diff",
                 "logprob_abs_diff_max", "kl_engine_trainer_k3", "is_weight_mean")
    max_stats = ("logprob_abs_diff_max",)
    # A token with advantage 0 is never clipped: skipped tokens count as unclipped, exactly.
    weighted_metrics = ("clip_fraction", "clip_fraction_lower")
    checks_mismatch = True

    def __init__(self, clip_low: float, clip_high: float, clip_c: float = 3.0, loss_mode: str = "vanilla",
                 kl_coef: float | None = None, kl_kind: str = "k3", entropy_coeff: float = 0.0,
                 rollout_is_cap: float | None = None, epochs: int = 1, recompute_old_logprobs: bool = False,
                 teacher_topk: int = 0, topk_coef: float = 0.0):
        self.clip_low, self.clip_high, self.clip_c, self.loss_mode = clip_low, clip_high, clip_c, loss_mode
        self.kl_coef, self.kl_kind = kl_coef, kl_kind  # kl_coef None: no KL term, no reference forward
        self.entropy_coeff = entropy_coeff
        self.rollout_is_cap = rollout_is_cap
        self.epochs = epochs
        self.recomputes_old_logprobs = recompute_old_logprobs
        self.needs_reference = kl_coef is not None
        self.entropy_grad = entropy_coeff > 0
        # The top-k term trains tokens whatever their advantage (0 when the teacher agrees with the sample).
        self.teacher_topk, self.topk_coef = (teacher_topk, topk_coef) if topk_coef > 0 else (0, 0.0)
        if self.teacher_topk:
            self.stat_keys = (*self.stat_keys, "distill_topk_kl")
        self.trains_zero_advantage = self.needs_reference or entropy_coeff > 0 or self.teacher_topk > 0

    @classmethod
    def from_settings(cls, s: TrainerSettings) -> PolicyGradient:
        return cls(s.clip_ratio_low, s.clip_ratio_high, s.clip_ratio_c, s.loss_mode,
                   s.kl_loss_coef if s.use_kl_loss else None, s.kl_loss_type, s.entropy_coeff, s.rollout_is_cap,
                   s.ppo_epochs, s.old_logprobs == "trainer", s.distill_topk, s.distill_topk_coef)

    def reported(self) -> tuple[str, ...]:
        names = ("clip_fraction", "clip_fraction_lower", "approx_kl_old", "ratio_mean")
        names += ("kl_ref", "entropy") if self.needs_reference else ("entropy",)
        return (names + (("is_weight_mean",) if self.rollout_is_cap is not None else ())
                + (("distill_topk_kl",) if self.teacher_topk else ()))

    def loss(self, batch: TokenBatch) -> tuple[Tensor, dict[str, Tensor]]:
        is_w_R = None
        if self.rollout_is_cap is not None:
            engine_R = torch.tensor([x for s in batch.samples for x in s.engine_logprobs],
                                    device=batch.logprobs_R.device, dtype=torch.float32)
            is_w_R = truncated_is_weights(batch.old_logprobs_R, engine_R, self.rollout_is_cap)
        loss, stats = policy_loss(
            batch.logprobs_R, batch.old_logprobs_R, batch.advantages_R, batch.weights_R, self.clip_low,
            self.clip_high, self.clip_c, ref_logprobs_R=batch.ref_logprobs_R, kl_coef=self.kl_coef or 0.0,
            kl_kind=self.kl_kind, mask_R=batch.mask_R, loss_mode=self.loss_mode, seq_index_R=batch.seq_index_R,
            entropy_R=batch.entropy_R, entropy_coeff=self.entropy_coeff, is_weights_R=is_w_R,
        )
        if self.teacher_topk and batch.topk_student_R_K is not None:
            topk_loss, stats["distill_topk_kl"] = topk_kl_loss(batch.topk_student_R_K, batch.topk_teacher_R_K,
                                                               batch.weights_R, batch.mask_R)
            loss = loss + self.topk_coef * topk_loss
        return loss, stats


# Objectives by name (the catalog's `objective`), built by `token_objective`.
TOKEN_OBJECTIVES: dict[str, type] = {"policy": PolicyGradient, "sft": SFT, "dpo": DPO, "orpo": ORPO}


def token_objective(objective: str | TokenObjective, settings: TrainerSettings) -> TokenObjective:
    """The objective itself, or the one a name stands for, configured by `settings`."""
    if isinstance(objective, TokenObjective):
        return objective
    if objective not in TOKEN_OBJECTIVES:
        raise ValueError(f"unknown objective {objective!r}; available: {', '.join(TOKEN_OBJECTIVES)}")
    return TOKEN_OBJECTIVES[objective].from_settings(settings)
