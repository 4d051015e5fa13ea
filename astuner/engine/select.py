"""Which engine `astuner.rollout.engine` means (auto resolved), without importing torch or vLLM."""

from __future__ import annotations

import importlib.util


def vllm_available() -> bool:
    return importlib.util.find_spec("vllm") is not None


def resolve_engine_name(setting: str) -> str:
    """auto -> vllm when the package is installed, else hf; vllm and hf as given."""
    if setting == "auto":
        return "vllm" if vllm_available() else "hf"
    return setting
