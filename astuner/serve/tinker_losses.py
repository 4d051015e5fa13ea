"""The Tinker API's built-in losses as trainer objectives: per-token inputs from each datum, plain token sums.

A datum is a token sequence x_0..x_{N-1} and per-position inputs of length N, position i predicting target y_i
(= x_{i+1}; the last target is the token after the input). It becomes a `Sample` with prompt [x_0] and response
y_0..y_{N-1}, so the trainer's response logprobs are exactly logp_i = log pi(y_i | x_0..x_i).
With q_i the sampling logprob (`logprobs`), A_i the advantage, w_i the weight and r_i = exp(logp_i - q_i):

    cross_entropy        L = -sum_i w_i * logp_i
    importance_sampling  L = -sum_i r_i * A_i
    ppo                  L = -sum_i min(r_i * A_i, clip(r_i, lo, hi) * A_i)      lo, hi = 0.8, 1.2 by default
    cispo                L = -sum_i sg(clip(r_i, lo, hi)) * logp_i * A_i          lo, hi = 0.8, 1.2 by default
    dro                  L = -sum_i (logp_i * A_i - beta / 2 * (logp_i - q_i)^2)  beta = 0.05 by default
    gspo                 L = -sum_i m_i * min(s_i * A_i, clip(s_i, lo, hi) * A_i)  lo, hi = 1 - 3e-4, 1 + 4e-4
                         s = exp(sum_i m_i (logp_i - q_i) / sum_i m_i), one per datum (the sequence's ratio, its
                         log the mean of the token log-ratios), and s_i = sg(s) * exp(logp_i - sg(logp_i)): its value
                         s, its gradient s * grad logp_i (GSPO-token). m_i: `sequence_ratio_mask` when the datum
                         gives it, else 1 where A_i != 0 (the sampled tokens)

DRO and GSPO are as the Tinker API documents them (DRO: the quadratic penalty of Richemond et al.; GSPO: Zheng et
al. 2025, whose paper sets the clip range to 3e-4 and 4e-4). Sums, not means: a batch's loss and gradient are the sums of its data's, whatever the micro-batching
(`Trainer.forward_backward` splits by token budget and accumulates). The sum is reported as `loss:sum`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, ClassVar

import torch
from torch import Tensor

from astuner.algorithm.objective_base import TokenBatch, TokenObjective
from astuner.types import Sample


def cross_entropy(logp_R: Tensor, weights_R: Tensor) -> Tensor:
    return -(weights_R * logp_R).sum()


def importance_sampling(logp_R: Tensor, q_R: Tensor, adv_R: Tensor) -> Tensor:
    return -(torch.exp(logp_R - q_R) * adv_R).sum()


def ppo(logp_R: Tensor, q_R: Tensor, adv_R: Tensor, lo: float, hi: float) -> Tensor:
    ratio_R = torch.exp(logp_R - q_R)
    return -torch.minimum(ratio_R * adv_R, torch.clamp(ratio_R, lo, hi) * adv_R).sum()


def cispo(logp_R: Tensor, q_R: Tensor, adv_R: Tensor, lo: float, hi: float) -> Tensor:
    ratio_R = torch.clamp(torch.exp(logp_R - q_R), lo, hi).detach()
    return -(ratio_R * logp_R * adv_R).sum()


def dro(logp_R: Tensor, q_R: Tensor, adv_R: Tensor, beta: float) -> Tensor:
    return -(logp_R * adv_R - 0.5 * beta * (logp_R - q_R) ** 2).sum()


def gspo(logp_R: Tensor, q_R: Tensor, adv_R: Tensor, mask_R: Tensor, seq_R: Tensor, lo: float, hi: float) -> Tensor:
    """seq_R: the datum each token belongs to (0..B-1)."""
    count = int(seq_R.max()) + 1 if seq_R.numel() else 0
    zeros_B = torch.zeros(count, dtype=logp_R.dtype, device=logp_R.device)
    log_ratio_B = zeros_B.index_add(0, seq_R, ((logp_R - q_R) * mask_R).detach()) / \
        zeros_B.index_add(0, seq_R, mask_R).clamp_min(1.0)
    s_R = torch.exp(log_ratio_B)[seq_R] * torch.exp(logp_R - logp_R.detach())
    return -(mask_R * torch.minimum(s_R * adv_R, torch.clamp(s_R, lo, hi) * adv_R)).sum()


@dataclass
class TinkerDatum:
    """One datum as the trainer takes it: its sample and its per-position inputs (each of the response's length)."""

    sample: Sample
    inputs: dict[str, list[float]]


class _Inputs:
    """A micro-batch's per-token inputs by name (flat R tensors in the batch's token order)."""

    def __init__(self, batch: TokenBatch, inputs: dict[int, dict[str, list[float]]]):
        self.batch, self._inputs = batch, inputs

    def __call__(self, key: str) -> Tensor:
        values = [x for s in self.batch.samples for x in self._of(s, key)]
        return torch.tensor(values, dtype=self.batch.logprobs_R.dtype, device=self.batch.logprobs_R.device)

    def _of(self, sample: Sample, key: str) -> list[float]:
        inputs = self._inputs[id(sample)]
        if key == "sequence_ratio_mask" and key not in inputs:  # the sampled tokens: those with an advantage
            return [float(a != 0) for a in inputs["advantages"]]
        return inputs[key]


_CLIP = ("clip_low_threshold", "clip_high_threshold")


@dataclass(frozen=True)
class LossKind:
    """One built-in loss: the per-token inputs it reads (besides target_tokens) and may read, the loss_fn_config
    keys it takes with their defaults, and L(logp_R, inputs, config), the module docstring's formula."""

    inputs: tuple[str, ...]
    fn: Callable
    config: dict[str, float] = field(default_factory=dict)  # its loss_fn_config keys and their defaults
    optional: tuple[str, ...] = ()


LOSSES = {
    "cross_entropy": LossKind(("weights",), lambda lp, x, c: cross_entropy(lp, x("weights"))),
    "importance_sampling": LossKind(("logprobs", "advantages"),
                                    lambda lp, x, c: importance_sampling(lp, x("logprobs"), x("advantages"))),
    "ppo": LossKind(("logprobs", "advantages"),
                    lambda lp, x, c: ppo(lp, x("logprobs"), x("advantages"), *(c[k] for k in _CLIP)),
                    dict(zip(_CLIP, (0.8, 1.2)))),
    "cispo": LossKind(("logprobs", "advantages"),
                      lambda lp, x, c: cispo(lp, x("logprobs"), x("advantages"), *(c[k] for k in _CLIP)),
                      dict(zip(_CLIP, (0.8, 1.2)))),
    "dro": LossKind(("logprobs", "advantages"), lambda lp, x, c: dro(lp, x("logprobs"), x("advantages"), c["beta"]),
                    {"beta": 0.05}),
    "gspo": LossKind(("logprobs", "advantages"),
                     lambda lp, x, c: gspo(lp, x("logprobs"), x("advantages"), x("sequence_ratio_mask"),
                                           x.batch.seq_index_R, *(c[k] for k in _CLIP)),
                     dict(zip(_CLIP, (1 - 3e-4, 1 + 4e-4))), optional=("sequence_ratio_mask",)),
}


# Known to the Tinker API and refused here, with why (the error says it).
_SERVED = ", ".join(LOSSES)
REFUSED = {"stable_reinforce": "its objective is not published (an alpha of the Tinker service that needs sampling "
                               f"records it keeps); astuner serve serves {_SERVED}",
           "custom": "server-side custom losses are not served; forward_backward_custom works (it sends "
                     f"cross_entropy); the built-in losses are {_SERVED}"}


class TinkerLoss(TokenObjective):
    """One of the built-in losses over a batch of data (`TinkerDatum`); per-token inputs are looked up by sample."""

    name: ClassVar[str] = "tinker"
    loss_metric: ClassVar[str] = "loss:sum"
    entropy_metric = False  # not reported by the API: the forward skips it

    def __init__(self, loss_fn: str, data: list[TinkerDatum], config: dict[str, float] | None = None):
        self.loss_fn = loss_fn
        self.config = {**LOSSES[loss_fn].config, **{k: float(v) for k, v in (config or {}).items()}}
        self._inputs = {id(d.sample): d.inputs for d in data}

    def forwards(self, sample: Sample, weight: float) -> bool:
        return True  # every datum's logprobs are returned, even one whose loss is 0

    def loss(self, batch: TokenBatch) -> tuple[Tensor, dict[str, Tensor]]:
        return LOSSES[self.loss_fn].fn(batch.logprobs_R, _Inputs(batch, self._inputs), self.config), {}
