"""Which config keys act only on some backbone or engine, so that setting one elsewhere gets a warning.

No key may be silently ignored: a user who tunes `max_num_seqs` while running the hf engine should be told
once, at start, that it does nothing there.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from astuner.config.compose import LoadedConfig

# Key (or a section: everything under it) -> (what it depends on: "engine" | "backbone", values where it acts).
# Mirrors the [vllm] / [trinity] tags in astuner_default.yaml.
APPLIES_ONLY_WITH: dict[str, tuple[str, tuple[str, ...]]] = {
    "astuner.rollout.tensor_model_parallel_size": ("engine", ("vllm",)),
    "astuner.rollout.max_num_seqs": ("engine", ("vllm",)),
    "astuner.rollout.gpu_memory_utilization": ("engine", ("vllm",)),
    "astuner.trainer_common.trinity_only__n_vllm_engine": ("backbone", ("trinity",)),
}


def _rule_for(key: str) -> tuple[str, tuple[str, ...]] | None:
    for scope, rule in APPLIES_ONLY_WITH.items():
        if key == scope or key.startswith(scope + "."):
            return rule
    return None


def inapplicable_keys(loaded: LoadedConfig, backbone: str) -> list[str]:
    """User-set keys (sorted) that have no effect with `backbone` and the configured rollout engine."""
    current = {"backbone": backbone, "engine": loaded.cfg.astuner.rollout.engine}
    out = []
    for key in sorted(loaded.user_keys):
        rule = _rule_for(key)
        if rule is not None and current[rule[0]] not in rule[1]:
            out.append(key)
    return out


def format_inapplicable_warning(keys: list[str], backbone: str, engine: str) -> str | None:
    """One message naming every key in `keys` and where it would act; None when `keys` is empty."""
    if not keys:
        return None
    parts = []
    for key in keys:
        rule = _rule_for(key)
        where = f"acts only with {rule[0]} {' or '.join(rule[1])}" if rule else "does not apply here"
        parts.append(f"{key} ({where})")
    noun = "key has" if len(keys) == 1 else f"{len(keys)} keys have"
    return (
        f"config {noun} no effect with backbone '{backbone}' and engine '{engine}' and will be ignored: "
        f"{', '.join(parts)}. Remove them, or choose the backbone/engine they belong to."
    )
