"""Dr. GRPO ("GRPO done right", Liu et al. 2025): remove GRPO's two biases.

For the episodes e of one group G with rewards r_e:

    A_e = r_e - mean_G            (A_e = 0 if |G| == 1)

1. No division by the group's std: a group whose rewards barely differ (an easy or a hard question) is not
   weighted up. This estimator never divides, whatever `norm_adv_by_std_in_grpo` says.
2. No division by each response's length: set `loss_agg_mode: seq-mean-token-sum-norm` (token sum over a constant,
   `max_response_length_in_one_turn`), so long wrong answers are not penalised less per token than short ones.
   The start-up check warns when `adv_estimator: dr_grpo` runs with another aggregation.
"""

from __future__ import annotations

from typing import Hashable, Sequence

from astuner.algorithm.advantage import grpo_advantages

RECOMMENDED_LOSS_AGG_MODE = "seq-mean-token-sum-norm"


def dr_grpo_advantages(
    rewards_E: Sequence[float], group_ids_E: Sequence[Hashable], norm_by_std: bool = False, epsilon: float = 0.0
) -> list[float]:
    """r_e - mean_G per episode, in input order (`norm_by_std` and `epsilon` are accepted and ignored)."""
    return grpo_advantages(rewards_E, group_ids_E, norm_by_std=False, epsilon=0.0)
