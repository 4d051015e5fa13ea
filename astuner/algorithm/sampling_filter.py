"""Top-k / top-p (nucleus) filtering: the distribution a rollout actually samples from, shared by the HF engine,
the trainer (plain and chunked LM head) and the checks, and matched to vLLM's sampler.

For tempered logits z (one row per position) with 0 < p <= 1 and k >= 1:
  top-k keeps token v iff z_v >= the k-th largest z;
  top-p sorts the survivors' probabilities ascending, q_(1) <= ... <= q_(n), and drops token (i) iff
        q_(1) + ... + q_(i) <= 1 - p     (the most likely token is always kept);
  the filtered distribution is softmax over the kept tokens (the others get -inf).
Both keep a row's largest logits, so the kept set is {v : z_v >= t} for one threshold t per row, the smallest kept
logit (`keep_threshold`); a logit tied with t is kept, wherever a sort put it (vLLM's top-p keeps or drops such
ties by sort position; ties of fp32 logits are rare, and the engine's and the trainer's logits differ by rounding
anyway). One float per row is all a chunked head keeps to apply the same filter again in its backward pass.
Order as in vLLM: temperature first, then top-k, then top-p on what top-k left. vLLM reports these logprobs with
`logprobs_mode="processed_logprobs"`, the mode the vLLM engine uses; with k and p off both are log_softmax(z).

The mask is computed without gradient: the trainer differentiates log_softmax over the kept logits only, which
is the gradient of log pi_filtered(token) for a token the engine could have sampled.
"""

from __future__ import annotations

import torch
from torch import Tensor

# Rows whose threshold is computed at once: top-p sorts them (4 bytes of values and 8 of int64 indices per entry),
# so a block of rows, not the whole input, bounds that memory.
THRESHOLD_ROWS = 256


def is_filtered(top_k: int, top_p: float) -> bool:
    """Whether (top_k, top_p) changes the distribution: top_k 0 (or -1) and top_p 1.0 mean off."""
    return top_k > 0 or top_p < 1.0


def keep_threshold(z_R_V: Tensor, top_k: int = 0, top_p: float = 1.0, rows: int = THRESHOLD_ROWS) -> Tensor:
    """Per row the smallest tempered logit top-k / top-p keep (fp32, R; -inf where nothing is dropped): token v is
    kept iff z_v >= threshold. Computed `rows` rows at a time, without gradient."""
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    R, V = z_R_V.shape
    thr_R = torch.full((R,), float("-inf"), dtype=torch.float32, device=z_R_V.device)
    with torch.no_grad():
        for s in range(0, R, rows):
            work = z_R_V[s:s + rows].detach().float()
            if 0 < top_k < V:
                thr_R[s:s + rows] = torch.topk(work, top_k, dim=-1).values[:, -1]
            if top_p < 1.0:
                thr_R[s:s + rows] = _top_p_threshold(work, thr_R[s:s + rows], top_p)
    return thr_R


def _top_p_threshold(z_N_V: Tensor, thr_N: Tensor, top_p: float) -> Tensor:
    """The smallest logit top-p keeps among z >= thr_N (top-k's survivors): the dropped tokens are a prefix of the
    ascending sort, as long as its probabilities sum to at most 1 - p, never the whole row."""
    sorted_N_V = z_N_V.sort(dim=-1).values  # ascending; the int64 indices are freed at once
    sorted_N_V.masked_fill_(sorted_N_V < thr_N[:, None], float("-inf"))  # a prefix: what top-k dropped
    cum_N_V = (sorted_N_V - torch.logsumexp(sorted_N_V, dim=-1, keepdim=True)).exp_().cumsum_(dim=-1)
    cut_N = (cum_N_V <= 1.0 - top_p).sum(dim=-1).clamp_(max=z_N_V.shape[-1] - 1)
    return sorted_N_V.gather(-1, cut_N[:, None]).squeeze(-1)


def filter_logits(z_R_V: Tensor, top_k: int = 0, top_p: float = 1.0) -> Tensor:
    """Tempered logits with the tokens outside top-k / top-p set to -inf (a new tensor; autograd flows through
    the kept entries)."""
    if not is_filtered(top_k, top_p):
        return z_R_V
    thr_R = keep_threshold(z_R_V, top_k, top_p)
    return z_R_V.masked_fill(z_R_V < thr_R[:, None].to(z_R_V.dtype), float("-inf"))
