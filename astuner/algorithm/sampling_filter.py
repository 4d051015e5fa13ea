"""Top-k / top-p (nucleus) filtering: the distribution a rollout actually samples from, shared by the HF engine,
the trainer and the checks, and matched to vLLM's sampler.

For tempered logits z (one row per position) with 0 < p <= 1 and k >= 1:
  top-k keeps token v iff z_v >= the k-th largest z (ties at the boundary are all kept);
  top-p sorts the survivors' probabilities ascending, q_(1) <= ... <= q_(n), and drops token (i) iff
        q_(1) + ... + q_(i) <= 1 - p     (the most likely token is always kept);
  the filtered distribution is softmax over the kept tokens (the others get -inf).
Order as in vLLM: temperature first, then top-k, then top-p on what top-k left. vLLM reports these logprobs with
`logprobs_mode="processed_logprobs"`, the mode the vLLM engine uses; with k and p off both are log_softmax(z).

The mask is computed without gradient: the trainer differentiates log_softmax over the kept logits only, which
is the gradient of log pi_filtered(token) for a token the engine could have sampled.
"""

from __future__ import annotations

import torch
from torch import Tensor


def is_filtered(top_k: int, top_p: float) -> bool:
    """Whether (top_k, top_p) changes the distribution: top_k 0 (or -1) and top_p 1.0 mean off."""
    return top_k > 0 or top_p < 1.0


def filter_logits(z_R_V: Tensor, top_k: int = 0, top_p: float = 1.0) -> Tensor:
    """Tempered logits with the tokens outside top-k / top-p set to -inf (a new tensor; autograd flows through
    the kept entries)."""
    if not is_filtered(top_k, top_p):
        return z_R_V
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    with torch.no_grad():
        drop_R_V = torch.zeros_like(z_R_V, dtype=torch.bool)
        work = z_R_V.detach().float()
        if 0 < top_k < z_R_V.shape[-1]:
            kth_R = torch.topk(work, top_k, dim=-1).values[:, -1:]
            drop_R_V |= work < kth_R
        if top_p < 1.0:
            masked = work.masked_fill(drop_R_V, float("-inf"))
            sorted_R_V, order_R_V = masked.sort(dim=-1, descending=False)
            cum_R_V = sorted_R_V.softmax(dim=-1).cumsum(dim=-1)
            drop_sorted = cum_R_V <= 1.0 - top_p
            drop_sorted[:, -1] = False  # the most likely token always stays
            drop_R_V |= torch.zeros_like(drop_R_V).scatter(-1, order_R_V, drop_sorted)
    return z_R_V.masked_fill(drop_R_V, float("-inf"))
