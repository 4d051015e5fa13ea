"""The config as a run uses it: every key that does nothing under the chosen settings reads its neutral value.

`config/applicability.py` says where a key acts (and warns when a user sets one where it does not). The settings
builders (`TrainerSettings` in trainer/build.py, `SelectionSettings` in selection.py) copy fields from
`effective(typed)` without restating those rules: `kl_loss_coef` already reads 0 there when `use_kl_loss` is off,
`epsilon` 0 when advantages are not divided by their std, and so on. The neutral values are the ones under which
the key changes nothing.

Offline algorithm types (`algorithm/catalog.py`) draw no rollouts: the sampling filter does not shape their data,
so `top_k` / `top_p` read "no filter" there; a type that takes one optimizer step per batch (`mini_batches`
False: dpo, orpo) reads `mini_batch_num` 1.
"""

from __future__ import annotations

from typing import Any

from astuner.config.applicability import APPLIES_ONLY_WITH

TC = "astuner.trainer_common."

# Key -> its value where APPLIES_ONLY_WITH says it does not act. Only keys whose rule does not depend on the
# backbone belong here (the settings are built where the backbone is not known).
NEUTRAL: dict[str, Any] = {
    TC + "optim.min_lr_ratio": 0.0,
    TC + "clip_ratio_c": 3.0,
    TC + "kl_loss_coef": 0.0,
    TC + "kl_loss_type": "k3",
    TC + "algorithm.norm_adv_by_std_in_grpo": False,
    TC + "algorithm.epsilon": 0.0,
    TC + "algorithm.filter_groups.metric": "score",
    TC + "algorithm.filter_groups.max_num_gen_batches": 0,
    TC + "algorithm.rft_reward_threshold": 1.0,
    TC + "algorithm.distill_topk": 0,
}
OFFLINE_NEUTRAL: dict[str, Any] = {"astuner.rollout.top_k": 0, "astuner.rollout.top_p": 1.0}


def effective(typed, kind):
    """A read-only view of the typed config (`RunConfig`) in which every inactive key of NEUTRAL reads its neutral
    value; every other read goes to the config itself. Which keys are inactive is decided on the config as
    given, before any is reset. `kind`: the record of its algorithm type (algorithm/catalog.py; the set-up's
    config.derived.RunFacts.algorithm), looked up once by the caller."""
    inactive = {key: value for key, value in NEUTRAL.items() if not APPLIES_ONLY_WITH[key][1](typed, None)}
    if kind.offline:
        inactive.update(OFFLINE_NEUTRAL)
    if not kind.mini_batches:  # the whole batch is one optimizer step
        inactive[TC + "mini_batch_num"] = 1
    return _Neutralised(typed, "", inactive)


class _Neutralised:
    """A section seen with the keys of `values` (dotted paths from the root) replaced. A view, not a copy: reads
    of other keys reach the section as they are (the run-contract test records them there)."""

    def __init__(self, section, path: str, values: dict[str, Any]) -> None:
        self._section, self._path, self._values = section, path, values

    def __getattr__(self, name: str):
        path = f"{self._path}.{name}" if self._path else name
        if path in self._values:
            return self._values[path]
        value = getattr(self._section, name)
        if any(key.startswith(path + ".") for key in self._values):
            return _Neutralised(value, path, self._values)
        return value
