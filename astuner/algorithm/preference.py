"""Preference losses on (chosen, rejected) pairs: DPO and ORPO, as objectives (`algorithm.type: dpo | orpo`).

Per pair p, with S(y) = sum over y's trained (assistant) tokens of log pi(token | prefix), and
M(y) = S(y) / |y| its per-token mean:

DPO (Rafailov et al. 2023; TRL's DPOTrainer with loss_type "sigmoid"), pi_ref = the frozen initial model:

    margin_p = beta * [ (S_pi(chosen) - S_ref(chosen)) - (S_pi(rejected) - S_ref(rejected)) ]
    loss_p   = -log sigmoid(margin_p)
    rewards/chosen_p = beta * (S_pi(chosen) - S_ref(chosen)), likewise rewards/rejected_p

ORPO (Hong et al. 2024; TRL's ORPOTrainer, beta = the paper's lambda), no reference model:

    log_odds(y) = M(y) - log(1 - exp(M(y)))
    loss_p      = NLL_p - beta * log sigmoid( log_odds(chosen) - log_odds(rejected) )
    NLL_p       = -S_pi(chosen) / T_chosen            (T_chosen = chosen tokens of the whole batch, so the NLL
                                                        term summed over pairs is the batch's token-mean NLL)

The batch loss is L = sum_p NLL_p (ORPO only) + (1 / P) * sum_p [the rest of loss_p], over the batch's P pairs.
Every function returns each pair's contribution to L, so summing contributions over micro-batches of pairs
(accumulating their gradients) gives exactly the batch's loss and gradient.
"""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor

from astuner.algorithm.objective_base import TokenBatch, TokenObjective
from astuner.types import Sample


def dpo_loss(pi_chosen_P: Tensor, pi_rejected_P: Tensor, ref_chosen_P: Tensor, ref_rejected_P: Tensor,
             beta: float, num_pairs: int, **_) -> tuple[Tensor, dict[str, Tensor]]:
    """Each pair's contribution loss_p / P to the batch's DPO loss, and per-pair stats (module docstring)."""
    chosen_reward_P = beta * (pi_chosen_P - ref_chosen_P)
    rejected_reward_P = beta * (pi_rejected_P - ref_rejected_P)
    margin_P = chosen_reward_P - rejected_reward_P
    loss_P = -F.logsigmoid(margin_P) / num_pairs
    stats = {"rewards/chosen": chosen_reward_P.detach(), "rewards/rejected": rejected_reward_P.detach(),
             "rewards/margin": margin_P.detach(), "rewards/accuracy": (margin_P.detach() > 0).float()}
    return loss_P, stats


def orpo_loss(pi_chosen_P: Tensor, pi_rejected_P: Tensor, chosen_len_P: Tensor, rejected_len_P: Tensor,
              beta: float, num_pairs: int, chosen_tokens_total: float, **_) -> tuple[Tensor, dict[str, Tensor]]:
    """Each pair's contribution to the batch's ORPO loss, and per-pair stats (module docstring)."""
    mean_chosen_P = pi_chosen_P / chosen_len_P
    mean_rejected_P = pi_rejected_P / rejected_len_P
    # log(1 - exp(m)) for m < 0; clamped so that a sequence of near-certain tokens does not give -inf.
    log_odds_P = (mean_chosen_P - mean_rejected_P) - (
        torch.log1p(-torch.exp(mean_chosen_P).clamp(max=1 - 1e-6))
        - torch.log1p(-torch.exp(mean_rejected_P).clamp(max=1 - 1e-6)))
    ratio_P = F.logsigmoid(log_odds_P)
    nll_P = -pi_chosen_P / chosen_tokens_total
    loss_P = nll_P - beta * ratio_P / num_pairs
    stats = {"nll": nll_P.detach() * num_pairs, "log_odds_ratio": log_odds_P.detach(),
             "rewards/accuracy": (log_odds_P.detach() > 0).float()}
    return loss_P, stats


