"""The trainer's forward: logprobs (and entropies) of the response tokens of a batch of samples.

Forward the decoder to hidden states, keep only the positions that predict response tokens (response token i of a
sample is predicted at index len(prompt) + i - 1), apply the LM head to those alone, then

    logprobs_t = log_softmax(logits_t / temperature)[token_t]
    entropy_t  = logsumexp(z_t) - sum_v p_tv * z_tv          (z = tempered logits, p = softmax(z))

Temperature 0 counts as 1.0 (the engine logs greedy calls untempered); sampled calls are scored over the rollouts'
top-k / top-p filtered distribution (`algorithm/sampling_filter.py`); on CUDA the head runs in row chunks and never
holds R x V logits (`trainer/fused_head.py`), with the filter and the entropy (and its gradient) too. Not computed, on
purpose: logits at prompt positions, and, for the loss (`trained_only`), at response tokens it does not train (tool
outputs joined in by merge mode: 0 there).

Samples whose inputs begin alike (the repeats of one task: the system prompt, the tool schemas, the question) are
forwarded over their shared prefix once (`step_plan.prefix_groups`): the prefix's keys and values, copied for each
member, are the past of the member's own tokens, and the gradient flows back through them into the prefix's
forward. The same hidden states up to the kernels' rounding, for the prefix's tokens once instead of once per
sample (`check_shared_prefix` decides per model: full-attention decoders with Hugging Face's dynamic cache).

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
from astuner.step_plan import PrefixGroup, even_parts, model_input, prefix_groups
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
    # Samples sharing at least this many leading tokens forward them once (`prefix_groups`); 0: never.
    shared_prefix: int = 0

    def groups(self, samples: list[Sample]) -> list[PrefixGroup]:
        """How `samples` are forwarded when the caller planned nothing: by shared prefix, or as one batch."""
        if self.fast and self.shared_prefix:
            return prefix_groups([model_input(s) for s in samples], self.shared_prefix)
        return [PrefixGroup(tuple(range(len(samples))), 0)]


def head_path(model, device: torch.device, settings, fast: bool) -> HeadPath:
    """The trainer's head path (`TrainerSettings`): the chunked head on CUDA, where the LM head's log-softmax is
    memory-bound (on CPU the extra head matmul of the chunked backward costs more than the traffic it saves), the
    rollouts' sampling filter, and shared prefixes when `check_shared_prefix` passes. Not under gradient
    checkpointing (Hugging Face keeps no cache in train mode); a sharded trainer turns them off (join_group)."""
    head = HeadPath(device, fast=fast, chunked=device.type == "cuda", top_k=int(settings.top_k),
                    top_p=float(settings.top_p))
    if fast and settings.shared_prefix_min_tokens and not settings.gradient_checkpointing:
        head.shared_prefix = settings.shared_prefix_min_tokens if check_shared_prefix(head, model) else 0
    return head


def response_hidden(path: HeadPath, model, samples: list[Sample], groups: list[PrefixGroup]) -> Tensor:
    """The decoder's hidden states at the positions that predict the samples' response tokens (response token i of
    a sample at index len(prompt) + i - 1), R x H in the samples' order; each group forwarded as one batch, over
    its shared prefix when it has one."""
    rows: list[Tensor | None] = [None] * len(samples)
    for g in groups:
        members = [samples[i] for i in g.indices]
        inputs = [model_input(s) for s in members]
        prefix_S_H, own = _shared_forward(path, model, inputs, g.shared) if g.shared else \
            (None, list(_padded_forward(path, model, inputs, 0)))
        for i, s, own_T_H in zip(g.indices, members, own):
            lo, hi = len(s.prompt_ids) - 1, len(s.prompt_ids) + len(s.response_ids) - 1
            own_T_H = own_T_H[max(lo, g.shared) - g.shared: max(hi, g.shared) - g.shared]
            rows[i] = own_T_H if prefix_S_H is None else torch.cat([prefix_S_H[lo:min(hi, g.shared)], own_T_H])
    return torch.cat(rows)


def _padded_forward(path: HeadPath, model, inputs: list[list[int]], start: int, past=None) -> Tensor:
    """Hidden states B x T of `inputs` right-padded, at positions from `start` (after `past`, a prefix's cache).
    No attention mask: causal attention already hides the right padding from real tokens, and SDPA stays on its
    fused causal path. No autocast either: precision is the parameters' dtype (astuner/trainer/precision.py)."""
    input_ids_B_T = padded_ids(path, inputs)
    if past is None:
        return model.base_model(input_ids=input_ids_B_T, use_cache=False)[0]
    B, T = input_ids_B_T.shape
    pos_B_T = torch.arange(start, start + T, device=path.device).expand(B, T)
    return model.base_model(input_ids=input_ids_B_T, past_key_values=past, position_ids=pos_B_T, use_cache=True)[0]


def padded_ids(path: HeadPath, inputs: list[list[int]]) -> Tensor:
    """`inputs` right-padded with `path.pad_id` to the longest, B x T on the path's device."""
    input_ids_B_T = torch.full((len(inputs), max(len(x) for x in inputs)), path.pad_id, dtype=torch.long)
    for b, x in enumerate(inputs):
        input_ids_B_T[b, : len(x)] = torch.tensor(x, dtype=torch.long)
    return input_ids_B_T.to(path.device)


def _shared_forward(path: HeadPath, model, inputs: list[list[int]], shared: int) -> tuple[Tensor, list[Tensor]]:
    """The prefix's hidden states (shared x H) and every member's own after it (T_b x H, padded): the prefix
    forwarded once; the members in batches of like length (`step_plan.even_parts`), each over a cache that holds
    the prefix's keys and values once per member."""
    from transformers import DynamicCache

    out = model.base_model(input_ids=torch.tensor([inputs[0][:shared]], device=path.device), use_cache=True)
    kv = [(layer.keys, layer.values) for layer in out.past_key_values.layers]
    own: list[Tensor | None] = [None] * len(inputs)
    for part in even_parts([len(x) - shared for x in inputs]):
        past = DynamicCache()
        for layer, (k, v) in enumerate(kv):
            past.update(k.expand(len(part), -1, -1, -1), v.expand(len(part), -1, -1, -1), layer)
        for j, own_T_H in zip(part, _padded_forward(path, model, [inputs[j][shared:] for j in part], shared, past)):
            own[j] = own_T_H
    return out[0][0], own  # type: ignore[return-value]


def check_shared_prefix(path: HeadPath, model) -> bool:
    """True when a prefix forwarded once and attended to through its cache gives the hidden states of the plain
    forward, on two samples sharing 6 of their 8 and 7 input tokens (a response crossing the prefix's end).
    Caches that keep less than the whole prefix (sliding-window or linear-attention layers) are left out unchecked;
    the tolerance is the parameters' dtype's."""
    from transformers.cache_utils import DynamicLayer

    vocab = model.get_output_embeddings().weight.shape[0]
    ids = [(k * 997 + 11) % vocab for k in range(11)]
    samples = [Sample(ids[:4], ids[4:9], [0.0] * 5, 0.0, 1.0, "a"), Sample(ids[:4], ids[4:6] + ids[9:11], [0.0] * 4,
                                                                        0.0, 1.0, "b")]
    try:
        with torch.no_grad():
            out = model.base_model(input_ids=torch.tensor([ids[:2]], device=path.device), use_cache=True)
            layers = getattr(out.past_key_values, "layers", None)
            if not layers or any(type(layer) is not DynamicLayer for layer in layers):
                return False
            plain = response_hidden(path, model, samples, [PrefixGroup((0, 1), 0)]).float()
            shared = response_hidden(path, model, samples, [PrefixGroup((0, 1), 6)]).float()
    except Exception as exc:  # an architecture whose cache or positions work otherwise: the plain path
        log.warning("trainer: shared-prefix forward unavailable for %s (%s)", type(model).__name__, exc)
        return False
    tol = 1e-4 if next(model.parameters()).dtype == torch.float32 else 3e-2
    return shared.shape == plain.shape and bool(torch.allclose(shared, plain, rtol=tol,
                                                               atol=tol * float(plain.abs().max())))


def raw_topk_logprobs(logits_R_V: Tensor, samples: list[Sample], topk: int) -> Tensor:
    """log softmax(z_t)[v_tk] of the samples' teacher top-k ids v_tk (R x topk; z the untempered logits)."""
    ids_R_K = torch.tensor(topk_rows(samples, topk)[0], device=logits_R_V.device, dtype=torch.long)
    return logits_R_V.gather(-1, ids_R_K) - torch.logsumexp(logits_R_V, dim=-1, keepdim=True)


def response_logprobs(path: HeadPath, model, samples: list[Sample], with_entropy: bool, entropy_grad: bool,
                      topk: int = 0, groups: list[PrefixGroup] | None = None, trained_only: bool = False
                      ) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """Logprobs (and entropies, with their gradient if `entropy_grad`) of the samples' response tokens, flat R;
    with `topk`, the raw logprobs of the samples' teacher top-k ids (R x topk, module docstring), else None.
    `groups`: how the samples are forwarded (`step_plan.split_shared_micro_batches`; default `path.groups`).
    `trained_only`: the head only at the trained tokens (`loss_mask` 1), 0 at the others (`trained_rows`)."""
    dev = path.device
    rows = trained_rows(samples) if trained_only and not topk else None
    targets, temps, sampled = _per_token(samples, rows)
    targets_R = torch.tensor(targets, device=dev)
    temps_R = torch.tensor(temps, device=dev, dtype=torch.float32)

    filtered = is_filtered(path.top_k, path.top_p) and any(sampled)
    if path.fast:
        hidden_R_H = response_hidden(path, model, samples, groups or path.groups(samples))
        if rows is not None:
            hidden_R_H = hidden_R_H[torch.tensor(rows, device=dev)]
        weight = plain_linear_head(model) if path.chunked and not topk else None
        if weight is not None:
            # Never holds R x V logits (astuner/trainer/fused_head.py); the same numbers as below, filter and entropy
            # (and its gradient) included.
            out = head_logprobs(hidden_R_H, weight, targets_R, temps_R, with_entropy,
                                filtered_R=torch.tensor(sampled, device=dev) if filtered else None,
                                top_k=path.top_k, top_p=path.top_p, entropy_grad=entropy_grad)
            return (*_every_row(out, rows, samples), None)
        logits_R_V = head_logits(model, hidden_R_H)
    else:
        batch_idx, pos_idx = [], []
        for b, s in enumerate(samples):
            batch_idx += [b] * len(s.response_ids)
            pos_idx += range(len(s.prompt_ids) - 1, len(s.prompt_ids) + len(s.response_ids) - 1)
        if rows is not None:
            batch_idx, pos_idx = [batch_idx[i] for i in rows], [pos_idx[i] for i in rows]
        input_ids_B_T = padded_ids(path, [model_input(s) for s in samples])
        logits_R_V = model(input_ids=input_ids_B_T, use_cache=False).logits[batch_idx, pos_idx].float()
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
    return (*_every_row((logprobs_R, entropy_R), rows, samples), topk_R_K)


def _per_token(samples: list[Sample], rows: list[int] | None) -> tuple[list[int], list[float], list[bool]]:
    """Per response token (at `rows` alone, None: all): its id, its call's temperature, whether it was sampled."""
    targets, temps, sampled = [], [], []
    for s in samples:
        L = len(s.response_ids)
        targets += s.response_ids
        temps += [greedy_as_one(s.temperature)] * L
        sampled += [s.temperature > 0] * L
    if rows is None:
        return targets, temps, sampled
    return [targets[i] for i in rows], [temps[i] for i in rows], [sampled[i] for i in rows]


def trained_rows(samples: list[Sample]) -> list[int] | None:
    """The flat response positions whose token is trained (`loss_mask` 1: what the model generated), or None when
    every one is. Tool outputs and turn markers joined into a sample carry no loss, and an agent's episode is mostly
    tool output: the LM head (its R x V logits, the largest tensor of a small model's step) skips them."""
    if all(s.loss_mask is None or all(s.loss_mask) for s in samples):
        return None
    return [i for i, m in enumerate(m for s in samples for m in (s.loss_mask or [1] * len(s.response_ids))) if m]


def _every_row(values: tuple, rows: list[int] | None, samples: list[Sample]) -> tuple:
    """Per-row tensors over `rows` (None: all) put back at their flat response positions, 0 elsewhere; the
    gradient flows to the rows that were computed."""
    if rows is None:
        return values
    R = sum(len(s.response_ids) for s in samples)
    out = []
    for v in values:
        if v is not None:
            index = torch.tensor(rows, device=v.device)
            v = torch.zeros(R, dtype=v.dtype, device=v.device).index_copy(0, index, v)
        out.append(v)
    return tuple(out)
