"""What some config values mean once resolved, as pure functions: which engine `auto` picks (a distillation
teacher's too), the share of the GPU each vLLM engine of a process takes, and the trinity backbone's staleness
bound. They live with the config because both the config's own rules (applicability.py) and the stages that act
on the values need them; nothing here imports torch or vLLM."""

from __future__ import annotations

import importlib.util
import logging


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


def stale_samples_uncorrected(bound: int, old_logprobs: str, rollout_is_cap: float | None) -> bool:
    """Samples up to `bound` policy versions old that the loss would not correct: a bound above 0 without
    trainer-recomputed old logprobs and a truncated importance weight (config/compose.derive_for_backbone)."""
    return bound > 0 and not (old_logprobs == "trainer" and rollout_is_cap is not None)


def teacher_engine(typed) -> str | None:
    """The engine a model-folder teacher (astuner.teacher.model) scores on, in the process that runs the loop;
    None when the run has no such teacher (no distillation, or a teacher server)."""
    from astuner.algorithm.catalog import algorithm

    t = typed.astuner.teacher
    if t.model is None or not algorithm(typed.astuner.trainer_common.algorithm.type).has_teacher:
        return None
    return resolve_engine_name(t.engine or typed.astuner.rollout.engine)


def gpu_share_per_engine(typed, engines: int, on_cuda: bool, share: float | None = None) -> float | None:
    """The part of the GPU each of `engines` vLLM engines in one process takes: on CUDA they split `share`
    (None: astuner.rollout.gpu_memory_utilization), since vLLM reads it per engine (two at 0.6 would ask for 1.2
    cards); the start-up estimate counts the run's engines as that one share (preflight.py). `share` itself where
    nothing is split (None: the engine reads the config's). The config is never rewritten: the share goes to the
    engine's builder (runtime.build_engine)."""
    if engines <= 1 or not on_cuda or resolve_engine_name(typed.astuner.rollout.engine) != "vllm":
        return share
    share = typed.astuner.rollout.gpu_memory_utilization if share is None else share
    logging.getLogger(__name__).info("%d vLLM engines in this process: each takes %.3g of the GPU "
                                     "(astuner.rollout.gpu_memory_utilization split)", engines, share / engines)
    return share / engines
