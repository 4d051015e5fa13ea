"""GSPO (Group Sequence Policy Optimization, Zheng et al. 2025; verl's `policy_loss.loss_mode: gspo`): one
importance ratio per sequence instead of one per token.

For sample s with trained tokens t (mask m_t = 1), T_s of them, logp = log pi_theta, old = the sampling logprob:

    log s_s   = (1 / T_s) * sum_t m_t * (logp_t - old_t)            sequence ratio s_s = exp(log s_s): the
                                                                      geometric mean of the token ratios
    log s_s,t = sg[log s_s] + logp_t - sg[logp_t]                    (sg = stop-gradient: the value is log s_s
                                                                      for every token; the gradient flows through
                                                                      logp_t, so d s_s,t = s_s * d logp_t)
    s_s,t     = exp(min(log s_s,t, 10))
    pg_t      = max(-A * s_s,t, -A * clip(s_s,t, 1 - clip_low, 1 + clip_high))

No dual clip. The token losses are then aggregated like any other (`loss_agg_mode`; the paper and verl use
seq-mean-token-mean, which astuner's default episode-mean-token-mean equals for single-call episodes). Because
s_s averages T_s log-ratios it stays near 1: the paper clips at 3e-4 / 4e-4.
"""

from __future__ import annotations

import torch
from torch import Tensor


def gspo_log_ratio(logprobs_R: Tensor, old_logprobs_R: Tensor, seq_index_R: Tensor, mask_R: Tensor) -> Tensor:
    """log s_s,t per token (value: its sequence's mean log-ratio; gradient: that of logp_t), capped at 10."""
    num_seqs = int(seq_index_R.max().item()) + 1 if seq_index_R.numel() else 0
    diff_R = (logprobs_R.detach() - old_logprobs_R) * mask_R
    sums_S = torch.zeros(num_seqs, dtype=diff_R.dtype, device=diff_R.device).index_add_(0, seq_index_R, diff_R)
    counts_S = torch.zeros(num_seqs, dtype=diff_R.dtype, device=diff_R.device).index_add_(0, seq_index_R, mask_R)
    seq_log_ratio_S = sums_S / counts_S.clamp(min=1.0)
    log_ratio_R = seq_log_ratio_S[seq_index_R] + logprobs_R - logprobs_R.detach()
    return torch.clamp(log_ratio_R, max=10.0)
