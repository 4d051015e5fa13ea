"""Builders that turn the composed config into the pieces the stages use. Backbones call the ones they need,
in the process where each piece lives; the debug backbone builds all of them here."""

from __future__ import annotations

import inspect
import logging
import os
import random
import sys
from dataclasses import dataclass, field
from pathlib import Path

from astuner.config.derived import run_facts
from astuner.config.schema_models import strategy_of
from astuner.errors import UserError, user_code_error
from astuner.logs import debug_from_user_modules
from astuner.tokenizer import check_same_tokenizer, load_tokenizer, stop_token_ids
from astuner.types import Task
from astuner.workflow import ClassSpecError, Workflow, load_class

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


def load_user_class(spec, base_dir: Path, what: str, key: str, base: type | None = None) -> type:
    if not spec:
        raise UserError(f"{key} is not set: name your {what} as 'pkg.module->Class' or 'path/file.py->Class'")
    try:
        cls = load_class(str(spec), [base_dir])
    except ClassSpecError as exc:
        raise UserError(f"{key}: {exc}") from None
    except Exception as exc:  # the user's module itself raised at import: show their traceback, not ours
        raise user_code_error(f"{key}: your {what} module", _module_file(str(spec), exc), exc) from None
    debug_from_user_modules(sys.modules.get(getattr(cls, "__module__", ""), None))  # its DEBUG: the log file
    if base is not None and not isinstance(cls, type) and inspect.isfunction(cls):
        return cls  # a function workflow or judge: the caller wraps it
    if base is not None and not (isinstance(cls, type) and issubclass(cls, base)):
        raise UserError(f"{key}: {spec!r} is not a subclass of {base.__module__}.{base.__qualname__}")
    return cls


def _module_file(spec: str, exc: BaseException) -> str:
    """The user's file an import error came from: the innermost traceback frame outside astuner, else the spec."""
    import traceback

    frames = [f for f in traceback.extract_tb(exc.__traceback__) if "importlib" not in f.filename
              and not f.filename.startswith(str(Path(__file__).resolve().parent))]
    if isinstance(exc, SyntaxError) and exc.filename:
        return exc.filename
    return frames[0].filename if frames else spec.split("->")[0]


def judge_spec(typed) -> str:
    """judge_protocol, or the environment's own judge (astuner/environments/) when it is left at its default."""
    from astuner.config.schema import TaskJudgeSection
    from astuner.environments import environment_of

    env = environment_of(typed.astuner.task_reader.type)
    spec = typed.astuner.task_judge.judge_protocol
    if env is not None and spec == TaskJudgeSection.model_fields["judge_protocol"].default:
        return env.judge
    return spec


def workflow_spec(typed) -> str | None:
    """agentscope_workflow, or the environment's own workflow when it is null."""
    from astuner.environments import environment_of

    env = environment_of(typed.astuner.task_reader.type)
    spec = typed.astuner.rollout.agentscope_workflow
    return env.workflow if spec is None and env is not None else spec


def build_judge(loaded):
    """The judge of `astuner.task_judge` (user classes resolve against the config's folder; a judge's
    constructor gets the composed config, as the seed's judges expect)."""
    from astuner.task_judge.base_judge import BaseJudge

    section, cfg, base_dir = loaded.typed.astuner.task_judge, loaded.cfg, loaded.config_dir
    if section.combine:
        from astuner.task_judge.shaping import build_combined_judge

        return build_combined_judge(
            section.combine, cfg,
            lambda spec, where: load_user_class(spec, base_dir, "judge", where, BaseJudge))
    key = "astuner.task_judge.judge_protocol"
    judge_cls = load_user_class(judge_spec(loaded.typed), base_dir, "judge", key, BaseJudge)
    if inspect.isfunction(judge_cls):
        from astuner.task_judge.base_judge import FunctionJudge

        return FunctionJudge(judge_cls, cfg)
    try:
        return judge_cls(cfg)
    except UserError:
        raise
    except Exception as exc:
        raise user_code_error(f"{key}: {judge_cls.__qualname__}.__init__ in", inspect.getfile(judge_cls), exc) from None


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


