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

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor


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


@dataclass(frozen=True)
class PairObjective:
    """A loss over (chosen, rejected) sequence pairs, weighted by `beta`; `loss` is its formula's function."""

    beta: float
    name: ClassVar[str]
    needs_reference: ClassVar[bool]
    loss: ClassVar

    def pair_loss(self, pi_chosen_P: Tensor, pi_rejected_P: Tensor, **context) -> tuple[Tensor, dict[str, Tensor]]:
        """Each pair's contribution to the batch loss; `context`: the reference sums, lengths and counts."""
        return type(self).loss(pi_chosen_P, pi_rejected_P, beta=self.beta, **context)


@dataclass(frozen=True)
class DPO(PairObjective):
    """loss_p = -log sigmoid(beta * [(S_pi(c) - S_ref(c)) - (S_pi(r) - S_ref(r))]), mean over pairs."""

    name: ClassVar[str] = "dpo"
    needs_reference: ClassVar[bool] = True
    loss: ClassVar = dpo_loss


@dataclass(frozen=True)
class ORPO(PairObjective):
    """loss_p = NLL_p - beta * log sigmoid(log_odds(chosen) - log_odds(rejected)) / P; no reference model."""

    name: ClassVar[str] = "orpo"
    needs_reference: ClassVar[bool] = False
    loss: ClassVar = orpo_loss


# algorithm.type -> objective class (built from algorithm.beta)
PREFERENCE_OBJECTIVES: dict[str, type[PairObjective]] = {"dpo": DPO, "orpo": ORPO}
