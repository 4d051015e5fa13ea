"""Advantage estimators: one scalar per episode, computed within its group (the episodes of one task).

For the episodes e of one group G (|G| = n) with rewards r_e:

GRPO (`grpo`, verl's name):

    mean_G = (1 / |G|) * sum_e r_e
    std_G  = sqrt( sum_e (r_e - mean_G)^2 / (|G| - 1) )          (unbiased, Bessel-corrected, as verl does)
    A_e    = (r_e - mean_G) / (std_G + epsilon)    if norm_by_std
    A_e    =  r_e - mean_G                         otherwise
    A_e    = 0                                     if |G| == 1    (no baseline to compare with)

Other estimators live in their own modules (formula in each docstring) and are registered in
algorithm/registry.py:
`dr_grpo` (algorithm/dr_grpo.py) and `rloo` (algorithm/rloo.py).

Every sample (LLM call) of an episode later gets that episode's A_e (see `samples.py`).
Pure Python: no torch, so this module is cheap to import and trivial to test.
"""

from __future__ import annotations

import math
from typing import Callable, Hashable, Sequence

AdvantageFn = Callable[..., list[float]]


def grpo_advantages(
    rewards_E: Sequence[float],
    group_ids_E: Sequence[Hashable],
    norm_by_std: bool,
    epsilon: float,
) -> list[float]:
    """Group-relative advantages, one per episode, in input order (formulas in the module docstring)."""
    advantages_E = [0.0] * len(rewards_E)
    for idx_G in group_members(rewards_E, group_ids_E):
        n = len(idx_G)
        if n == 1:
            continue
        rewards_G = [float(rewards_E[e]) for e in idx_G]
        mean = sum(rewards_G) / n
        std = math.sqrt(sum((r - mean) ** 2 for r in rewards_G) / (n - 1))
        for e, r in zip(idx_G, rewards_G):
            advantages_E[e] = (r - mean) / (std + epsilon) if norm_by_std else r - mean
    return advantages_E


def group_members(rewards_E: Sequence[float], group_ids_E: Sequence[Hashable]) -> list[list[int]]:
    """Indices of each group's episodes, groups in order of first appearance."""
    if len(rewards_E) != len(group_ids_E):
        raise ValueError(f"{len(rewards_E)} rewards but {len(group_ids_E)} group ids")
    members: dict[Hashable, list[int]] = {}
    for e, gid in enumerate(group_ids_E):
        members.setdefault(gid, []).append(e)
    return list(members.values())
