"""What some config values mean once resolved, as pure functions: which engine `auto` picks, and the
trinity backbone's staleness bound. They live with the config because both the config's own rules
(applicability.py) and the stages that act on the values need them; nothing here imports torch or vLLM."""

from __future__ import annotations

import importlib.util


def vllm_available() -> bool:
    return importlib.util.find_spec("vllm") is not None


def resolve_engine_name(setting: str) -> str:
    """astuner.rollout.engine: auto -> vllm when the package is installed, else hf; vllm and hf as given."""
    if setting == "auto":
        return "vllm" if vllm_available() else "hf"
    return setting


def staleness_bound(sync_interval: int, sync_offset: int, max_staleness: int | None) -> int:
    """The most trainer steps a rolled-out batch may lag (backbone/sync_schedule.py): max_staleness when set,
    else sync_interval - 1 + sync_offset."""
    if max_staleness is not None:
        return max_staleness
    return sync_interval - 1 + sync_offset
