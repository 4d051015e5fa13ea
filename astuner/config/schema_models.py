"""The model roster: the trained models beside the policy (`astuner.models`) and which model serves each named
agent (`astuner.agents`). Declared here, imported by `schema.py`; `roster_problems` checks the names.

A run with neither key trains one model, `policy` (`astuner.model`), as it always did. Imports only pydantic.
"""

from __future__ import annotations

import re
from typing import Literal, Optional

from astuner.config.schema_keys import Section, key

POLICY = "policy"  # the name of the model `astuner.model` configures
_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_-]{0,63}$")  # a model name is a folder of every checkpoint


class ModelEntry(Section):
    path: Optional[str] = key(None, "The model: a local Hugging Face folder, a hub id in the local cache, or a "
                              'checkpoint folder (for example an `astuner sft` output). Required.')
    lora_rank: Optional[int] = key(None, "LoRA rank of this model (0: full fine-tuning); null: "
                                   "astuner.trainer_common.lora.rank.", ge=0)
    lr: Optional[float] = key(None, "Learning rate of this model's optimizer; null: astuner.trainer_common.optim.lr.",
                              gt=0)
    # Sampling of this model's calls in training rollouts (validation stays greedy); its trainer's logprobs take
    # the same top_p / top_k filter, as the policy's take the rollout's.
    temperature: Optional[float] = key(None, "Sampling temperature of this model's calls; null: "
                                       "astuner.rollout.temperature.", gt=0)
    top_p: Optional[float] = key(None, "Top-p of this model's calls; null: astuner.rollout.top_p.", gt=0, le=1)
    top_k: Optional[int] = key(None, "Top-k of this model's calls (0: off); null: astuner.rollout.top_k.", ge=0)


class AgentEntry(Section):
    model: str = key(POLICY, "The model that serves this agent's calls: `policy` or a name of astuner.models.")
    trainable: bool = key(True, "False: the agent's calls are served and recorded, never trained on.")


class TeacherSection(Section):
    model: Optional[str] = key(None, "The teacher as a model folder (Hugging Face, a hub id in the local cache, or a "
                               "checkpoint such as global_step_N): loaded in the process that runs the loop, never "
                               "trained. Its tokenizer must be the student's.")
    base_url: Optional[str] = key(None, "The teacher as an OpenAI-compatible server that returns prompt logprobs "
                                  "(`vllm serve`: /v1/completions with echo and logprobs), e.g. "
                                  "http://host:8000/v1. Set model or base_url, not both.")
    api: Literal["openai", "tinker"] = key("openai", "base_url: openai (/v1/completions with echo and logprobs, as "
                                           "vLLM serves) | tinker (a Tinker API server, `astuner serve` or Tinker: "
                                           "a sampler's compute_logprobs; pip install tinker).")
    served_model: Optional[str] = key(None, "base_url: the model the server serves: openai: the request's `model` "
                                      "(null: the first of its /v1/models) | tinker: a tinker:// path of sampler "
                                      "weights or a base model's name (required).")
    api_key_env: str = key("TEACHER_API_KEY", "base_url: the environment variable that holds the server's key "
                           "(sent as a bearer token); unset: no key is sent.")
    engine: Optional[Literal["hf", "vllm"]] = key(None, "model: the engine that scores with it; null: "
                                                  "astuner.rollout.engine's.")
    timeout_s: float = key(120.0, "Deadline of one scoring request (base_url) or batch (model), in seconds; an "
                           "episode its teacher could not score is flagged failed (not trained, not a zero).", gt=0)
    batch_size: int = key(8, "Sequences the teacher scores per request.", ge=1)


def teacher_problems(typed) -> list[tuple[str, str]]:
    """(dotted key, message) when on-policy distillation has no teacher, or two, or nothing to train."""
    from astuner.algorithm.catalog import algorithm

    algo = typed.astuner.trainer_common.algorithm
    if not algorithm(algo.type).has_teacher:
        return []
    teacher = typed.astuner.teacher
    if (teacher.model is None) == (teacher.base_url is None):
        return [("astuner.teacher", "algorithm.type on_policy_distillation needs one teacher: set "
                 "astuner.teacher.model (a model folder) or astuner.teacher.base_url (a server returning prompt "
                 "logprobs), not " + ("both" if teacher.model else "neither"))]
    if teacher.api == "tinker" and teacher.base_url and not teacher.served_model:
        return [("astuner.teacher.served_model", "astuner.teacher.api tinker needs served_model: a tinker:// path of "
                 "sampler weights or a base model's name")]
    if algo.distill_kl_coef == 0 and algo.distill_reward_weight == 0:
        return [("astuner.trainer_common.algorithm.distill_kl_coef", "distill_kl_coef and distill_reward_weight are "
                 "both 0: the step would train on nothing; set distill_kl_coef > 0 (the teacher's signal)")]
    if algo.distill_teacher_temperature != 1 and not algo.distill_topk:
        return [("astuner.trainer_common.algorithm.distill_teacher_temperature", "distill_teacher_temperature "
                 f"{algo.distill_teacher_temperature} needs the teacher's top k to renormalise over: set distill_topk "
                 "(8 is plenty), or leave the temperature at 1")]
    return []


def roster_problems(models: dict, agents: dict) -> list[tuple[str, str]]:
    """(dotted key, message) for every model or agent name that is wrong: a reserved or unusable model name, a
    model entry without a path, an agent served by a model the roster does not have."""
    problems: list[tuple[str, str]] = []
    known = [POLICY, *models]
    for name, entry in models.items():
        where = f"astuner.models.{name}"
        if name == POLICY:
            problems.append((where, f"'{where}': the name 'policy' is astuner.model's; give this model another name"))
        elif not _NAME.match(name):
            problems.append((where, f"'{where}': a model name starts with a letter and holds only letters, digits, "
                             "'_' and '-' (it names a folder of each checkpoint)"))
        if entry.path is None:
            problems.append((f"{where}.path", f"'{where}.path' is not set: name the model's folder"))
    for agent, entry in agents.items():
        if entry.model not in known:
            where = f"astuner.agents.{agent}.model"
            problems.append((where, f"'{where}' is {entry.model!r}, which is not a model of this run; the models "
                             f"are: {', '.join(known)}"))
    return problems


def shared_trainer_group(typed, backbone: str) -> bool:
    """Whether one trainer group holds every model of a run of several (verl always; trinity with
    trainer_groups: one), rather than a group per model."""
    from astuner.config.backbones import backbone as record

    return bool(typed.astuner.models) and (not record(backbone).explorers
                                           or typed.astuner.trainer_common.trainer_groups == "one")


def strategy_of(typed, models_in_group: int = 1) -> str:
    """trainer_common.strategy as the trainers of a group holding `models_in_group` models take it: `auto` is ddp
    when there are several (each worker then holds a replica of every model's trainer; they are not sharded)."""
    strategy = typed.astuner.trainer_common.strategy
    return "ddp" if strategy == "auto" and models_in_group > 1 else strategy
