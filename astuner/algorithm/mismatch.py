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
"""

from __future__ import annotations

import torch
from torch import Tensor


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
