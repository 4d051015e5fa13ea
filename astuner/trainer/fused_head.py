"""The LM head and log-softmax of the sampled tokens, chunked over rows, never holding R x V logits.

For hidden states h_r, head weight W (V x H), temperature t_r, target token y_r and the rollout's top-k / top-p
keeping z_rv >= c_r (`algorithm/sampling_filter.py`; c_r = -inf for a row the engine did not filter):
    z_r = (W h_r) / t_r, dropped entries -inf,   lse_r = log sum_v exp(z_rv),   logprob_r = z_r[y_r] - lse_r
    p_r = softmax(z_r),   entropy_r = -sum_v p_rv log p_rv            (= sum_v entr(p_rv); entr(0) = 0)
Backward, with g_r = dL/dlogprob_r and e_r = dL/dentropy_r (0 unless the entropy is trained):
    dL/dz_r = g_r (onehot(y_r) - p_r) + e_r (entr(p_r) - entropy_r p_r)     (0 at dropped entries)
    dL/dh_r = W^T dL/dz_r / t_r,   dL/dW = sum_r dL/dz_r h_r^T / t_r

The plain path materialises R x V logits in fp32 (for 32k response tokens and a 152k vocabulary, 20 GB; 20 to 22
bytes an entry at its peak, astuner/memory.py) and streams them through the cast, the log-sum-exp and its
backward several times. Here each chunk of C rows computes its logits, keeps only lse, the threshold c, the
target logit and the entropy, and the backward recomputes the chunk's logits once: one more head matmul per chunk,
in exchange for the R x V traffic and memory. Logits are accumulated in fp32 from bf16 matmuls, as in the plain
path.

Memory (what the start-up estimate counts, `memory.CHUNK_ENTRY_BYTES`): every step works in place on one chunk's
fp32 logits (the log-sum-exp too: torch.logsumexp would allocate z - max beside z), with at most one more buffer
of the same size at a time: the compute-dtype matmul output it is cast from, the filter's sort of C / 8 rows
(4 bytes of values and 8 of int64 indices an entry), the entropy's gradient, or the gradient's cast back to the
compute dtype. 8 bytes per entry of C x V in every mode; beside it, the backward's fp32 weight gradient and one
chunk's product (V x H).
"""

from __future__ import annotations

import torch
from torch import Tensor

from astuner.algorithm.sampling_filter import keep_threshold

CHUNK_ROWS = 4096


def _chunk_logits(hidden_C_H: Tensor, weight_V_H: Tensor, inv_temp_C: Tensor, thr_C: Tensor | None) -> Tensor:
    """Tempered fp32 logits of a chunk, with the filter's dropped entries at -inf."""
    z_C_V = (hidden_C_H @ weight_V_H.T).float()
    z_C_V.mul_(inv_temp_C[:, None])  # in place: an fp32 matmul's output is ours, and .float() made a new one
    if thr_C is not None:
        z_C_V.masked_fill_(z_C_V < thr_C[:, None], float("-inf"))
    return z_C_V


