"""Train-inference mismatch: how far the engine's sampling distribution is from the trainer's, and the
truncated importance-sampling correction for it.

For the trained tokens t of a step (mask 1), e_t = the engine's logprob of the sampled token (what the rollout
recorded), p_t = the trainer's logprob of the same token under the same weights, d_t = p_t - e_t:

    logprob_abs_diff_mean = mean_t |d_t|,   logprob_abs_diff_max = max_t |d_t|
    kl_engine_trainer_k3  = mean_t (exp(d_t) - 1 - d_t)        k3 estimate of KL(engine || trainer) from tokens
                                                                 the engine sampled (unbiased, >= 0)

With `trainer_common.old_logprobs: trainer` the PPO ratio is taken against p_t (recomputed before the first
update) instead of e_t, and `rollout_is_cap` C adds truncated importance sampling (TIS) on the engine/trainer
ratio, a detached per-token weight on the policy-gradient term:

    w_t = min(exp(p_t - e_t), C)            pg_t <- w_t * pg_t

so tokens the engine sampled more often than the trainer would are down-weighted, and no token weighs more
than C. Off by default: on CPU in fp32 the two agree to ~1e-6 and w_t = 1. Pure torch, no state.

By context depth: the same |d_t| binned by the token's position in its sequence (prompt tokens + its index in
the response), bins 0-1k, 1k-4k, 4k-16k and 16k+ tokens:

    logprob_abs_diff/depth_<bin> = sum_{t in bin} |d_t| / tokens in bin        (a bin with no token: absent)

A numeric defect that grows with position (rounded RoPE buffers, a cache kept in a coarser dtype) leaves the
shallow bin clean and the deep ones off. Rounding alone grows too, like a random walk over attention's sums: about
sqrt(depth), so 2x per bin at most (the bins are 4x apart). A bin d bins deeper than the shallowest one with tokens
alarms (`depth_alarm`) when its gap is over both the dtype's bound, DEPTH_C * eps(dtype) (fp32 9.5e-7, bf16
0.0625), and DEPTH_DRIFT * 2^(d-1) times the shallowest bin's gap: twice what rounding alone could do.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import Tensor

if TYPE_CHECKING:
    from astuner.types import Sample

DEPTH_EDGES = (1024, 4096, 16384)  # a token at position p falls in the bin after the edges <= p
DEPTH_BINS = ("0-1k", "1k-4k", "4k-16k", "16k+")
DEPTH_C = 8.0
DEPTH_DRIFT = 4.0
EPS = {"fp32": 2.0**-23, "bf16": 2.0**-7, "fp16": 2.0**-10}


def mismatch_sums(trainer_R: Tensor, engine_R: Tensor, mask_R: Tensor) -> dict[str, Tensor]:
    """Token sums (and the max) behind the formulas above; divide the sums by the trained-token count."""
    d_R = (trainer_R.detach() - engine_R).clamp(-20.0, 20.0)
    abs_R = d_R.abs() * mask_R
    return {
        "logprob_abs_diff": abs_R.sum(),
        "logprob_abs_diff_max": abs_R.max() if abs_R.numel() else abs_R.sum(),
        "kl_engine_trainer_k3": ((torch.exp(d_R) - 1.0 - d_R) * mask_R).sum(),
    }


def truncated_is_weights(trainer_R: Tensor, engine_R: Tensor, cap: float) -> Tensor:
    """w_t = min(exp(p_t - e_t), cap), detached."""
    return torch.exp((trainer_R.detach() - engine_R).clamp(-20.0, 20.0)).clamp(max=cap)


def depth_sums(samples: Sequence[Sample], trainer_logprobs: Sequence[list[float] | None]) -> dict[str, float]:
    """Per depth bin, the sum of |d_t| over trained tokens and their count ("depth_abs/<bin>", "depth_tokens/<bin>"),
    for the samples whose trainer logprobs are given (None: not forwarded here). Engine logprobs: each sample's
    `old_logprobs`, as the rollout recorded them."""
    pairs = [(s, t) for s, t in zip(samples, trainer_logprobs) if t is not None and s.response_ids]
    n_bins = len(DEPTH_BINS)
    abs_sum, tokens = torch.zeros(n_bins, dtype=torch.float64), torch.zeros(n_bins, dtype=torch.float64)
    if pairs:  # one pass over the step's tokens in torch: a Python loop per token would be a step's hot spot
        trainer_R = torch.tensor([x for _, t in pairs for x in t], dtype=torch.float64)
        engine_R = torch.tensor([x for s, _ in pairs for x in s.old_logprobs], dtype=torch.float64)
        mask_R = torch.tensor([m for s, _ in pairs for m in (s.loss_mask or [1] * len(s.response_ids))],
                              dtype=torch.float64)
        position_R = torch.cat([torch.arange(len(s.response_ids)) + len(s.prompt_ids) for s, _ in pairs])
        bin_R = torch.bucketize(position_R, torch.tensor(DEPTH_EDGES), right=True)
        abs_sum.index_add_(0, bin_R, (trainer_R - engine_R).abs().clamp(max=20.0) * mask_R)
        tokens.index_add_(0, bin_R, mask_R)
    return {**{f"depth_abs/{name}": abs_sum[i].item() for i, name in enumerate(DEPTH_BINS)},
            **{f"depth_tokens/{name}": tokens[i].item() for i, name in enumerate(DEPTH_BINS)}}


def depth_metrics(sums: dict[str, float]) -> dict[str, float]:
    """`logprob_abs_diff/depth_<bin>` from `depth_sums` (summed over workers), for bins holding tokens."""
    return {f"logprob_abs_diff/depth_{name}": sums[f"depth_abs/{name}"] / sums[f"depth_tokens/{name}"]
            for name in DEPTH_BINS if sums.get(f"depth_tokens/{name}", 0.0) > 0}


def depth_alarm(metrics: dict[str, float], precision: str) -> list[str]:
    """The deep bins of `depth_metrics` whose gap passes both bounds (module docstring)."""
    gaps = [(name, metrics[f"logprob_abs_diff/depth_{name}"]) for name in DEPTH_BINS
            if f"logprob_abs_diff/depth_{name}" in metrics]
    bound = DEPTH_C * EPS.get(precision, EPS["fp32"])
    if not gaps:
        return []
    first, shallow = DEPTH_BINS.index(gaps[0][0]), gaps[0][1]
    return [name for name, g in gaps[1:]
            if g > bound and g > DEPTH_DRIFT * 2 ** (DEPTH_BINS.index(name) - first - 1) * shallow]
