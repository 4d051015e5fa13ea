"""A run's set-up: `prepare` (user code, data, the tokenizer and the memory plan, before any weights load; every
backbone's driver calls it) and `build_runner` (the rollout runner, in each process that runs episodes). The
parts are built where they live: engines by engine/build.py, trainers by trainer/build.py, the workflow by
workflow.py, the judge by task_judge/loading.py; run_models.py builds every model of a process from them."""

from __future__ import annotations

import logging
import os
import random
import sys
from dataclasses import dataclass, field

from astuner.config.derived import run_facts
from astuner.errors import UserError
from astuner.task_judge.loading import build_judge
from astuner.tokenizer import check_same_tokenizer, load_tokenizer, stop_token_ids
from astuner.types import Task
from astuner.workflow import load_workflow

log = logging.getLogger(__name__)


@dataclass
class Runtime:
    tokenizer: object
    train_tasks: list[Task]
    val_tasks: list[Task]
    engine: object
    trainer: object
    runner: object
    plan: object = None  # preflight.RunPlan
    models: dict = field(default_factory=dict)  # every model by name, the policy first: run_models.LocalModel


def model_set(typed, first_folder: str | None = None):
    """The run's models (config/model_set.py) with their folders resolved; UserError naming the key of a path
    that resolves to none. `first_folder`: the first model's folder, in place of its configured path's."""
    from astuner.config.model_set import model_set as configured
    from astuner.model_cache import ModelPathError, resolve_model_path

    models = configured(typed)

    def folder(spec) -> str:
        if first_folder is not None and spec is models.first:
            return first_folder
        try:
            return resolve_model_path(spec.path)
        except ModelPathError as exc:
            raise UserError(f"{spec.key}.path: {exc}") from None

    return models.resolved(folder)


@dataclass
class Prepared:
    """What every backbone's driver knows before any weights load: user code checked, data read, the model's
    limits and the memory plan announced, and what the config's settings resolve to (`facts`)."""

    workflow_cls: type | None  # None: offline data, no workflow
    judge: object
    train_tasks: list  # Tasks, or offline Examples / Pairs
    val_tasks: list
    models: object  # config.model_set.ModelSet, folders resolved
    max_model_len: int
    tokenizer: object
    total_steps: int
    plan: object  # preflight.RunPlan
    facts: object = None  # config.derived.RunFacts
    stop_ids: tuple = ()  # the token ids that end an assistant turn (tokenizer.stop_token_ids)

    @property
    def model_path(self) -> str:
        """The first model's folder (astuner.model): the run's tokenizer and chat template are its."""
        return self.models.first.folder


def prepare(loaded, backbone: str = "debug", total_steps_of=None, device_of=None) -> Prepared:
    """In the order that fails fastest: user code, data, the model's config and memory estimate; no weights.
    The data source is the catalog's (`task_reader/sources.py`: the workflow's tasks, or offline_data's
    conversations or pairs, which need no workflow). `total_steps_of(n_train_items)` gives the run's step count;
    `device_of()` the trainer's `memory.DeviceFacts` (None: this process's device, where the debug backbone
    trains)."""
    from astuner import preflight
    from astuner.logs import announce
    from astuner.task_reader.sources import DATA_SOURCES

    typed = loaded.typed
    quiet_library_progress()
    facts = run_facts(typed)
    source = DATA_SOURCES[facts.algorithm.data](typed, loaded.config_dir, facts.algorithm.data)
    workflow_cls, judge = (load_workflow(loaded), build_judge(loaded)) if source.runs_workflow else (None, None)
    source.read()

    models = model_set(typed)
    model_path = models.first.folder
    model_facts = preflight.read_model_facts(model_path)
    max_model_len = preflight.resolve_max_model_len(typed.astuner.rollout.max_model_len, model_facts,
                                                    source.turn_cap)
    tokenizer = load_tokenizer(model_path)
    stop_ids = tuple(stop_token_ids(model_path, tokenizer))
    train_tasks, val_tasks = source.encode(lambda: _chat_text(typed, tokenizer, stop_ids), max_model_len)
    total_steps = total_steps_of(len(train_tasks)) if total_steps_of else 1
    device_facts = device_of() if device_of else None
    teacher = None
    if facts.algorithm.has_teacher:
        from astuner.distill import prepare_teacher

        teacher = prepare_teacher(typed, facts.teacher_engine, tokenizer)
    others = {}
    for spec in models.models[1:]:  # before any weights load, on every backbone
        others[spec.name] = preflight.read_model_facts(spec.folder, f"{spec.key}.path")
        check_same_tokenizer(tokenizer, spec.folder, f"{spec.key}.path")
    plan = preflight.make_plan(typed, backbone, model_facts, max_model_len, total_steps, device_facts, others,
                               teacher)
    announce(source.describe() + plan.block(model_facts))
    preflight.check_fits(plan, model_facts)
    return Prepared(workflow_cls, judge, train_tasks, val_tasks, models, max_model_len, tokenizer, total_steps, plan,
                    facts, stop_ids)


def _chat_text(typed, tokenizer, stop_ids):
    """The chat renderer the rollouts use, and the texts that end an assistant turn (offline data is cut there)."""
    from astuner.model_tuner import ChatRenderer

    ends = tuple(dict.fromkeys(tokenizer.decode([i], skip_special_tokens=False) for i in stop_ids))
    return ChatRenderer(tokenizer, typed.astuner.rollout.tool_prompt), ends


def configure_tools(typed) -> None:
    """Settings of astuner's own tools, in every process that runs episodes."""
    from astuner.tools.python_exec import allow_unsandboxed

    allow_unsandboxed(typed.astuner.rollout.python_tool_unsandboxed)


def build_runner(loaded, engine, tokenizer, workflow_cls, judge, stop_ids, max_model_len: int, roster=None):
    """The rollout runner over `engine` (None: only its renderer and parsers, for the pipeline check); `stop_ids`:
    the token ids that end a turn (`Prepared.stop_ids`); `roster`: the engines of several models by agent
    (`roster_of`)."""
    from astuner.auxiliary import auxiliary_pool
    from astuner.rollout import RolloutRunner, RolloutSettings

    typed = loaded.typed
    configure_tools(typed)
    settings = RolloutSettings.from_config(typed, max_model_len)
    return RolloutRunner(
        settings,
        engine,
        tokenizer,
        workflow_cls,
        judge,
        stop_ids,
        config=loaded.cfg,
        auxiliary=auxiliary_pool(typed) if engine is not None else None,
        roster=roster,
    )


def seed_everything(seed: int) -> None:
    import torch

    random.seed(seed)
    torch.manual_seed(seed)


def quiet_library_progress() -> None:
    """Weight loading and dataset caching draw their own bars; the run has one progress bar of its own."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    if "datasets" in sys.modules:
        from datasets.utils.logging import disable_progress_bar

        disable_progress_bar()
    else:  # importing datasets costs half a second a run that reads no dataset need not pay: it reads this
        os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
