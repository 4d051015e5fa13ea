"""The RL math, as pure functions: advantages, episodes -> samples, token weights, KL, PPO-clip loss.

Exact formulas live in the docstrings of `advantage.py`, `samples.py` and `loss.py`.
Exports are resolved lazily so that importing the pure-Python parts does not import torch.
"""

_EXPORTS = {
    "ADV_ESTIMATORS": "astuner.algorithm.advantage",
    "grpo_advantages": "astuner.algorithm.advantage",
    "get_adv_estimator": "astuner.algorithm.advantage",
    "episodes_to_samples": "astuner.algorithm.samples",
    "subset_indices": "astuner.algorithm.samples",
    "LOSS_AGG_MODES": "astuner.algorithm.loss",
    "KL_ESTIMATORS": "astuner.algorithm.loss",
    "token_weights": "astuner.algorithm.loss",
    "kl_penalty": "astuner.algorithm.loss",
    "policy_loss": "astuner.algorithm.loss",
}

__all__ = list(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'astuner.algorithm' has no attribute {name!r}")
