"""The Tinker API's built-in losses as trainer objectives: per-token inputs from each datum, plain token sums.

A datum is a token sequence x_0..x_{N-1} and per-position inputs of length N, position i predicting target y_i
(= x_{i+1}; the last target is the token after the input). It becomes a `Sample` with prompt [x_0] and response
y_0..y_{N-1}, so the trainer's response logprobs are exactly logp_i = log pi(y_i | x_0..x_i).
With q_i the sampling logprob (`logprobs`), A_i the advantage, w_i the weight and r_i = exp(logp_i - q_i):

    cross_entropy        L = -sum_i w_i * logp_i
    importance_sampling  L = -sum_i r_i * A_i
    ppo                  L = -sum_i min(r_i * A_i, clip(r_i, lo, hi) * A_i)      lo, hi = 0.8, 1.2 by default
    cispo                L = -sum_i sg(clip(r_i, lo, hi)) * logp_i * A_i          lo, hi = 0.8, 1.2 by default

Sums, not means: a batch's loss and gradient are the sums of its data's, whatever the micro-batching
(`Trainer.forward_backward` splits by token budget and accumulates). The sum is reported as `loss:sum`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from astuner.algorithm.objective_base import TokenBatch, TokenObjective
from astuner.types import Sample

# loss_fn -> the per-token inputs it reads (besides target_tokens), and the loss_fn_config keys it accepts.
INPUTS = {
    "cross_entropy": ("weights",),
    "importance_sampling": ("logprobs", "advantages"),
    "ppo": ("logprobs", "advantages"),
    "cispo": ("logprobs", "advantages"),
}
CONFIG_KEYS = {"ppo": ("clip_low_threshold", "clip_high_threshold"),
               "cispo": ("clip_low_threshold", "clip_high_threshold")}
# Known to the Tinker API and refused here, with why (the error says it).
_USE = "not implemented by astuner serve; use importance_sampling, ppo or cispo"
REFUSED = {"dro": _USE, "gspo": _USE, "stable_reinforce": _USE,
           "custom": "server-side custom losses are not served; forward_backward_custom works (it sends cross_entropy)"}


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


@dataclass
class TinkerDatum:
    """One datum as the trainer takes it: its sample and its per-position inputs (each of the response's length)."""

    sample: Sample
    inputs: dict[str, list[float]]


class TinkerLoss(TokenObjective):
    """One of the built-in losses over a batch of data (`TinkerDatum`); per-token inputs are looked up by sample."""

    name: ClassVar[str] = "tinker"
    loss_metric: ClassVar[str] = "loss:sum"
    entropy_metric = False  # not reported by the API: the forward skips it

    def __init__(self, loss_fn: str, data: list[TinkerDatum], config: dict[str, float] | None = None):
        config = dict(config or {})
        self.loss_fn = loss_fn
        self.lo = float(config.get("clip_low_threshold", 0.8))
        self.hi = float(config.get("clip_high_threshold", 1.2))
        self._inputs = {id(d.sample): d.inputs for d in data}

    def forwards(self, sample: Sample, weight: float) -> bool:
        return True  # every datum's logprobs are returned, even one whose loss is 0

    def _per_token(self, batch: TokenBatch, key: str) -> Tensor:
        values = [x for s in batch.samples for x in self._inputs[id(s)][key]]
        return torch.tensor(values, dtype=batch.logprobs_R.dtype, device=batch.logprobs_R.device)

    def loss(self, batch: TokenBatch) -> tuple[Tensor, dict[str, Tensor]]:
        logp_R = batch.logprobs_R
        if self.loss_fn == "cross_entropy":
            return cross_entropy(logp_R, self._per_token(batch, "weights")), {}
        q_R, adv_R = self._per_token(batch, "logprobs"), self._per_token(batch, "advantages")
        if self.loss_fn == "importance_sampling":
            return importance_sampling(logp_R, q_R, adv_R), {}
        return LOSSES[self.loss_fn](logp_R, q_R, adv_R, self.lo, self.hi), {}


LOSSES = {"ppo": ppo, "cispo": cispo}