def build_trainer(typed, kind, model_path: str, total_steps: int, micro_batch_tokens: int | None = None,
                  world: int = 1, spec=None, models_in_group: int = 1):
    """The trainer for the algorithm `kind` (RunFacts.algorithm); `micro_batch_tokens`: the memory fit's budget
    (preflight), else the configured one; `world`: the workers of the trainer group it will join (sharded, the
    model then reaches the device as shards only); `spec`: the model's `ModelSpec` (its LoRA rank, learning rate
    and sampling filter; None: the run's first model's); `models_in_group`: the models whose trainers each worker
    of the group holds (config/schema_models.strategy_of)."""
    from astuner.trainer import Trainer

    return Trainer(model_path, trainer_settings(typed, kind, total_steps, micro_batch_tokens, world, spec,
                                                models_in_group))


def trainer_settings(typed, kind, total_steps: int, micro_batch_tokens: int | None = None, world: int = 1,
                     spec=None, models_in_group: int = 1):
    """The TrainerSettings of `build_trainer`; `kind`: the run's algorithm record (RunFacts.algorithm)."""
    from astuner.config.model_set import model_set as configured

    from astuner import preflight
    from astuner.config.effective import effective
    from astuner.trainer.settings import TrainerSettings

    typed = effective(typed)  # keys that do nothing here read their neutral values (config/effective.py)
    tc = typed.astuner.trainer_common
    # The model's settings read through `effective` too (a filter that does nothing here is off).
    spec = configured(typed).first if spec is None else configured(typed)[spec.name]
    settings = TrainerSettings(
        lr=spec.lr,
        weight_decay=tc.optim.weight_decay,
        lr_warmup_steps=tc.optim.lr_warmup_steps,
        lr_scheduler_type=tc.optim.lr_scheduler_type,
        min_lr_ratio=tc.optim.min_lr_ratio,
        total_optimizer_steps=total_steps * preflight.optimizer_steps_per_step(typed),
        ppo_epochs=tc.ppo_epochs,
        reference_model=kind.needs_reference,
        old_logprobs=tc.old_logprobs,
        gradient_checkpointing=tc.gradient_checkpointing,
        shared_prefix_min_tokens=tc.shared_prefix_min_tokens,
        precision=tc.precision,
        lora=lora_settings(tc.lora, spec.lora_rank),
        # The sampling filter shapes the distribution rollouts were drawn from (offline data: no filter).
        top_k=spec.top_k,
        top_p=spec.top_p,
        # Read only where it acts (the start-up warning names it otherwise).
        rollout_is_cap=tc.rollout_is_cap if tc.old_logprobs == "trainer" else None,
        distill_topk=tc.algorithm.distill_topk,
        distill_topk_coef=tc.algorithm.distill_topk_coef,
        loss_mode=tc.policy_loss.loss_mode,
        entropy_coeff=tc.entropy_coeff,
        grad_clip=tc.optim.grad_clip,
        clip_ratio_low=tc.clip_ratio_low,
        clip_ratio_high=tc.clip_ratio_high,
        clip_ratio_c=tc.clip_ratio_c,
        use_kl_loss=tc.use_kl_loss,
        kl_loss_coef=tc.kl_loss_coef,
        kl_loss_type=tc.kl_loss_type,
        beta=tc.algorithm.beta,
        loss_agg_mode=tc.loss_agg_mode,
        norm_length=typed.astuner.rollout.max_response_length_in_one_turn,
        max_token_len_per_micro_batch=micro_batch_tokens or tc.micro_batch_token_budget,
        mini_batch_num=tc.mini_batch_num,
        seed=typed.astuner.seed,
        strategy=strategy_of(typed, models_in_group),
        group_size=world,
    )
    return settings


def lora_settings(section, rank: int | None = None):
    rank = section.rank if rank is None else rank
    if rank == 0:
        return None
    from astuner.trainer.settings import LoraSettings

    targets = section.target_modules if isinstance(section.target_modules, str) else tuple(section.target_modules)
    return LoraSettings(rank=rank, alpha=section.alpha, dropout=section.dropout, target_modules=targets)