class _HeadLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden_R_H: Tensor, weight_V_H: Tensor, targets_R: Tensor, inv_temp_R: Tensor,
                filtered_R: Tensor | None, top_k: int, top_p: float, with_entropy: bool, entropy_grad: bool,
                chunk: int):
        R = hidden_R_H.shape[0]
        dev = hidden_R_H.device
        logprobs_R = torch.empty(R, dtype=torch.float32, device=dev)
        lse_R = torch.empty_like(logprobs_R)
        entropy_R = torch.empty_like(logprobs_R) if with_entropy else torch.zeros(0, device=dev)
        thr_R = None if filtered_R is None else torch.full_like(logprobs_R, float("-inf"))
        for s in range(0, R, chunk):
            e = min(R, s + chunk)
            z = _chunk_logits(hidden_R_H[s:e], weight_V_H, inv_temp_R[s:e], None)
            if thr_R is not None:
                thr = keep_threshold(z, top_k, top_p, rows=max(1, chunk // 8))  # its sort: < 3 bytes an entry
                thr_R[s:e] = thr.masked_fill_(~filtered_R[s:e], float("-inf"))  # greedy rows: unfiltered
                z.masked_fill_(z < thr_R[s:e, None], float("-inf"))
            # log-sum-exp in place (torch.logsumexp would allocate z - max beside z): z becomes exp(z - max), then p
            max_C = z.amax(dim=-1)  # finite: a row's largest logit is always kept
            z.sub_(max_C[:, None])
            shifted_target_C = z.gather(-1, targets_R[s:e, None]).squeeze(-1)
            sum_C = z.exp_().sum(dim=-1)
            lse_R[s:e] = max_C + sum_C.log()
            logprobs_R[s:e] = shifted_target_C - sum_C.log()
            if with_entropy:
                p = z.div_(sum_C[:, None])
                entropy_R[s:e] = torch.special.entr(p, out=p).sum(-1)
                del p
            del z  # before the next chunk's logits are made
        ctx.save_for_backward(hidden_R_H, weight_V_H, targets_R, inv_temp_R, lse_R, thr_R,
                              entropy_R if entropy_grad else None)
        ctx.chunk = chunk
        ctx.set_materialize_grads(False)
        if not entropy_grad:
            ctx.mark_non_differentiable(entropy_R)
        return logprobs_R, entropy_R

    @staticmethod
    def backward(ctx, g_R: Tensor | None, e_R: Tensor | None):
        hidden_R_H, weight_V_H, targets_R, inv_temp_R, lse_R, thr_R, entropy_R = ctx.saved_tensors
        if entropy_R is None or e_R is None or e_R.numel() == 0:
            e_R = None
        if g_R is None:
            g_R = torch.zeros_like(lse_R)
        grad_h = torch.empty_like(hidden_R_H) if ctx.needs_input_grad[0] else None
        grad_w = torch.zeros(weight_V_H.shape, dtype=torch.float32, device=weight_V_H.device) \
            if ctx.needs_input_grad[1] else None
        R = hidden_R_H.shape[0]
        for s in range(0, R, ctx.chunk):
            e = min(R, s + ctx.chunk)
            z = _chunk_logits(hidden_R_H[s:e], weight_V_H, inv_temp_R[s:e], None if thr_R is None else thr_R[s:e])
            g = g_target = g_R[s:e]
            if thr_R is not None:  # a dropped target's logit gets no gradient (its logprob is -inf), as through
                # masked_fill in the plain path; the log-sum-exp's share still reaches the kept entries
                g_target = g * (z.gather(-1, targets_R[s:e, None]).squeeze(-1) > float("-inf"))
            p = z.sub_(lse_R[s:e, None]).exp_()  # in place: 0 at dropped entries
            del z
            if e_R is None:
                grad_z = p.mul_(-g[:, None])  # dL/dz = g (onehot - p)
            else:  # + e (entr(p) - entropy p)
                grad_z = torch.special.entr(p).mul_(e_R[s:e, None])
                grad_z.addcmul_(p, (g + e_R[s:e] * entropy_R[s:e])[:, None], value=-1.0)
            del p  # (or grad_z's own buffer: freed with it below, before the next chunk's logits)
            rows = torch.arange(e - s, device=grad_z.device)
            grad_z[rows, targets_R[s:e]] += g_target
            grad_z.mul_(inv_temp_R[s:e, None])  # through the temperature: dL/dlogits = dL/dz / t
            grad_z = grad_z.to(hidden_R_H.dtype)
            if grad_h is not None:
                grad_h[s:e] = grad_z @ weight_V_H
            if grad_w is not None:
                grad_w += (grad_z.T @ hidden_R_H[s:e]).float()
            del grad_z
        grad_w = None if grad_w is None else grad_w.to(weight_V_H.dtype)
        return grad_h, grad_w, None, None, None, None, None, None, None, None


def head_logprobs(hidden_R_H: Tensor, weight_V_H: Tensor, targets_R: Tensor, temps_R: Tensor,
                  with_entropy: bool = False, chunk: int | None = None, *, filtered_R: Tensor | None = None,
                  top_k: int = 0, top_p: float = 1.0, entropy_grad: bool = False) -> tuple[Tensor, Tensor | None]:
    """(logprobs, entropies or None) of `targets_R` under softmax((W h) / t), chunked; gradients flow to h and W
    through the logprobs, and through the entropies when `entropy_grad`. `filtered_R` (bool, R): the rows scored
    under the rollout's top-k / top-p (sampled calls), None for none."""
    if entropy_grad and not with_entropy:
        raise ValueError("entropy_grad needs with_entropy")
    logprobs_R, entropy_R = _HeadLogprobs.apply(hidden_R_H, weight_V_H, targets_R, 1.0 / temps_R, filtered_R,
                                                int(top_k), float(top_p), with_entropy, entropy_grad,
                                                chunk or CHUNK_ROWS)
    return logprobs_R, (entropy_R if with_entropy else None)


def plain_linear_head(model) -> Tensor | None:
    """The head's weight when the head is a bias-free nn.Linear with no output transform after it (else None:
    the trainer keeps the plain path, which knows those transforms)."""
    head = model.get_output_embeddings()
    config = model.config
    if type(head) is not torch.nn.Linear or head.bias is not None:
        return None
    if getattr(config, "logits_scaling", None) or getattr(model, "logit_scale", None) is not None \
            or getattr(config, "final_logit_softcapping", None):
        return None
    return head.weight
