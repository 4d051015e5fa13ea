"""The policy loss: PPO-clip with asymmetric clip range, optional KL to a reference, episode-fair aggregation.

Per response token t of sample s (logp = log pi_theta, old = the engine's sampling logprob, A = advantage):

    ratio_t = exp(logp_t - old_t)
    pg_t    = max( -A * ratio_t,  -A * clip(ratio_t, 1 - clip_low, 1 + clip_high) )
    kl_t    = logp_t - ref_t                                   (k1)
            = exp(ref_t - logp_t) - (ref_t - logp_t) - 1       (k3, >= 0)
    l_t     = pg_t + kl_coef * kl_t                            (KL term only when a reference is given)

    L = sum over tokens of  w_s * l_t

Token weights w_s (one per sample, shared by its tokens). With E episodes in the batch, S_e samples in episode e,
T_s response tokens of sample s and T_e = sum of T_s over e's samples:

    token-mean               w_s = 1 / (E * T_e)              token mean inside an episode, mean over episodes
    seq-mean-token-mean      w_s = 1 / (E * S_e * T_s)        token mean inside a call, mean over calls, episodes
    seq-mean-token-sum-norm  w_s = 1 / (E * S_e * norm_length)  token sum / constant (Dr. GRPO), norm_length =
                                                                rollout.max_response_length_in_one_turn

so every episode weighs the same (its weights sum to 1/E in the first two modes) however many calls or tokens it
made. Samples with no response token get weight 0 and do not count in S_e.

Because the weights are computed once for the whole (mini-)batch, L is a plain sum over tokens: splitting the
tokens into micro-batches and summing the micro-batch losses (i.e. accumulating their gradients) gives exactly
the full-batch loss and gradient.

Statistics (token means over the tokens given, detached):
    clip_fraction  share of tokens where the clipped term wins the max and differs from the unclipped one
    approx_kl_old  mean of ratio - 1 - log(ratio): the k3 estimate of KL(pi_old || pi_theta)
    kl_ref         mean of kl_t (only with a reference)
    ratio_mean     mean of ratio_t
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

# --- aggregation (token weights) ---------------------------------------------------------------------------


def _w_token_mean(T_s: int, S_e: int, T_e: int, norm_length: int) -> float:
    return 1.0 / T_e


def _w_seq_mean_token_mean(T_s: int, S_e: int, T_e: int, norm_length: int) -> float:
    return 1.0 / (S_e * T_s)


def _w_seq_mean_token_sum_norm(T_s: int, S_e: int, T_e: int, norm_length: int) -> float:
    return 1.0 / (S_e * norm_length)


# mode -> weight of one sample's tokens before the 1/E factor.
LOSS_AGG_MODES: dict[str, Callable[[int, int, int, int], float]] = {
    "token-mean": _w_token_mean,
    "seq-mean-token-mean": _w_seq_mean_token_mean,
    "seq-mean-token-sum-norm": _w_seq_mean_token_sum_norm,
}


def token_weights(response_lengths_B: list[int], episode_uids_B: list[str], mode: str, norm_length: int) -> list[float]:
    """One weight per sample, applied to each of its response tokens (formulas in the module docstring)."""
    if mode not in LOSS_AGG_MODES:
        raise ValueError(f"unknown loss_agg_mode {mode!r}; available: {', '.join(LOSS_AGG_MODES)}")
    if len(response_lengths_B) != len(episode_uids_B):
        raise ValueError(f"{len(response_lengths_B)} lengths but {len(episode_uids_B)} episode uids")
    if mode == "seq-mean-token-sum-norm" and norm_length <= 0:
        raise ValueError(f"norm_length must be > 0, got {norm_length}")
    weight_fn = LOSS_AGG_MODES[mode]

    samples_per_episode: dict[str, int] = {}
    tokens_per_episode: dict[str, int] = {}
    for T_s, uid in zip(response_lengths_B, episode_uids_B):
        if T_s > 0:
            samples_per_episode[uid] = samples_per_episode.get(uid, 0) + 1
            tokens_per_episode[uid] = tokens_per_episode.get(uid, 0) + T_s
    E = len(samples_per_episode)

    weights_B = []
    for T_s, uid in zip(response_lengths_B, episode_uids_B):
        if T_s <= 0:
            weights_B.append(0.0)
        else:
            weights_B.append(weight_fn(T_s, samples_per_episode[uid], tokens_per_episode[uid], norm_length) / E)
    return weights_B


# --- KL estimators -----------------------------------------------------------------------------------------


def _kl_k1(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    return logprobs - ref_logprobs


def _kl_k3(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    log_r = ref_logprobs - logprobs
    return torch.exp(log_r) - log_r - 1.0


KL_ESTIMATORS: dict[str, Callable[[Tensor, Tensor], Tensor]] = {"k1": _kl_k1, "k3": _kl_k3}


def kl_penalty(logprobs: Tensor, ref_logprobs: Tensor, kind: str) -> Tensor:
    """Per-token KL estimate of KL(pi || ref) from tokens sampled by pi (formulas in the module docstring)."""
    try:
        fn = KL_ESTIMATORS[kind]
    except KeyError:
        raise ValueError(f"unknown kl_loss_type {kind!r}; available: {', '.join(KL_ESTIMATORS)}") from None
    return fn(logprobs, ref_logprobs)


# --- policy loss -------------------------------------------------------------------------------------------


def policy_loss(
    logprobs_R: Tensor,
    old_logprobs_R: Tensor,
    advantages_R: Tensor,
    weights_R: Tensor,
    clip_low: float,
    clip_high: float,
    ref_logprobs_R: Tensor | None = None,
    kl_coef: float = 0.0,
    kl_kind: str = "k3",
) -> tuple[Tensor, dict[str, Tensor]]:
    """Weighted PPO-clip loss over flattened response tokens R; returns (scalar loss, detached token-mean stats)."""
    log_ratio_R = logprobs_R - old_logprobs_R
    ratio_R = torch.exp(log_ratio_R)
    pg_unclipped_R = -advantages_R * ratio_R
    pg_clipped_R = -advantages_R * torch.clamp(ratio_R, 1.0 - clip_low, 1.0 + clip_high)
    token_loss_R = torch.maximum(pg_unclipped_R, pg_clipped_R)

    stats: dict[str, Tensor] = {}
    if ref_logprobs_R is not None:
        kl_R = kl_penalty(logprobs_R, ref_logprobs_R, kl_kind)
        token_loss_R = token_loss_R + kl_coef * kl_R
        stats["kl_ref"] = kl_R.detach().mean()

    loss = (weights_R * token_loss_R).sum()
    with torch.no_grad():
        stats["clip_fraction"] = (pg_clipped_R > pg_unclipped_R).float().mean()
        stats["approx_kl_old"] = (ratio_R - 1.0 - log_ratio_R).mean()
        stats["ratio_mean"] = ratio_R.mean()
    return loss, stats
