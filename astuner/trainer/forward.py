"""The trainer's forward: logprobs (and entropies) of the response tokens of a batch of samples.

Forward the decoder to hidden states, keep only the positions that predict response tokens (response token i of a
sample is predicted at index len(prompt) + i - 1), apply the LM head to those alone, then

    logprobs_t = log_softmax(logits_t / temperature)[token_t]
    entropy_t  = logsumexp(z_t) - sum_v p_tv * z_tv          (z = tempered logits, p = softmax(z))

Temperature 0 counts as 1.0 (the engine logs greedy calls untempered); sampled calls are scored over the rollouts'
top-k / top-p filtered distribution (`algorithm/sampling_filter.py`); on CUDA the head runs in row chunks and never
holds R x V logits (`trainer/fused_head.py`), with the filter and the entropy (and its gradient) too. Not computed, on
purpose: logits at prompt positions.

With `topk` (on-policy distillation's top-k term, algorithm/distillation.py), also the student's raw logprobs
(temperature 1, unfiltered) of the teacher's top-k ids at each response position:
    topk_tk = z_t[v_tk] - logsumexp(z_t)       (z_t the untempered logits)
through the full logits: that forward does not take the chunked head.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import Tensor

from astuner.algorithm.distillation import topk_rows
from astuner.algorithm.sampling_filter import is_filtered, keep_threshold
from astuner.trainer.fused_head import head_logprobs, plain_linear_head
from astuner.types import Sample

log = logging.getLogger("astuner.trainer")


def greedy_as_one(temperature: float) -> float:
    # Temperature 0 means greedy decoding; its logprobs are those of the untempered distribution.
    return temperature if temperature > 0 else 1.0


def active_dropout(model) -> list[str]:
    """Dropout that train mode would switch on: config probabilities and nn.Dropout modules above 0."""
    found = [f"{k}={v}" for k, v in model.config.to_dict().items()
             if "dropout" in k and isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0]
    found += [f"{name} (p={m.p})" for name, m in model.named_modules()
              if isinstance(m, torch.nn.Dropout) and m.p > 0][:3]
    return found


def head_logits(model, hidden_N_H: Tensor) -> Tensor:
    """LM head on selected hidden states, plus the output transforms some families apply after it."""
    logits = model.get_output_embeddings()(hidden_N_H).float()
    config = model.config
    if getattr(config, "logits_scaling", None):  # Granite
        logits = logits / config.logits_scaling
    if getattr(model, "logit_scale", None) is not None:  # Cohere
        logits = logits * model.logit_scale
    if getattr(config, "final_logit_softcapping", None):  # Gemma 2/3
        cap = config.final_logit_softcapping
        logits = torch.tanh(logits / cap) * cap
    return logits


def check_fast_head(model, device: torch.device) -> bool:
    """True when decoder + LM head on selected positions reproduces the model's own logits.

    Guards the fast path against architectures that post-process logits in ways `head_logits` does not know;
    those fall back to a full-logits forward (correct, slower). Checked once, in fp32, on 8 tokens.
    """
    vocab = model.get_output_embeddings().weight.shape[0]
    ids = (torch.arange(8, device=device) * 997 % vocab).unsqueeze(0)
    with torch.no_grad():
        try:
            full = model(input_ids=ids, use_cache=False).logits[0].float()
            hidden = model.base_model(input_ids=ids, use_cache=False)[0][0]
            fast = head_logits(model, hidden)
            ok = fast.shape == full.shape and torch.allclose(fast, full, rtol=1e-3, atol=1e-3)
        except Exception as exc:  # any mismatch of interfaces: take the safe path
            log.warning("fast LM-head path unavailable (%s)", exc)
            ok = False
    if not ok:
        log.warning("trainer: full-logits forward for %s (slower, same result)", type(model).__name__)
    return ok


@dataclass
class HeadPath:
    """How the LM head is applied: fixed per trainer (`chunked` may be switched to compare the paths)."""

    device: torch.device
    fast: bool  # decoder + head on the selected positions (`check_fast_head`), else the model's full logits
    chunked: bool  # row-chunked log-softmax (`trainer/fused_head.py`) for a plain linear head
    top_k: int = 0
    top_p: float = 1.0
    pad_id: int = 0  # right padding after every real token: causal attention never lets a real token see it


def raw_topk_logprobs(logits_R_V: Tensor, samples: list[Sample], topk: int) -> Tensor:
    """log softmax(z_t)[v_tk] of the samples' teacher top-k ids v_tk (R x topk; z the untempered logits)."""
    ids_R_K = torch.tensor(topk_rows(samples, topk)[0], device=logits_R_V.device, dtype=torch.long)
    return logits_R_V.gather(-1, ids_R_K) - torch.logsumexp(logits_R_V, dim=-1, keepdim=True)