def _hf_engine(typed, model_path: str, tokenizer, max_model_len: int, kv_cache_bytes: int | None = None,
               gpu_share: float | None = None):
    from astuner.engine.hf_engine import HFEngine

    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return HFEngine(
        model_path, max_batch_size=typed.astuner.rollout.max_env_worker, seed=typed.astuner.seed, pad_token_id=pad
    )


def _vllm_engine(typed, model_path: str, tokenizer, max_model_len: int, kv_cache_bytes: int | None = None,
                 gpu_share: float | None = None):
    import torch

    from astuner.engine.vllm_engine import VLLMEngine

    device_type = "cuda" if torch.cuda.is_available() else "cpu"  # as the trainer picks its device
    return VLLMEngine(model_path, **vllm_engine_settings(typed, max_model_len, kv_cache_bytes, device_type, gpu_share))


def vllm_engine_settings(typed, max_model_len: int, kv_cache_bytes: int | None, device_type: str,
                         gpu_share: float | None = None) -> dict:
    """VLLMEngine's keyword arguments from the config. The engine computes in the trainer's precision (an fp32
    trainer beside a bf16 engine would fail the preflight's fp32 tolerance); its start deadline allows for the
    engines that may start at once on a node (verl: one per worker; trinity: one per explorer). `gpu_share`: the
    part of the GPU this engine takes (config.derived.gpu_share_per_engine), else rollout.gpu_memory_utilization."""
    from astuner.engine.vllm_engine import engine_dtype, start_timeout_s
    from astuner.trainer.precision import resolve_precision

    r, tc = typed.astuner.rollout, typed.astuner.trainer_common
    return dict(
        max_model_len=max_model_len,
        max_num_seqs=r.max_num_seqs,
        tensor_parallel_size=r.tensor_model_parallel_size,
        gpu_memory_utilization=r.gpu_memory_utilization if gpu_share is None else gpu_share,
        seed=typed.astuner.seed,
        kv_cache_bytes=kv_cache_bytes,
        dtype=engine_dtype(resolve_precision(tc.precision, device_type)),
        start_timeout_s=start_timeout_s(max(tc.n_gpus_per_node, tc.n_explorers)),
    )


# astuner.rollout.engine -> builder(typed config, model_path, tokenizer, max_model_len, kv_cache_bytes, gpu_share)
ENGINES = {"vllm": _vllm_engine, "hf": _hf_engine}


def build_engine(typed, model_path: str, tokenizer, max_model_len: int, kv_cache_bytes: int | None = None, *,
                 engine: str, gpu_share: float | None = None):
    """The rollout engine named `engine` ("vllm" or "hf": config.derived.RunFacts.engine, or a teacher's
    teacher_engine); `kv_cache_bytes`: vLLM's KV cache on CPU as the memory fit sized it (preflight); `gpu_share`:
    vLLM's part of the GPU (None: rollout.gpu_memory_utilization)."""
    from astuner.phase import phase

    with phase(f"starting the {engine} engine ({Path(str(model_path)).name}, max_model_len {max_model_len})"):
        return ENGINES[engine](typed, model_path, tokenizer, max_model_len, kv_cache_bytes, gpu_share)


