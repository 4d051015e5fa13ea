"""Builders that turn the composed config into the pieces the stages use. Backbones call the ones they need,
in the process where each piece lives; the debug backbone builds all of them here."""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass
from pathlib import Path

from astuner.errors import UserError
from astuner.types import Task
from astuner.workflow import ClassSpecError, Workflow, load_class

log = logging.getLogger(__name__)

LATER_ENGINES = {"vllm"}


@dataclass
class Runtime:
    tokenizer: object
    train_tasks: list[Task]
    val_tasks: list[Task]
    engine: object
    trainer: object
    runner: object


def load_user_class(spec, base_dir: Path, what: str, key: str, base: type | None = None) -> type:
    if not spec:
        raise UserError(f"{key} is not set: name your {what} as 'pkg.module->Class' or 'path/file.py->Class'")
    try:
        cls = load_class(str(spec), [base_dir])
    except ClassSpecError as exc:
        raise UserError(f"{key}: {exc}") from None
    if base is not None and not (isinstance(cls, type) and issubclass(cls, base)):
        raise UserError(f"{key}: {spec!r} is not a subclass of {base.__module__}.{base.__qualname__}")
    return cls


def stop_token_ids(model_path: str, tokenizer) -> tuple[int, ...]:
    """End-of-turn ids: the generation config's eos ids plus the tokenizer's eos."""
    from transformers import GenerationConfig

    ids: set[int] = set()
    try:
        eos = GenerationConfig.from_pretrained(model_path).eos_token_id
        ids.update(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    except OSError:
        pass
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    return tuple(sorted(ids))


def build_policy_model_path(cfg) -> str:
    from astuner.model_cache import ModelPathError, resolve_model_path

    try:
        return resolve_model_path(str(cfg.astuner.model.path))
    except ModelPathError as exc:
        raise UserError(f"astuner.model.path: {exc}") from None


def load_tokenizer(model_path: str):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(model_path)
    except OSError as exc:
        raise UserError(
            f"astuner.model.path: cannot load a tokenizer from {model_path!r} ({exc}). Give a local Hugging Face "
            "model folder (there is no hub access at run time) or demo:smollm2-135m-instruct."
        ) from None


def build_trainer(cfg, model_path: str):
    from astuner.trainer import Trainer

    tc = cfg.astuner.trainer_common
    return Trainer(
        model_path,
        lr=float(tc.optim.lr),
        weight_decay=float(tc.optim.weight_decay),
        lr_warmup_steps=int(tc.optim.lr_warmup_steps),
        grad_clip=None if tc.optim.grad_clip is None else float(tc.optim.grad_clip),
        clip_ratio_low=float(tc.clip_ratio_low),
        clip_ratio_high=float(tc.clip_ratio_high),
        use_kl_loss=bool(tc.use_kl_loss),
        kl_loss_coef=float(tc.kl_loss_coef),
        kl_loss_type=str(tc.kl_loss_type),
        loss_agg_mode=str(tc.loss_agg_mode),
        norm_length=int(cfg.astuner.rollout.max_response_length_in_one_turn),
        max_token_len_per_micro_batch=int(cfg.trinity.trainer.max_token_len_per_gpu),
        mini_batch_num=int(tc.mini_batch_num),
        seed=int(cfg.astuner.seed),
    )


def _hf_engine(cfg, model_path: str, tokenizer):
    from astuner.engine.hf_engine import HFEngine

    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return HFEngine(
        model_path, max_batch_size=int(cfg.astuner.rollout.max_env_worker), seed=int(cfg.astuner.seed), pad_token_id=pad
    )


# astuner.rollout.engine -> builder(cfg, model_path, tokenizer)
ENGINES = {"hf": _hf_engine}


def build_engine(cfg, model_path: str, tokenizer):
    name = str(cfg.astuner.rollout.engine)
    if name in LATER_ENGINES:
        raise UserError(f"astuner.rollout.engine={name!r} comes in a later release; use engine 'hf' for now")
    return ENGINES[name](cfg, model_path, tokenizer)


def build_runtime(loaded) -> Runtime:
    import torch

    from astuner.rollout import RolloutRunner, RolloutSettings
    from astuner.task_judge.base_judge import BaseJudge
    from astuner.task_reader import build_task_reader

    cfg = loaded.cfg
    _quiet_library_progress()
    seed = int(cfg.astuner.seed)
    random.seed(seed)
    torch.manual_seed(seed)

    # Fail on user input (classes, data) before spending time on model loading.
    workflow_cls = load_user_class(
        cfg.astuner.rollout.agentscope_workflow, loaded.config_dir, "workflow", "astuner.rollout.agentscope_workflow",
        Workflow,
    )
    judge_cls = load_user_class(
        cfg.astuner.task_judge.judge_protocol, loaded.config_dir, "judge", "astuner.task_judge.judge_protocol", BaseJudge
    )
    reader = build_task_reader(cfg, loaded.config_dir)
    train_tasks, val_tasks = reader.training_tasks(), reader.validation_tasks()
    log.info("tasks: %d training, %d validation", len(train_tasks), len(val_tasks))

    model_path = build_policy_model_path(cfg)
    tokenizer = load_tokenizer(model_path)
    engine = build_engine(cfg, model_path, tokenizer)
    trainer = build_trainer(cfg, model_path)
    runner = RolloutRunner(
        RolloutSettings.from_config(cfg),
        engine,
        tokenizer,
        workflow_cls,
        judge_cls(cfg),
        stop_token_ids(model_path, tokenizer),
        config=cfg,
    )
    return Runtime(tokenizer, train_tasks, val_tasks, engine, trainer, runner)


def _quiet_library_progress() -> None:
    """Weight loading and dataset caching draw their own bars; the run has one progress bar of its own."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    try:
        from datasets.utils.logging import disable_progress_bar

        disable_progress_bar()
    except ImportError:
        pass
