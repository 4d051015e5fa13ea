"""The algorithm registries: explicit dicts from a config value to the function that implements it.

`trainer_common.algorithm.adv_estimator` names a key of ADV_ESTIMATORS; each estimator lives in its own module
with its formula in the docstring. Pure Python (no torch).
"""

from __future__ import annotations

from astuner.algorithm.advantage import AdvantageFn, grpo_advantages
from astuner.algorithm.dr_grpo import dr_grpo_advantages
from astuner.algorithm.rloo import rloo_advantages

ADV_ESTIMATORS: dict[str, AdvantageFn] = {
    "grpo": grpo_advantages,
    "dr_grpo": dr_grpo_advantages,
    "rloo": rloo_advantages,
}


def get_adv_estimator(name: str) -> AdvantageFn:
    try:
        return ADV_ESTIMATORS[name]
    except KeyError:
        raise ValueError(f"unknown adv_estimator {name!r}; available: {', '.join(sorted(ADV_ESTIMATORS))}") from None