def load_workflow(loaded):
    """The workflow class named by astuner.rollout.agentscope_workflow (a function is wrapped into one), or the one
    the caller gave in its place (`LoadedConfig.workflow`)."""
    if loaded.workflow is not None:
        return loaded.workflow
    typed = loaded.typed
    workflow_cls = load_user_class(
        workflow_spec(typed), loaded.config_dir, "workflow", "astuner.rollout.agentscope_workflow",
        Workflow,
    )
    if inspect.isfunction(workflow_cls):
        if not inspect.iscoroutinefunction(workflow_cls):
            raise UserError(
                f"astuner.rollout.agentscope_workflow: {workflow_cls.__qualname__} must be 'async def "
                f"{workflow_cls.__name__}(task, model, auxiliary_models)' (it awaits the model); it is a plain function."
            )
        from astuner.workflow import function_workflow

        workflow_cls = function_workflow(workflow_cls)
    if not inspect.iscoroutinefunction(workflow_cls.execute):
        raise UserError(
            f"astuner.rollout.agentscope_workflow: {workflow_cls.__qualname__}.execute must be 'async def execute("
            "self, workflow_task, model_tuner)' (it awaits the model); it is a plain function."
        )
    return workflow_cls


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
    `device_of()` the trainer's `preflight.DeviceFacts` (None: this process's device, where the debug backbone
    trains)."""
    from astuner import preflight
    from astuner.logs import announce
    from astuner.task_reader.sources import DATA_SOURCES

    typed = loaded.typed
    quiet_library_progress()
    configure_tools(typed)
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

        teacher = prepare_teacher(typed, facts.teacher_engine, tokenizer,
                                  lambda: (device_facts or preflight.local_device()).type, max_model_len)
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
    """Settings of astuner's own tools, in every process that runs episodes (and the start-up block)."""
    from astuner.tools.python_exec import allow_unsandboxed

    allow_unsandboxed(typed.astuner.rollout.python_tool_unsandboxed)


def build_runner(loaded, engine, tokenizer, workflow_cls, judge, stop_ids, max_model_len: int, roster=None):
    """The rollout runner over `engine` (None: only its renderer and parsers, for the pipeline check); `stop_ids`:
    the token ids that end a turn (`Prepared.stop_ids`); `roster`: the engines of several models by agent
    (`roster_of`)."""
    from astuner.rollout import RolloutRunner, RolloutSettings

    typed = loaded.typed
    configure_tools(typed)
    return RolloutRunner(
        RolloutSettings.from_config(typed, max_model_len),
        engine,
        tokenizer,
        workflow_cls,
        judge,
        stop_ids,
        config=loaded.cfg,
        auxiliary=_auxiliary_pool(typed) if engine is not None else None,
        roster=roster,
    )


def check_sampling(typed):
    """The rollout's sampling settings, for the preflight logprob check."""
    from astuner.model_tuner.pipeline_check import CheckSampling

    r = typed.astuner.rollout
    return CheckSampling(temperature=r.temperature, top_p=r.top_p, top_k=r.top_k)


def check_token_pipeline(typed, runner, logprob_check) -> None:
    """The preflight table (template, parsers, engine/trainer logprobs); raises UserError when strict and broken."""
    from astuner.model_tuner.pipeline_check import run_preflight

    run_preflight(typed.astuner.rollout.preflight, runner.renderer, runner.chat_format, runner.parser,
                  runner.reasoning_parser, runner.stop_texts(), logprob_check)


def seed_everything(seed: int) -> None:
    import torch

    random.seed(seed)
    torch.manual_seed(seed)


def roster_of(typed, models, engines: dict):
    """Which engine serves each named agent (astuner.agents); `engines`: {model name: its engine} over the
    `ModelSet` `models`, the first model's first. None for a one-model run without named agents."""
    if len(engines) == 1 and not typed.astuner.agents:
        return None
    from astuner.model_tuner.roster import Roster

    return Roster(dict(engines),
                  {agent: (entry.model, entry.trainable) for agent, entry in typed.astuner.agents.items()},
                  {spec.name: spec.own_sampling for spec in models if spec.name in engines})


def _auxiliary_pool(typed):
    """The auxiliary models (astuner.auxiliary_models), checked and loaded; None when there are none."""
    if not typed.astuner.auxiliary_models:
        return None
    from astuner import preflight
    from astuner.auxiliary import AuxiliaryPool

    return AuxiliaryPool.build(
        typed, lambda path: preflight.resolve_max_model_len(None, preflight.read_model_facts(path, "auxiliary model")))


def quiet_library_progress() -> None:
    """Weight loading and dataset caching draw their own bars; the run has one progress bar of its own."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    if "datasets" in sys.modules:
        from datasets.utils.logging import disable_progress_bar

        disable_progress_bar()
    else:  # importing datasets costs half a second a run that reads no dataset need not pay: it reads this
        os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