def response_logprobs(path: HeadPath, model, samples: list[Sample], with_entropy: bool, entropy_grad: bool,
                      topk: int = 0) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """Logprobs (and entropies, with their gradient if `entropy_grad`) of the samples' response tokens, flat R;
    with `topk`, the raw logprobs of the samples' teacher top-k ids (R x topk, module docstring), else None."""
    # The last token of each sequence predicts nothing we train on, so it is not fed.
    inputs = [s.prompt_ids + s.response_ids[:-1] for s in samples]
    T = max(len(x) for x in inputs)
    input_ids_B_T = torch.full((len(samples), T), path.pad_id, dtype=torch.long)
    batch_idx, pos_idx, targets, temps, sampled = [], [], [], [], []
    for b, (s, x) in enumerate(zip(samples, inputs)):
        input_ids_B_T[b, : len(x)] = torch.tensor(x, dtype=torch.long)
        P, L = len(s.prompt_ids), len(s.response_ids)
        batch_idx += [b] * L
        pos_idx += range(P - 1, P + L - 1)
        targets += s.response_ids
        temps += [greedy_as_one(s.temperature)] * L
        sampled += [s.temperature > 0] * L
    dev = path.device
    input_ids_B_T = input_ids_B_T.to(dev)
    batch_idx_R, pos_idx_R = torch.tensor(batch_idx, device=dev), torch.tensor(pos_idx, device=dev)
    targets_R = torch.tensor(targets, device=dev)
    temps_R = torch.tensor(temps, device=dev, dtype=torch.float32)

    # No attention mask: causal attention already hides the right padding from real tokens, and SDPA stays on its
    # fused causal path. No autocast either: precision is the parameters' dtype (astuner/trainer/precision.py).
    filtered = is_filtered(path.top_k, path.top_p) and any(sampled)
    if path.fast:
        hidden_B_T_H = model.base_model(input_ids=input_ids_B_T, use_cache=False)[0]
        weight = plain_linear_head(model) if path.chunked and not topk else None
        if weight is not None:
            # Never holds R x V logits (astuner/trainer/fused_head.py); the same numbers as below, filter and entropy
            # (and its gradient) included.
            return (*head_logprobs(hidden_B_T_H[batch_idx_R, pos_idx_R], weight, targets_R, temps_R, with_entropy,
                                   filtered_R=torch.tensor(sampled, device=dev) if filtered else None,
                                   top_k=path.top_k, top_p=path.top_p, entropy_grad=entropy_grad), None)
        logits_R_V = head_logits(model, hidden_B_T_H[batch_idx_R, pos_idx_R])
    else:
        logits_R_V = model(input_ids=input_ids_B_T, use_cache=False).logits[batch_idx_R, pos_idx_R].float()
    # Before the temperature and the filter: the raw model is what the teacher is compared with.
    topk_R_K = raw_topk_logprobs(logits_R_V, samples, topk) if topk else None
    if any(t != 1.0 for t in temps):  # a full pass over R x V floats (and its backward) saved when all are 1
        logits_R_V = logits_R_V / temps_R[:, None]
    if filtered:
        # Greedy calls were not filtered by the engine (and are never trained); sampled ones were.
        sampled_R = torch.tensor(sampled, device=dev)
        thr_R = keep_threshold(logits_R_V, path.top_k, path.top_p).masked_fill_(~sampled_R, float("-inf"))
        logits_R_V = logits_R_V.masked_fill(logits_R_V < thr_R[:, None], float("-inf"))
    logz_R = torch.logsumexp(logits_R_V, dim=-1)
    logprobs_R = logits_R_V.gather(-1, targets_R[:, None]).squeeze(-1) - logz_R
    entropy_R = None
    if with_entropy and entropy_grad and torch.is_grad_enabled():
        probs_R_V = torch.softmax(logits_R_V, dim=-1)
        # Filtered tokens have p = 0 and z = -inf: their term is 0, and so is its gradient (p * z with z = -inf
        # would send 0 * -inf = nan back through p).
        entropy_R = logz_R - (probs_R_V * torch.where(probs_R_V > 0, logits_R_V, 0.0)).sum(-1)
    elif with_entropy:  # a metric: -sum p log p in place on p, with entr(0) = 0 for the filtered tokens
        with torch.no_grad():
            probs_R_V = torch.softmax(logits_R_V, dim=-1)
            entropy_R = torch.special.entr(probs_R_V, out=probs_R_V).sum(-1)
    return logprobs_R, entropy_R, topk_R_K
