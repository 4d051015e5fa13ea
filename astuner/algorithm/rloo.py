"""RLOO (REINFORCE leave-one-out; verl's `adv_estimator: rloo`): each episode's baseline is the mean reward of
the other episodes of its group, so the baseline does not depend on the episode it judges.

For the episodes e of one group G (|G| = n) with rewards r_e:

    A_e = r_e - (1 / (n - 1)) * sum_{j != e} r_j  =  n / (n - 1) * (r_e - mean_G)      (A_e = 0 if n == 1)

No std normalisation (`norm_adv_by_std_in_grpo` and `epsilon` do not act here).
"""

from __future__ import annotations

from typing import Hashable, Sequence

from astuner.algorithm.advantage import group_members


def rloo_advantages(
    rewards_E: Sequence[float], group_ids_E: Sequence[Hashable], norm_by_std: bool = False, epsilon: float = 0.0
) -> list[float]:
    """Leave-one-out advantages, one per episode, in input order."""
    advantages_E = [0.0] * len(rewards_E)
    for idx_G in group_members(rewards_E, group_ids_E):
        n = len(idx_G)
        if n == 1:
            continue
        total = sum(float(rewards_E[e]) for e in idx_G)
        for e in idx_G:
            r = float(rewards_E[e])
            advantages_E[e] = r - (total - r) / (n - 1)
    return advantages_E
