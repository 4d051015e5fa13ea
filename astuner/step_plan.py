"""How one training step is cut up and scheduled: mini-batches (one optimizer step each), micro-batches by token
budget (one forward/backward each), and the learning rate of each optimizer step. Pure Python; the Trainer
(`astuner/trainer/core.py`) applies them; pair objectives (DPO, ORPO) keep each pair in one micro-batch.
"""

from __future__ import annotations

import math

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
