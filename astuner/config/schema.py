"""The config schema: every key's type, range, default and documentation, in one place.

The packaged default YAMLs (`default_config/*.yaml`) are generated from these models (`python -m
astuner.config.default_yaml --write`; a test fails when they drift), so the Hydra defaults, the validator and the
typed object each stage receives cannot disagree. After composing, `RunConfig.model_validate(tree)` checks types
strictly (`2.5` is not an int, `"abc"` is not a number, `true` is not an int) and ranges, and the stages read the
resulting frozen objects: `loaded.typed.astuner.rollout.num_repeat` is an int >= 1, no casting anywhere.
A renamed key keeps its old name as an `old_name` field, so configs written for it still load.

Everything is imported from here. The sections an episode needs (model, task reader, data, rollout, task judge)
are declared in `schema_episode.py`, the trainer's in `schema_trainer.py`, the key helpers in `schema_keys.py`; the
rest, and the root `RunConfig`, below.

Imports only pydantic, so `astuner --help` stays fast.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Literal, Optional

from astuner.config.schema_episode import (
    CombineItem,
    DataSection,
    EnvServiceReader,
    HfReader,
    JsonlFile,
    JsonlReader,
    JsonlValidation,
    ModelSection,
    MultiTurn,
    RolloutSection,
    TaskJudgeSection,
    TaskReaderSection,
)
from astuner.config.schema_keys import Section, key, old_name, section
from astuner.config.schema_models import AgentEntry, ModelEntry, TeacherSection
from astuner.config.schema_trainer import (
    LOSS_AGG_MODES,
    AlgorithmSection,
    FilterGroups,
    LoraSection,
    OptimSection,
    PolicyLossSection,
    TrainerCommonSection,
)

__all__ = [
    "LOSS_AGG_MODES",
    "AgentEntry",
    "ModelEntry",
    "AlgorithmSection",
    "AstunerSection",
    "AuxiliaryModelSection",
    "CombineItem",
    "DataSection",
    "EnvServiceReader",
    "FilterGroups",
    "HfReader",
    "JsonlFile",
    "JsonlReader",
    "JsonlValidation",
    "LogviewSection",
    "LoraSection",
    "ModelSection",
    "MultiTurn",
    "OfflineDataSection",
    "OptimSection",
    "PolicyLossSection",
    "RolloutSection",
    "RunConfig",
    "Section",
    "TaskJudgeSection",
    "TaskReaderSection",
    "TrainerCommonSection",
    "TrinitySection",
    "TrinitySynchronizer",
    "TrinityTrainer",
    "VerlSection",
    "key",
    "old_name",
    "old_names",
    "section",
]


class AuxiliaryModelSection(Section):
    model_path: Optional[str] = key(None, "Served by astuner: a local model folder (a second engine, frozen).")
    base_url: Optional[str] = key(None, "Or an OpenAI-compatible endpoint, e.g. http://127.0.0.1:8000/v1.")
    api_key_env: Optional[str] = key(None, "Environment variable holding the endpoint's key (never logged or saved).")
    model_name: Optional[str] = key(None, "Model name sent to the endpoint; null: the key of this entry.")
    temperature: float = key(0.0, "Sampling temperature of its calls (0: greedy).", ge=0)
    max_tokens: int = key(512, "Max new tokens of one call.", ge=1)
    timeout: float = key(120.0, "Seconds one endpoint call may take (with retries inside it).", gt=0)


class OfflineDataSection(Section):
    train_file: Optional[str] = key(
        None,
        'For algorithm.type sft, dpo, orpo: a .jsonl (or .json, .parquet) of conversations. sft: {"messages": '
        '[...], "tools": [...]} (OpenAI chat messages, tool calls and tool results included; loss on assistant '
        'tokens only). dpo, orpo: {"prompt": [...], "chosen": [...], "rejected": [...]} (message lists, as in TRL).',
    )
    val_file: Optional[str] = key(None, "Same format; its loss is logged every test_freq steps (val/loss).")


class LogviewSection(Section):
    port: int = key(
        0, "Port of the log viewer that --with-logview starts on 127.0.0.1; 0: any free port (the URL is printed).",
        ge=0, le=65535,
    )


class AstunerSection(Section):
    project_name: str = key("astuner_project", "Name of the run, shown in logs, tensorboard and the summary.")
    experiment_dir: Optional[str] = key(
        None, "Output folder. null: launcher_record/<name of the YAML file without .yaml>, relative to the working "
        "directory."
    )
    seed: int = key(42, "Seed for data order, sampling and model init of anything random.")
    model: ModelSection = section(ModelSection)
    task_reader: TaskReaderSection = section(TaskReaderSection)
    data: DataSection = section(DataSection)
    rollout: RolloutSection = section(RolloutSection)
    task_judge: TaskJudgeSection = section(TaskJudgeSection)
    trainer_common: TrainerCommonSection = section(TrainerCommonSection)
    auxiliary_models: dict[str, AuxiliaryModelSection] = key(
        {},
        "Frozen models the workflow and judge may call (e.g. an LLM judge), by name: {judge: {model_path: ...}} "
        "or {judge: {base_url: ..., api_key_env: OPENAI_API_KEY, model_name: ...}}. Function workflows and judges "
        "get them as `auxiliary_models`, class workflows as `model_tuner.auxiliary_models`; never trained, their "
        "calls are logged as aux/<name>/... metrics.",
    )
    models: dict[str, ModelEntry] = key(
        {},
        "Trained models beside the policy (astuner.model, named `policy`), by name: {critic: {path: ...}}. Each "
        "has its own engine, trainer, optimizer, checkpoint folder (global_step_N/<name>/, the policy's too) and "
        "metrics (model/<name>/actor/..., the policy's too); an agent's calls train only the model that served "
        "them. Every backbone (on verl and trinity each worker holds every model; strategy ddp); the models share "
        "the policy's tokenizer.",
    )
    agents: dict[str, AgentEntry] = key(
        {},
        "Which model serves each named agent (`model_tuner.for_agent(name)`): {planner: {model: critic}}, and "
        "whether its calls train (trainable). An agent not listed is served by `policy`. A function workflow "
        "then gets {agent: its model} as `model`.",
    )
    teacher: TeacherSection = section(
        TeacherSection, "The teacher of algorithm.type on_policy_distillation: it scores every token the student "
        "sampled, in the exact context the student saw (astuner/algorithm/distillation.py).")
    offline_data: OfflineDataSection = section(
        OfflineDataSection, "Demonstrations or preference pairs for algorithm.type sft, dpo, orpo (no rollouts)."
    )
    logview: LogviewSection = section(
        LogviewSection, "The trajectory and metrics viewer (--with-logview; `astuner logview PATH` for a finished run)."
    )


# --- trinity / verl -----------------------------------------------------------------------------------------


class TrinityTrainer(Section):
    max_token_len_per_gpu: int = old_name("astuner.trainer_common.micro_batch_token_budget", 13000, ge=1)


class TrinitySynchronizer(Section):
    sync_interval: int = key(
        1, "Trainer steps between weight syncs to the explorers (fixed style). 1 with sync_offset 0: on-policy, "
        "the same steps as the debug and verl backbones.", ge=1)
    sync_offset: int = key(
        0, "Extra batches the explorers may roll out ahead of the trainer, on older weights (1 with sync_interval "
        "1: one-step off-policy; rollout of step s+1 overlaps training of step s).", ge=0)
    sync_style: Literal["fixed", "dynamic_by_explorer"] = key(
        "fixed", "fixed: sync after every sync_interval-th trainer step | dynamic_by_explorer: sync only when an "
        "explorer's next batch would be staler than max_staleness.")
    sync_timeout: float = key(1200.0, "Deadline (seconds) of one weight sync to an explorer.", gt=0)
    sync_method: Literal["object_store"] = key(
        "object_store", "How weights reach the explorers: object_store, the only method implemented, sends them "
        "through Ray's object store (shared memory on a node, Ray's transfer between nodes).",
        refused="only object_store is implemented (it sends the trainer's weights to the explorers through Ray's "
        "object store: shared memory on a node, Ray's transfer between nodes); Trinity-RFT's nccl, checkpoint and "
        "memory are not, so set object_store or remove the key")
    max_staleness: Optional[int] = key(
        None, "Bound on a sample's staleness (trainer step - 1 - the policy version that generated it); an "
        "explorer waits for new weights rather than exceed it. null: sync_interval - 1 + sync_offset.", ge=0)


class TrinitySection(Section):
    trainer: TrinityTrainer = section(TrinityTrainer)
    synchronizer: TrinitySynchronizer = section(
        TrinitySynchronizer, "When the trinity backbone's explorers get new weights. Samples rolled out on older "
        "weights than the trainer's are corrected: old logprobs recomputed by the trainer, each token weighted by "
        "min(pi_old / pi_behaviour, rollout_is_cap).")


class VerlSection(Section):
    pass


class RunConfig(Section):
    astuner: AstunerSection = section(AstunerSection)
    trinity: TrinitySection = section(TrinitySection)
    verl: VerlSection = section(VerlSection)


@lru_cache(maxsize=1)
def old_names() -> dict[str, str]:
    """{old dotted key: the key it now names}, read from the schema's `old_name` fields. Do not mutate."""
    out: dict[str, str] = {}

    def walk(cls: type[Section], prefix: str) -> None:
        for name, info in cls.model_fields.items():
            path = f"{prefix}.{name}" if prefix else name
            if isinstance(info.annotation, type) and issubclass(info.annotation, Section):
                walk(info.annotation, path)
            elif isinstance(info.json_schema_extra, dict) and "old_name_of" in info.json_schema_extra:
                out[path] = str(info.json_schema_extra["old_name_of"])

    walk(RunConfig, "")
    return out
