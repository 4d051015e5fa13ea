"""Every trained model of a run (astuner.model, named `policy`, and astuner.models), built in one process for the
roles that process holds.

    debug           one process: every model's engine and trainer
    verl worker     every model's engine and trainer (colocated, as the policy's)
    trinity         an explorer: every model's engine (an episode may call any agent); a trainer worker: every
                    model's trainer, trained one after another in the worker's data-parallel group

Models that are LoRA adapters on the first model's own LoRA base (`ModelSpec.adapter`) share one engine over that base
(the HF engine's adapters or vLLM's multi-LoRA) and, among the trainers of one process, one copy of the frozen
base weights; their syncs hand over the adapter alone.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from astuner.types import SyncReport

log = logging.getLogger(__name__)

ROLES = ("engine", "trainer")


@dataclass
class LocalModel:
    """One trained model in this process: the engine that samples from it and its trainer (None where the
    process holds no such role); `adapter`: served as an adapter on a base shared with other models."""

    engine: object
    trainer: object
    adapter: bool = False

    def sync_tensors(self):
        """(name, tensor) pairs the engine takes from the trainer: the adapter alone on a shared base, else the
        weights (merged, for a LoRA model on a base of its own)."""
        from astuner.trainer.lora import adapter_tensors

        if self.adapter:
            return adapter_tensors(self.trainer.model)
        return self.trainer.named_parameters_for_sync()

    def sync(self) -> SyncReport:
        """The engine serves the trainer's weights (both in this process)."""
        return self.engine.load_weights(self.sync_tensors()) or SyncReport()


def distinct_engines(models: dict[str, LocalModel]) -> list:
    """The engines of `models`, each once (adapters on one base share theirs)."""
    from astuner.engine.adapters import AdapterView

    out = []
    for model in models.values():
        engine = model.engine.engine if isinstance(model.engine, AdapterView) else model.engine
        if engine is not None and all(engine is not e for e in out):
            out.append(engine)
    return out


def build_models(typed, facts, tokenizer, models, max_model_len: int, total_steps: int, *,
                 roles: tuple[str, ...] = ROLES, kv_cache_bytes: int | None = None,
                 micro_batch_tokens: int | None = None, world: int = 1, gpu_share: float | None = None,
                 only: tuple[str, ...] | None = None, extra_engines: int = 0) -> dict[str, LocalModel]:
    """Every model of the `ModelSet` `models` by name, in its order (`only`: these), with an engine if `roles` holds
    "engine" (together taking `gpu_share` of a GPU, default rollout.gpu_memory_utilization) and a trainer if it
    holds "trainer" (of a group of `world` workers); `facts`: the run's config.derived.RunFacts (its engine and
    algorithm). Each model's trainer takes its own LoRA rank, learning rate and filter (its `ModelSpec`); the
    tokenizers were checked to be one at `runtime.prepare`. `extra_engines`: other vLLM engines this process will
    run beside them (a distillation teacher's), which take their part of the GPU share too."""
    from astuner.engine.build import build_adapter_engine, build_engine
    from astuner.trainer.build import build_trainer
    from astuner.trainer.lora import share_frozen_weights

    mine = models.only(only)
    shared = None
    if "engine" in roles:  # adapters on the shared base are one engine; every other model one of its own
        import torch

        from astuner.config.derived import gpu_share_per_engine

        gpu_share = gpu_share_per_engine(typed, models.engines + extra_engines, torch.cuda.is_available(), gpu_share)
        if models.adapters:
            shared = build_adapter_engine(typed, facts.engine, models, tokenizer, max_model_len, kv_cache_bytes,
                                          gpu_share)
    out: dict[str, LocalModel] = {}
    base = None  # the first trainer in this process over the shared base: the others take its frozen weights
    for spec in mine:
        served = trainer = None
        if "engine" in roles:
            served = shared.view(spec.name) if spec.adapter else build_engine(
                typed, spec.folder, tokenizer, max_model_len, kv_cache_bytes, engine=facts.engine,
                gpu_share=gpu_share)
        if "trainer" in roles:
            trainer = build_trainer(typed, facts.algorithm, spec.folder, total_steps, micro_batch_tokens, world,
                                    spec=spec, models_in_group=len(mine))
            if spec.adapter and base is not None:
                freed = share_frozen_weights(trainer.model, base.model)
                log.info("model %s: a LoRA adapter on the %s's base (%.2f GiB of base weights shared)", spec.name,
                         models.first.name, freed / 2**30)
            elif spec.adapter:
                base = trainer
        out[spec.name] = LocalModel(served, trainer, adapter=spec.adapter)
    return out


def build_runtime(loaded, backbone: str = "debug", total_steps_of=None):
    """Every piece of a run in this process (the debug backbone): `runtime.prepare`, then every model's weights,
    the rollout runner over them and the token-pipeline check; a `runtime.Runtime`."""
    from astuner import runtime
    from astuner.model_tuner.pipeline_check import CheckSampling, check_runner, engine_trainer_logprob_check

    typed = loaded.typed
    runtime.seed_everything(typed.astuner.seed)
    prep = runtime.prepare(loaded, backbone, total_steps_of)
    models = build_models(typed, prep.facts, prep.tokenizer, prep.models, prep.max_model_len, prep.total_steps,
                          kv_cache_bytes=prep.plan.kv_cache_bytes,
                          micro_batch_tokens=prep.plan.micro_batch_token_budget,
                          extra_engines=int(prep.facts.teacher_engine == "vllm"))
    engine, trainer = models[prep.models.first.name].engine, models[prep.models.first.name].trainer
    runner = runtime.build_runner(loaded, engine, prep.tokenizer, prep.workflow_cls, prep.judge, prep.stop_ids,
                                  prep.max_model_len, roster_of_models(typed, prep.models, models))
    check_runner(typed.astuner.rollout.preflight, runner, engine_trainer_logprob_check(
        engine, trainer, runner.renderer, runner.stop_token_ids, CheckSampling.of(prep.models.first)))
    return runtime.Runtime(prep.tokenizer, prep.train_tasks, prep.val_tasks, engine, trainer, runner, prep.plan,
                           models)


def roster_of_models(typed, model_set, models: dict[str, LocalModel]):
    """The `Roster` of the engines of `models` (model_tuner/roster.py; None for a one-model run without named
    agents)."""
    from astuner.model_tuner.roster import roster_of

    return roster_of(typed.astuner.agents, model_set, {name: m.engine for name, m in models.items()})
