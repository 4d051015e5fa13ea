"""How one training step is cut up and scheduled: mini-batches (one optimizer step each), micro-batches by token
budget (one forward/backward each), the samples of a micro-batch that share a prefix (forwarded once), and the
learning rate of each optimizer step. Pure Python; the Trainer (`astuner/trainer/core.py`) applies them; pair
objectives (DPO, ORPO) keep each pair in one micro-batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from astuner.types import Sample


def lr_at(step: int, base_lr: float, warmup_steps: int, total_steps: int, kind: str, min_lr_ratio: float) -> float:
    """Learning rate of optimizer step `step` (0-based):

        warmup  (step < W):  lr = base * (step + 1) / W
        constant:            lr = base
        cosine:              p = (step - W) / max(1, total - W - 1), clipped to [0, 1]
                             lr = base * (m + (1 - m) * (1 + cos(pi * p)) / 2),   m = min_lr_ratio
        linear:              lr = base * (1 - (1 - m) * p)       (same p: base right after warmup, m * base last)
    """
    if warmup_steps > 0 and step < warmup_steps:
        return base_lr * (step + 1) / warmup_steps
    if kind == "constant":
        return base_lr
    if kind not in ("cosine", "linear"):
        raise ValueError(f"unknown lr_scheduler_type {kind!r}; available: constant, cosine, linear")
    progress = min(1.0, max(0.0, (step - warmup_steps) / max(1, total_steps - warmup_steps - 1)))
    if kind == "linear":
        return base_lr * (1.0 - (1.0 - min_lr_ratio) * progress)
    return base_lr * (min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress)))


def offsets(lengths: list[int]) -> list[int]:
    """Start index of each run of `lengths` in their concatenation."""
    out, total = [], 0
    for n in lengths:
        out.append(total)
        total += n
    return out


def split_mini_batches(samples: list[Sample], mini_batch_num: int) -> list[list[Sample]]:
    """Contiguous runs of episodes (order of first appearance), as even in episode count as possible."""
    order: dict[str, list[Sample]] = {}
    for s in samples:
        order.setdefault(s.episode_uid, []).append(s)
    episodes = list(order.values())
    n = min(max(1, mini_batch_num), len(episodes))
    size, extra = divmod(len(episodes), n) if n else (0, 0)
    out, start = [], 0
    for i in range(n):
        stop = start + size + (1 if i < extra else 0)
        out.append([s for ep in episodes[start:stop] for s in ep])
        start = stop
    return out


def split_micro_batches(lengths_B: list[int], budget: int) -> list[list[int]]:
    """Indices per micro-batch: samples sorted longest first, greedily packed while
    max_len_in_micro_batch * n_samples <= budget (a sample over budget goes alone)."""
    order = sorted(range(len(lengths_B)), key=lambda i: (-lengths_B[i], i))
    batches: list[list[int]] = []
    for i in order:
        # Longest first: the first sample of a micro-batch is its longest, so max_len is fixed once it opens.
        if batches and lengths_B[batches[-1][0]] * (len(batches[-1]) + 1) <= budget:
            batches[-1].append(i)
        else:
            batches.append([i])
    return batches


def split_pair_micro_batches(lengths_B: list[int], budget: int) -> list[list[int]]:
    """For 2P samples where i and i + P form a pair (a chosen and its rejected): `split_micro_batches` over the
    pairs' summed lengths, each micro-batch's chosen indices first, then their rejected ones."""
    half = len(lengths_B) // 2
    pairs = split_micro_batches([lengths_B[i] + lengths_B[i + half] for i in range(half)], budget)
    return [idx + [i + half for i in idx] for idx in pairs]


@dataclass(frozen=True)
class PrefixGroup:
    """Samples forwarded over one shared prefix: the first `shared` tokens of their inputs are equal and forwarded
    once, then each sample's own tokens attend to them (`trainer/forward.py`); shared 0: a plain padded batch."""

    indices: tuple[int, ...]
    shared: int

    def cost(self, lengths: list[int]) -> int:
        """What the group counts against a micro-batch's token budget: the plain path's padded tokens, n times
        the longest. The shared forward processes fewer rows, but the budget bounds memory, and the logits rows,
        the prefix's keys and values held once per member and the attention weights over them do not shrink
        with the prefix: counted this way a micro-batch never holds more than the plain path's would."""
        return len(self.indices) * max(lengths[i] for i in self.indices)


