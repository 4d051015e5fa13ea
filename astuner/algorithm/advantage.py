"""Advantage estimators: one scalar per episode, computed within its group (the episodes of one task).

GRPO (the only estimator so far), for the episodes e of one group G with rewards r_e:

    mean_G = (1 / |G|) * sum_e r_e
    std_G  = sqrt( sum_e (r_e - mean_G)^2 / (|G| - 1) )          (unbiased, Bessel-corrected, as verl does)
    A_e    = (r_e - mean_G) / (std_G + epsilon)    if norm_by_std
    A_e    =  r_e - mean_G                         otherwise
    A_e    = 0                                     if |G| == 1    (no baseline to compare with)

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
    if len(rewards_E) != len(group_ids_E):
        raise ValueError(f"{len(rewards_E)} rewards but {len(group_ids_E)} group ids")
    members: dict[Hashable, list[int]] = {}
    for e, gid in enumerate(group_ids_E):
        members.setdefault(gid, []).append(e)

    advantages_E = [0.0] * len(rewards_E)
    for idx_G in members.values():
        n = len(idx_G)
        if n == 1:
            continue
        rewards_G = [float(rewards_E[e]) for e in idx_G]
        mean = sum(rewards_G) / n
        std = math.sqrt(sum((r - mean) ** 2 for r in rewards_G) / (n - 1))
        for e, r in zip(idx_G, rewards_G):
            advantages_E[e] = (r - mean) / (std + epsilon) if norm_by_std else r - mean
    return advantages_E


# Explicit registry: `astuner.trainer_common.algorithm.adv_estimator` names a key of this dict.
ADV_ESTIMATORS: dict[str, AdvantageFn] = {"grpo": grpo_advantages}


def get_adv_estimator(name: str) -> AdvantageFn:
    try:
        return ADV_ESTIMATORS[name]
    except KeyError:
        raise ValueError(f"unknown adv_estimator {name!r}; available: {', '.join(sorted(ADV_ESTIMATORS))}") from None
