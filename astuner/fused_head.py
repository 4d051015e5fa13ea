"""The LM head and log-softmax of the sampled tokens, chunked over rows, never holding R x V logits.

For hidden states h_r, head weight W (V x H), temperature t_r and target token y_r:
    z_r = (W h_r) / t_r,   lse_r = log sum_v exp(z_rv),   logprob_r = z_r[y_r] - lse_r
    entropy_r = lse_r - sum_v p_rv z_rv                      (a metric here: no gradient)
Backward, with p_r = softmax(z_r) and g_r = dL/dlogprob_r:
    dL/dz_r = g_r (onehot(y_r) - p_r),   dL/dh_r = W^T dL/dz_r / t_r,   dL/dW = sum_r dL/dz_r h_r^T / t_r

The plain path materialises R x V logits in fp32 (for 32k response tokens and a 152k vocabulary, 20 GB) and streams
them through the cast, the log-sum-exp and its backward several times. Here each chunk of rows computes its logits,
keeps only lse and the target logit, and the backward recomputes the chunk's logits once: one more head matmul per
chunk, in exchange for the R x V traffic and memory. Logits are accumulated in fp32 from bf16 matmuls, as in the
plain path.
"""

from __future__ import annotations

import torch
from torch import Tensor

CHUNK_ROWS = 4096


class _HeadLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden_R_H: Tensor, weight_V_H: Tensor, targets_R: Tensor, inv_temp_R: Tensor,
                with_entropy: bool, chunk: int):
        R = hidden_R_H.shape[0]
        logprobs_R = torch.empty(R, dtype=torch.float32, device=hidden_R_H.device)
        lse_R = torch.empty_like(logprobs_R)
        entropy_R = torch.empty_like(logprobs_R) if with_entropy else None
        for s in range(0, R, chunk):
            e = min(R, s + chunk)
            z = (hidden_R_H[s:e] @ weight_V_H.T).float() * inv_temp_R[s:e, None]
            lse = torch.logsumexp(z, dim=-1)
            lse_R[s:e] = lse
            logprobs_R[s:e] = z.gather(-1, targets_R[s:e, None]).squeeze(-1) - lse
            if with_entropy:
                entropy_R[s:e] = lse - (torch.softmax(z, dim=-1) * z).sum(-1)
            del z
        ctx.save_for_backward(hidden_R_H, weight_V_H, targets_R, inv_temp_R, lse_R)
        ctx.chunk = chunk
        if entropy_R is None:
            entropy_R = torch.zeros(0, device=hidden_R_H.device)
        ctx.mark_non_differentiable(entropy_R)
        return logprobs_R, entropy_R

    @staticmethod
    def backward(ctx, g_R: Tensor, _g_entropy):
        hidden_R_H, weight_V_H, targets_R, inv_temp_R, lse_R = ctx.saved_tensors
        grad_h = torch.empty_like(hidden_R_H) if ctx.needs_input_grad[0] else None
        grad_w = torch.zeros(weight_V_H.shape, dtype=torch.float32, device=weight_V_H.device) \
            if ctx.needs_input_grad[1] else None
        R = hidden_R_H.shape[0]
        for s in range(0, R, ctx.chunk):
            e = min(R, s + ctx.chunk)
            z = (hidden_R_H[s:e] @ weight_V_H.T).float() * inv_temp_R[s:e, None]
            # dL/dz = g (onehot - p), then through the temperature: dL/dlogits = dL/dz / t
            grad_z = torch.exp(z - lse_R[s:e, None]).mul_(-g_R[s:e, None])
            del z
            rows = torch.arange(e - s, device=grad_z.device)
            grad_z[rows, targets_R[s:e]] += g_R[s:e]
            grad_z.mul_(inv_temp_R[s:e, None])
            grad_z = grad_z.to(hidden_R_H.dtype)
            if grad_h is not None:
                grad_h[s:e] = grad_z @ weight_V_H
            if grad_w is not None:
                grad_w += (grad_z.T @ hidden_R_H[s:e]).float()
        return grad_h, None if grad_w is None else grad_w.to(weight_V_H.dtype), None, None, None, None


def head_logprobs(hidden_R_H: Tensor, weight_V_H: Tensor, targets_R: Tensor, temps_R: Tensor,
                  with_entropy: bool = False, chunk: int | None = None) -> tuple[Tensor, Tensor | None]:
    """(logprobs, entropies or None) of `targets_R` under softmax((W h) / t), chunked; gradients flow to h and W
    through the logprobs (the entropies are a metric)."""
    logprobs_R, entropy_R = _HeadLogprobs.apply(hidden_R_H, weight_V_H, targets_R, 1.0 / temps_R, with_entropy,
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