def model_input(s: Sample) -> list[int]:
    """What the trainer feeds for a sample: the prompt and the response but its last token, which predicts nothing
    trained on."""
    return s.prompt_ids + s.response_ids[:-1]


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def prefix_groups(inputs: list[list[int]], min_shared: int) -> list[PrefixGroup]:
    """Samples whose inputs begin alike, grouped so that the fewest tokens are forwarded. Sorted, the inputs'
    common prefixes are runs of neighbours: a run of m inputs (lengths L_i) shares s = the least common prefix of
    its adjacent pairs, capped one short of its shortest input (every member forwards a token of its own), and
    forwards

        cost(run) = s + sum_i (L_i - s) = sum_i L_i - (m - 1) * s      (s >= min_shared; a run of one: L)

    tokens. The runs are the cut of the sorted inputs that minimises the summed cost (a dynamic programme over
    the cut points: best[j] = min_i best[i] + cost(inputs i..j-1)). Runs of one, and every sample when
    min_shared < 1, are gathered in one group with shared 0, first."""
    if min_shared < 1 or len(inputs) < 2:
        return [PrefixGroup(tuple(range(len(inputs))), 0)] if inputs else []
    order = sorted(range(len(inputs)), key=lambda i: (inputs[i], i))
    n = len(order)
    adjacent = [common_prefix(inputs[a], inputs[b]) for a, b in zip(order, order[1:])]
    best = [0] + [0] * n
    cut: list[tuple[int, int]] = [(0, 0)] * (n + 1)  # best[j]'s last run: its start and its shared length
    for j in range(1, n + 1):
        total = len(inputs[order[j - 1]])
        best[j], cut[j] = best[j - 1] + total, (j - 1, 0)
        shared, shortest = 1 << 62, total
        for i in range(j - 2, -1, -1):  # the run i..j-1, longer each turn: its prefix only shrinks
            shared = min(shared, adjacent[i])
            shortest = min(shortest, len(inputs[order[i]]))
            total += len(inputs[order[i]])
            s = min(shared, shortest - 1)
            if shared < min_shared:
                break
            if s >= min_shared and best[i] + total - (j - 1 - i) * s < best[j]:
                best[j], cut[j] = best[i] + total - (j - 1 - i) * s, (i, s)
    runs, j = [], n
    while j > 0:
        i, s = cut[j]
        runs.append((tuple(sorted(order[i:j])), s))
        j = i
    alone = tuple(sorted(i for members, s in runs if not s for i in members))
    return ([PrefixGroup(alone, 0)] if alone else []) + [PrefixGroup(m, s) for m, s in reversed(runs) if s]


def even_parts(lengths: list[int], max_padding: float = 0.25) -> list[list[int]]:
    """Indices cut into padded batches, longest first: the next joins the open part while the part's padding,
    n * longest - sum, stays within `max_padding` of its n * longest tokens."""
    parts: list[list[int]] = []
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        if parts:
            part = parts[-1]
            padded = lengths[part[0]] * (len(part) + 1)
            if padded - sum(lengths[j] for j in part) - lengths[i] <= max_padding * padded:
                part.append(i)
                continue
        parts.append([i])
    return parts


def split_shared_micro_batches(inputs: list[list[int]], budget: int,
                               min_shared: int) -> list[tuple[list[int], list[PrefixGroup]]]:
    """Micro-batches that keep samples sharing a prefix together (`prefix_groups`), each as (indices, its groups
    with indices into that list). A group over budget is cut, longest first, into parts of cost <= budget
    (`PrefixGroup.cost`, the plain path's padded tokens; a part of one joins the unshared); the parts packed
    first-fit by decreasing cost; the unshared samples by `split_micro_batches` (all of them when min_shared < 1).
    Lengths count a sample's tokens, its input and the last response token (`Sample.num_tokens`)."""
    lengths = [len(x) + 1 for x in inputs]
    parts: list[PrefixGroup] = []
    plain: list[int] = []
    for g in prefix_groups(inputs, min_shared):
        if not g.shared:
            plain += g.indices
            continue
        part: list[int] = []
        for i in sorted(g.indices, key=lambda i: (-lengths[i], i)):
            if part and PrefixGroup(tuple(part + [i]), g.shared).cost(lengths) > budget:
                parts.append(PrefixGroup(tuple(part), g.shared))
                part = []
            part.append(i)
        parts.append(PrefixGroup(tuple(part), g.shared))
    plain += [i for p in parts if len(p.indices) == 1 for i in p.indices]
    bins: list[tuple[int, list[PrefixGroup]]] = []
    for p in sorted((p for p in parts if len(p.indices) > 1), key=lambda p: -p.cost(lengths)):
        c = p.cost(lengths)
        at = next((k for k, (used, _) in enumerate(bins) if used + c <= budget), None)
        if at is None:
            bins.append((c, [p]))
        else:
            bins[at] = (bins[at][0] + c, bins[at][1] + [p])
    out = []
    for _, groups in bins:
        idx = [i for g in groups for i in g.indices]
        local = {i: k for k, i in enumerate(idx)}
        out.append((idx, [PrefixGroup(tuple(local[i] for i in g.indices), g.shared) for g in groups]))
    plain.sort()
    for mb in split_micro_batches([lengths[i] for i in plain], budget):
        out.append(([plain[k] for k in mb], [PrefixGroup(tuple(range(len(mb))), 0)]))
    return out


def plan_micro_batches(samples: list[Sample], budget: int, min_shared: int,
                       paired: bool) -> list[tuple[list[int], list[PrefixGroup] | None]]:
    """The trainer's micro-batches: `split_shared_micro_batches` when prefixes are shared (min_shared > 0), else
    `split_micro_batches` (`split_pair_micro_batches` for pairs, kept whole) with no groups planned: the forward
    then groups each micro-batch's samples itself (`HeadPath.groups`; a pair's two share their prompt)."""
    if min_shared and not paired:
        return split_shared_micro_batches([model_input(s) for s in samples], budget, min_shared)
    split = split_pair_micro_batches if paired else split_micro_batches
    return [(idx, None) for idx in split([s.num_tokens for s in samples], budget)]