class PairObjective(TokenObjective):
    """A loss over (chosen, rejected) sequence pairs, weighted by `beta`, trained by `Trainer.forward_backward`
    like every objective. Its samples come as one list: the P chosen sequences, then the P rejected ones in the
    same order (`pair_samples`), so sample i and sample i + P form pair i; a micro-batch always holds both sides
    of its pairs, chosen first (`Trainer.micro_batches(paired=True)`). `bound` fixes the counts of the
    mini-batch the formulas divide by (P, T_chosen), so micro-batch losses sum to the mini-batch's."""

    loss_metric = "loss"
    paired = True
    entropy_metric = False
    pair_formula: ClassVar  # dpo_loss or orpo_loss

    def __init__(self, beta: float, num_pairs: int = 0, chosen_tokens_total: float = 0.0) -> None:
        self.beta, self.num_pairs, self.chosen_tokens_total = beta, num_pairs, chosen_tokens_total

    @classmethod
    def from_settings(cls, settings) -> PairObjective:
        return cls(settings.beta)

    def bound(self, samples: list[Sample]) -> PairObjective:
        half = len(samples) // 2
        return type(self)(self.beta, half, float(sum(s.num_trained_tokens for s in samples[:half])))

    def forwards(self, sample: Sample, weight: float) -> bool:
        return True  # every side of every pair: dropping one would unpair the rest

    def reported(self) -> tuple[str, ...]:
        return self.stat_keys

    def mean_over(self, key: str, tally) -> float:
        return tally.forwarded_samples / 2  # every stat is a mean over pairs

    def loss(self, batch: TokenBatch) -> tuple[Tensor, dict[str, Tensor]]:
        if self.num_pairs == 0:
            raise ValueError(f"{self.name}: the objective was not bound to its mini-batch (PairObjective.bound)")
        sums_B, lens_B = sequence_sums(batch.logprobs_R, batch.mask_R, batch.seq_index_R, len(batch.samples))
        ref_B = torch.zeros_like(sums_B)
        if batch.ref_logprobs_R is not None:
            ref_B, _ = sequence_sums(batch.ref_logprobs_R, batch.mask_R, batch.seq_index_R, len(batch.samples))
        n = len(batch.samples) // 2
        contrib_P, stats = type(self).pair_formula(
            sums_B[:n], sums_B[n:], ref_chosen_P=ref_B[:n], ref_rejected_P=ref_B[n:], chosen_len_P=lens_B[:n],
            rejected_len_P=lens_B[n:], beta=self.beta, num_pairs=self.num_pairs,
            chosen_tokens_total=self.chosen_tokens_total)
        return contrib_P.sum(), {k: v.sum() for k, v in stats.items()}


def sequence_sums(logprobs_R: Tensor, mask_R: Tensor, seq_index_R: Tensor, num_samples: int
                  ) -> tuple[Tensor, Tensor]:
    """(S(y): the sum of the trained tokens' logprobs, the trained-token count) per sample."""
    zeros = torch.zeros(num_samples, device=logprobs_R.device, dtype=logprobs_R.dtype)
    return zeros.index_add(0, seq_index_R, logprobs_R * mask_R), zeros.index_add(0, seq_index_R, mask_R)


class DPO(PairObjective):
    """loss_p = -log sigmoid(beta * [(S_pi(c) - S_ref(c)) - (S_pi(r) - S_ref(r))]), mean over pairs."""

    name = "dpo"
    needs_reference = True
    stat_keys = ("rewards/chosen", "rewards/rejected", "rewards/margin", "rewards/accuracy")
    pair_formula = staticmethod(dpo_loss)


class ORPO(PairObjective):
    """loss_p = NLL_p - beta * log sigmoid(log_odds(chosen) - log_odds(rejected)) / P; no reference model."""

    name = "orpo"
    stat_keys = ("nll", "log_odds_ratio", "rewards/accuracy")
    pair_formula = staticmethod(orpo_loss)


def pair_samples(pairs: list, uid: str = "pair") -> list[Sample]:
    """The samples of `pairs` (task_reader/offline_data.py's `Pair`s) in a pair objective's order: every chosen,
    then every rejected."""
    return ([p.chosen.as_sample(f"{uid}{i}/chosen") for i, p in enumerate(pairs)]
            + [p.rejected.as_sample(f"{uid}{i}/rejected") for i, p in enumerate(pairs)])
