"""The policy loss: PPO-clip with asymmetric and dual clip, optional KL to a reference, four aggregation modes.

Per response token t of sample s (logp = log pi_theta, old = the engine's sampling logprob, A = advantage):

    log_ratio_t = clamp(logp_t - old_t, -20, 20)                   (as verl: exp never overflows)
    ratio_t     = exp(log_ratio_t)
    pg1_t       = -A * ratio_t
    pg2_t       = -A * clip(ratio_t, 1 - clip_low, 1 + clip_high)
    pg_t        = max(pg1_t, pg2_t)                                (PPO clip)
    pg_t        = min(pg_t, -A * clip_c)            if A < 0       (dual clip, verl's clip_ratio_c)
    kl_t        = logp_t - ref_t                                   (k1)
                = clamp(exp(d) - d - 1, -10, 10), d = clamp(ref_t - logp_t, -20, 20)   (k3, as verl)
    pg_t        = w_t * pg_t                                       (only with is_weights: truncated IS, mismatch.py)
    l_t         = pg_t + kl_coef * kl_t - entropy_coeff * H_t      (KL term only when a reference is given;
                                                                    H_t = entropy of pi_theta at t, with gradient)

With `loss_mode="gspo"` the ratio is the sequence-level one of `gspo.py` (no dual clip); the rest is unchanged.

    L = sum over tokens of  w_s * l_t

Token weights w_s (one per sample, shared by its tokens), over the samples of one mini-batch. N samples, E
episodes, S_e samples in episode e, T_s response tokens of sample s, T_e = sum of T_s over e's samples,
T = sum of all T_s:

    episode-mean-token-mean  w_s = 1 / (E * T_e)            token mean inside an episode, mean over episodes:
                                                             every episode weighs the same however many calls or
                                                             tokens it made (astuner's default, for multi-turn)
    token-mean               w_s = 1 / T                    verl/DAPO: every token of the mini-batch weighs the same
    seq-mean-token-mean      w_s = 1 / (N * T_s)            verl: token mean inside a sequence, mean over sequences
    seq-mean-token-sum-norm  w_s = 1 / (N * norm_length)    verl (Dr. GRPO): token sum / constant, mean over
                                                             sequences; norm_length = max_response_length_in_one_turn

For single-call episodes (N == E, T_e == T_s) the first mode equals seq-mean-token-mean. Samples with no response
token get weight 0 and count in none of N, E, S_e, T.

Because the weights are computed once for the whole mini-batch, L is a plain sum over tokens: splitting the
tokens into micro-batches and summing the micro-batch losses (i.e. accumulating their gradients) gives exactly
the full-batch loss and gradient.

Statistics (token sums over the tokens given, detached; the trainer divides by the tokens they cover):
    clip_fraction        tokens where pg2 > pg1 (the PPO clip is active)
    clip_fraction_lower  tokens with A < 0 where the dual clip is active (pg > -A * clip_c before capping)
    approx_kl_old        ratio - 1 - log(ratio) of the token ratio: the k3 estimate of KL(pi_old || pi_theta)
    kl_ref               kl_t (only with a reference)
    ratio_mean           ratio_t (with gspo: the sequence ratio, once per token)
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from astuner.algorithm.gspo import gspo_log_ratio
from astuner.algorithm.mismatch import mismatch_sums

# --- aggregation (token weights) ---------------------------------------------------------------------------

# mode -> weight of one sample's tokens: f(T_s, S_e, T_e, N, E, T, norm_length) (formulas in the module docstring).
LOSS_AGG_MODES: dict[str, Callable[..., float]] = {
    "episode-mean-token-mean": lambda T_s, S_e, T_e, N, E, T, norm: 1.0 / (E * T_e),
    "token-mean": lambda T_s, S_e, T_e, N, E, T, norm: 1.0 / T,
    "seq-mean-token-mean": lambda T_s, S_e, T_e, N, E, T, norm: 1.0 / (N * T_s),
    "seq-mean-token-sum-norm": lambda T_s, S_e, T_e, N, E, T, norm: 1.0 / (N * norm),
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
    N = sum(samples_per_episode.values())
    T = sum(tokens_per_episode.values())
    return [
        weight_fn(T_s, samples_per_episode[uid], tokens_per_episode[uid], N, E, T, norm_length) if T_s > 0 else 0.0
        for T_s, uid in zip(response_lengths_B, episode_uids_B)
    ]


# --- KL estimators -----------------------------------------------------------------------------------------


def _kl_k1(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    return logprobs - ref_logprobs


def _kl_k3(logprobs: Tensor, ref_logprobs: Tensor) -> Tensor:
    log_r = torch.clamp(ref_logprobs - logprobs, -20.0, 20.0)
    return torch.clamp(torch.exp(log_r) - log_r - 1.0, -10.0, 10.0)


KL_ESTIMATORS: dict[str, Callable[[Tensor, Tensor], Tensor]] = {"k1": _kl_k1, "k3": _kl_k3}


def kl_penalty(logprobs: Tensor, ref_logprobs: Tensor, kind: str) -> Tensor:
    """Per-token KL estimate of KL(pi || ref) from tokens sampled by pi (formulas in the module docstring)."""
    try:
        fn = KL_ESTIMATORS[kind]
    except KeyError:
        raise ValueError(f"unknown kl_loss_type {kind!r}; available: {', '.join(KL_ESTIMATORS)}") from None
    return fn(logprobs, ref_logprobs)


# --- policy loss -------------------------------------------------------------------------------------------

POLICY_LOSS_MODES = ("vanilla", "gspo")


def _log_ratio(logprobs_R: Tensor, old_logprobs_R: Tensor, loss_mode: str, seq_index_R: Tensor | None,
               m_R: Tensor) -> Tensor:
    """log(pi / pi_old) per token: the token's own (clamped to +-20), or gspo's sequence-level one."""
    if loss_mode == "gspo":
        if seq_index_R is None:
            raise ValueError("loss_mode gspo needs seq_index_R")
        return gspo_log_ratio(logprobs_R, old_logprobs_R, seq_index_R, m_R)
    if loss_mode == "vanilla":
        return torch.clamp(logprobs_R - old_logprobs_R, -20.0, 20.0)
    raise ValueError(f"unknown policy loss_mode {loss_mode!r}; available: {', '.join(POLICY_LOSS_MODES)}")


def policy_loss(
    logprobs_R: Tensor,
    old_logprobs_R: Tensor,
    advantages_R: Tensor,
    weights_R: Tensor,
    clip_low: float,
    clip_high: float,
    clip_c: float = 3.0,
    ref_logprobs_R: Tensor | None = None,
    kl_coef: float = 0.0,
    kl_kind: str = "k3",
    mask_R: Tensor | None = None,
    loss_mode: str = "vanilla",
    seq_index_R: Tensor | None = None,
    entropy_R: Tensor | None = None,
    entropy_coeff: float = 0.0,
    is_weights_R: Tensor | None = None,
) -> tuple[Tensor, dict[str, Tensor]]:
    """Weighted PPO-clip loss over flattened response tokens R; returns (scalar loss, detached token-sum stats).

    mask_R (1 = trained, 0 = a token the model did not sample, e.g. a tool result inside a merged sample) is
    already folded into weights_R by the caller; here it only keeps masked tokens out of the stats.
    seq_index_R (the sample each token belongs to) is needed by gspo; entropy_R (with gradient) by entropy_coeff."""
    m_R = torch.ones_like(logprobs_R) if mask_R is None else mask_R
    ratio_R = torch.exp(_log_ratio(logprobs_R, old_logprobs_R, loss_mode, seq_index_R, m_R))
    pg1_R = -advantages_R * ratio_R
    pg2_R = -advantages_R * torch.clamp(ratio_R, 1.0 - clip_low, 1.0 + clip_high)
    clipped_R = torch.maximum(pg1_R, pg2_R)
    pg3_R = -advantages_R * clip_c
    negative_R = (advantages_R < 0) if loss_mode == "vanilla" else torch.zeros_like(advantages_R, dtype=torch.bool)
    token_loss_R = torch.where(negative_R, torch.minimum(clipped_R, pg3_R), clipped_R)
    if is_weights_R is not None:  # truncated importance sampling on the engine/trainer ratio (mismatch.py)
        token_loss_R = is_weights_R * token_loss_R

    stats: dict[str, Tensor] = {}
    if ref_logprobs_R is not None:
        kl_R = kl_penalty(logprobs_R, ref_logprobs_R, kl_kind)
        token_loss_R = token_loss_R + kl_coef * kl_R
    if entropy_coeff:
        if entropy_R is None or not entropy_R.requires_grad:
            raise ValueError("entropy_coeff > 0 needs entropy_R with its gradient")
        token_loss_R = token_loss_R - entropy_coeff * entropy_R

    loss = (weights_R * token_loss_R).sum()
    with torch.no_grad():
        if ref_logprobs_R is not None:
            stats["kl_ref"] = (kl_R.detach() * m_R).sum()
        stats["clip_fraction"] = ((pg2_R > pg1_R).float() * m_R).sum()
        stats["clip_fraction_lower"] = (((clipped_R > pg3_R) & negative_R).float() * m_R).sum()
        token_log_ratio_R = torch.clamp(logprobs_R.detach() - old_logprobs_R, -20.0, 20.0)
        stats["approx_kl_old"] = ((torch.exp(token_log_ratio_R) - 1.0 - token_log_ratio_R) * m_R).sum()
        stats["ratio_mean"] = (ratio_R * m_R).sum()
        # Engine vs trainer (token level, whatever the loss mode): with old_logprobs = the engine's, before the
        # first update this is the train-inference mismatch (the trainer reports it from there).
        stats.update(mismatch_sums(logprobs_R, old_logprobs_R, m_R))
        if is_weights_R is not None:
            stats["is_weight_mean"] = (is_weights_R * m_R).sum()
    return loss, stats


def sft_loss(logprobs_R: Tensor, weights_R: Tensor, mask_R: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
    """Supervised loss L = -sum_t w_t * logp_t over the trained tokens (mask folded into the weights by the caller,
    as for the policy loss); stats: `nll`, the token sum of -logp over the trained tokens."""
    loss = -(weights_R * logprobs_R).sum()
    return loss, {"nll": -(logprobs_R.detach() * mask_R).sum()}


def topk_kl_loss(student_R_K: Tensor, teacher_R_K: Tensor, weights_R: Tensor, mask_R: Tensor
                 ) -> tuple[Tensor, Tensor]:
    """The top-k term of on-policy distillation (algorithm/distillation.py): with p~ = `teacher_R_K` (the teacher's
    top-k renormalised, 0 at padding) and log pi_S = `student_R_K` (the student's raw logprobs of those ids),
        KL~_t = sum_k p~_tk * (log p~_tk - log pi_S_tk),    L = sum_t w_t * KL~_t
    (0 log 0 = 0). Returns L and the token sum of KL~_t over `mask_R` (detached)."""
    log_teacher = torch.where(teacher_R_K > 0, teacher_R_K.clamp_min(1e-30).log(), 0.0)
    kl_R = (teacher_R_K * (log_teacher - student_R_K)).sum(-1)
    return (weights_R * kl_R).sum(), (kl_R.detach() * mask_R).sum()
