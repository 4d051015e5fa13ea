"""Which config keys act only under some setting, so that setting one where it does nothing gets a warning.

No key may be silently ignored: a user who tunes `max_num_seqs` while running the hf engine, or `kl_loss_coef`
with the KL loss off, is told once, at start, that it does nothing there. The same rules mark the keys in the
generated default YAML ("[only ...]"), and the test that every key is read accepts exactly these as unread.
A key's old name (schema.old_name) follows the rules of the key it now names, and setting it gets one notice.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from astuner.algorithm.catalog import ALGORITHMS, algorithm, offline_types, spoken, types_reading
from astuner.config.backbones import backbone, names_where
from astuner.config.derived import resolve_engine_name, staleness_bound
from astuner.config.loaded import LoadedConfig
from astuner.config.schema import old_names

OFFLINE_TYPES = offline_types()  # trained on astuner.offline_data, no rollouts
# What only rollouts and the policy-gradient loss read, and what an offline run still reads among them.
ROLLOUT_ONLY = ("astuner.rollout.", "astuner.task_reader.", "astuner.task_judge.", "astuner.auxiliary_models",
                "astuner.trainer_common.algorithm.adv_estimator", "astuner.trainer_common.algorithm.norm_adv",
                "astuner.trainer_common.algorithm.epsilon", "astuner.trainer_common.algorithm.filter_groups",
                "astuner.trainer_common.algorithm.rft_reward_threshold", "astuner.trainer_common.clip_ratio",
                "astuner.trainer_common.policy_loss", "astuner.trainer_common.ppo_epochs",
                "astuner.trainer_common.entropy_coeff", "astuner.trainer_common.val_num_repeat",
                "astuner.trainer_common.use_kl_loss", "astuner.trainer_common.kl_loss",
                "astuner.trainer_common.old_logprobs", "astuner.trainer_common.rollout_is_cap")
OFFLINE_READS = ("astuner.rollout.max_model_len", "astuner.rollout.tool_prompt")

# Key (or a section: everything under it) -> (where it acts, in words; predicate(typed config, backbone) -> acts).
Rule = tuple[str, Callable[[Any, str], bool]]


def _vllm(typed) -> bool:
    return resolve_engine_name(typed.astuner.rollout.engine) == "vllm"


def _on_ray(b: str) -> bool:
    return backbone(b).on_ray


def _explorers(b: str) -> bool:
    return backbone(b).explorers


_RAY = "with backbone " + " or ".join(names_where("on_ray"))
_EXPLORERS = "with backbone " + " or ".join(names_where("explorers"))


def _stale(typed) -> bool:
    sync = typed.trinity.synchronizer
    return staleness_bound(sync.sync_interval, sync.sync_offset, sync.max_staleness) > 0


APPLIES_ONLY_WITH: dict[str, Rule] = {
    "astuner.rollout.tensor_model_parallel_size": ("with engine vllm", lambda c, b: _vllm(c)),
    "astuner.rollout.max_num_seqs": ("with engine vllm", lambda c, b: _vllm(c)),
    "astuner.rollout.gpu_memory_utilization": ("with engine vllm", lambda c, b: _vllm(c)),
    "astuner.trainer_common.n_explorers": (_EXPLORERS, lambda c, b: _explorers(b)),
    "astuner.trainer_common.trainer_groups": (
        f"{_EXPLORERS} and astuner.models", lambda c, b: _explorers(b) and bool(c.astuner.models)),
    "trinity.synchronizer": (_EXPLORERS, lambda c, b: _explorers(b)),
    "astuner.trainer_common.nnodes": (_RAY, lambda c, b: _on_ray(b)),
    "astuner.trainer_common.n_gpus_per_node": (_RAY, lambda c, b: _on_ray(b)),
    "astuner.trainer_common.strategy": (_RAY, lambda c, b: _on_ray(b)),
    "astuner.trainer_common.cpus_per_worker": (_RAY, lambda c, b: _on_ray(b)),
    "astuner.trainer_common.actor_timeout_s": (_RAY, lambda c, b: _on_ray(b)),
    "astuner.trainer_common.lora.alpha": ("with lora.rank > 0", lambda c, b: c.astuner.trainer_common.lora.rank > 0),
    "astuner.trainer_common.lora.dropout": ("with lora.rank > 0", lambda c, b: c.astuner.trainer_common.lora.rank > 0),
    "astuner.trainer_common.lora.target_modules": (
        "with lora.rank > 0", lambda c, b: c.astuner.trainer_common.lora.rank > 0),
    "astuner.task_reader.jsonl_dataset_file": (
        "with task_reader.type jsonl_dataset_file", lambda c, b: c.astuner.task_reader.type == "jsonl_dataset_file"
    ),
    "astuner.task_reader.env_service": (
        "with task_reader.type env_service", lambda c, b: c.astuner.task_reader.type == "env_service"
    ),
    "astuner.task_reader.reasoning_gym": (
        "with task_reader.type reasoning_gym", lambda c, b: c.astuner.task_reader.type == "reasoning_gym"
    ),
    "astuner.task_reader.textarena": (
        "with task_reader.type textarena", lambda c, b: c.astuner.task_reader.type == "textarena"
    ),
    "astuner.task_reader.openenv": (
        "with task_reader.type openenv", lambda c, b: c.astuner.task_reader.type == "openenv"
    ),
    "astuner.task_reader.verifiers": (
        "with task_reader.type verifiers", lambda c, b: c.astuner.task_reader.type == "verifiers"
    ),
    "astuner.task_reader.huggingface_dat_repo": (
        "with task_reader.type huggingface_dat_repo",
        lambda c, b: c.astuner.task_reader.type == "huggingface_dat_repo",
    ),
    "astuner.task_judge.judge_protocol": ("with task_judge.combine empty", lambda c, b: not c.astuner.task_judge.combine),
    "astuner.trainer_common.kl_loss_coef": ("with use_kl_loss true", lambda c, b: c.astuner.trainer_common.use_kl_loss),
    "astuner.trainer_common.kl_loss_type": ("with use_kl_loss true", lambda c, b: c.astuner.trainer_common.use_kl_loss),
    "astuner.trainer_common.algorithm.epsilon": (
        "with adv_estimator grpo and norm_adv_by_std_in_grpo true",
        lambda c, b: c.astuner.trainer_common.algorithm.adv_estimator == "grpo"
        and c.astuner.trainer_common.algorithm.norm_adv_by_std_in_grpo,
    ),
    "astuner.trainer_common.algorithm.norm_adv_by_std_in_grpo": (
        "with adv_estimator grpo", lambda c, b: c.astuner.trainer_common.algorithm.adv_estimator == "grpo"
    ),
    "astuner.trainer_common.algorithm.filter_groups.metric": (
        "with filter_groups.enable true", lambda c, b: c.astuner.trainer_common.algorithm.filter_groups.enable
    ),
    "astuner.trainer_common.algorithm.filter_groups.max_num_gen_batches": (
        "with filter_groups.enable true", lambda c, b: c.astuner.trainer_common.algorithm.filter_groups.enable
    ),
    "astuner.trainer_common.rollout_is_cap": (
        "with old_logprobs trainer, or backbone trinity with a staleness bound above 0",
        lambda c, b: c.astuner.trainer_common.old_logprobs == "trainer" or (_explorers(b) and _stale(c)),
    ),
    "astuner.trainer_common.clip_ratio_c": (
        "with policy_loss.loss_mode vanilla",
        lambda c, b: c.astuner.trainer_common.policy_loss.loss_mode == "vanilla",
    ),
    "astuner.trainer_common.optim.min_lr_ratio": (
        "with lr_scheduler_type cosine or linear",
        lambda c, b: c.astuner.trainer_common.optim.lr_scheduler_type in ("cosine", "linear"),
    ),
    "astuner.rollout.summary_max_tokens": ("with rollout.context_policy summarize or subagent",
                                           lambda c, b: c.astuner.rollout.context_policy in ("summarize", "subagent")),
}


def _teacher(c, kind: str) -> bool:
    """On-policy distillation's teacher is a model folder (kind "model") or a server ("base_url")."""
    teaches = algorithm(c.astuner.trainer_common.algorithm.type).has_teacher
    return teaches and getattr(c.astuner.teacher, kind) is not None


# Before the catalog's rule for the whole section (the first rule that matches a key is its rule).
APPLIES_ONLY_WITH.update({
    **{f"astuner.teacher.{k}": ("with algorithm.type on_policy_distillation and teacher.base_url",
                                lambda c, b: _teacher(c, "base_url")) for k in ("api", "served_model", "api_key_env")},
    "astuner.teacher.batch_size": ("with algorithm.type on_policy_distillation, teacher.base_url and api openai",
                                   lambda c, b: _teacher(c, "base_url") and c.astuner.teacher.api == "openai"),
    "astuner.teacher.engine": ("with algorithm.type on_policy_distillation and teacher.model",
                               lambda c, b: _teacher(c, "model")),
})


def _algorithm_rule(key: str) -> Rule:
    kinds = types_reading(key)
    return (f"with algorithm.type {spoken(kinds)}", lambda c, b: c.astuner.trainer_common.algorithm.type in kinds)


# Keys that act only under some algorithm types: the catalog's `reads` (astuner/algorithm/catalog.py).
APPLIES_ONLY_WITH.update({key: _algorithm_rule(key) for a in ALGORITHMS.values() for key in a.reads})


def _rule_for(key: str) -> Rule | None:
    key = old_names().get(key, key)
    for scope, rule in APPLIES_ONLY_WITH.items():
        if key == scope or key.startswith(scope + "."):
            return rule
    return None


def rule_note(key: str) -> str | None:
    """'with engine vllm' for a key that acts only there; None for a key that always acts."""
    rule = _rule_for(key)
    return rule[0] if rule else None


def key_is_inactive(key: str, typed: Any, backbone: str) -> bool:
    rule = _rule_for(key)
    return rule is not None and not rule[1](typed, backbone)


def inapplicable_keys(loaded: LoadedConfig, backbone: str) -> list[str]:
    """User-set keys (sorted) that have no effect with `backbone` and the rest of this config."""
    return [k for k in sorted(loaded.user_keys) if key_is_inactive(k, loaded.typed, backbone)]


def old_name_notice(key: str) -> str:
    return f"{key} is an old name: use {old_names()[key]}."


def format_inapplicable_warning(keys: list[str], backbone: str, engine: str) -> str | None:
    """One message naming every key in `keys` and where it would act; None when `keys` is empty."""
    if not keys:
        return None
    parts = [f"{key} (acts only {rule_note(key) or 'elsewhere'})" for key in keys]
    noun = "key has" if len(keys) == 1 else f"{len(keys)} keys have"
    return (
        f"config {noun} no effect with backbone '{backbone}', engine '{engine}' and the rest of this config, and "
        f"will be ignored: {', '.join(parts)}. Remove them, or change the setting they depend on."
    )


def config_warnings(loaded: LoadedConfig, backbone: str) -> list[str]:
    """Every start-up warning about the config: keys with no effect, and settings that defeat training."""
    typed = loaded.typed
    out = [old_name_notice(key) for key in sorted(loaded.user_keys) if key in old_names()]
    inapplicable = format_inapplicable_warning(inapplicable_keys(loaded, backbone), backbone,
                                               resolve_engine_name(typed.astuner.rollout.engine))
    if inapplicable:
        out.append(inapplicable)
    if typed.astuner.rollout.num_repeat == 1:
        out.append(
            "astuner.rollout.num_repeat is 1: GRPO compares the episodes of a task with each other, so with one "
            "episode per task there is no baseline, every advantage is 0 and nothing is learned; use 2 or more "
            "(4-16 is common)."
        )
    tc = typed.astuner.trainer_common
    if tc.algorithm.type in OFFLINE_TYPES:
        unused = [k for k in sorted(loaded.user_keys)
                  if k.startswith(ROLLOUT_ONLY) and not k.startswith(OFFLINE_READS)]
        if unused:
            out.append(
                f"algorithm.type {tc.algorithm.type} trains on astuner.offline_data without rollouts, so these keys "
                f"have no effect: {', '.join(unused)}."
            )
    if not algorithm(tc.algorithm.type).mini_batches and "astuner.trainer_common.mini_batch_num" in loaded.user_keys:
        out.append(f"algorithm.type {tc.algorithm.type} takes one optimizer step per batch, so "
                   "astuner.trainer_common.mini_batch_num has no effect; lower data.train_batch_size for smaller steps.")
    if tc.algorithm.adv_estimator == "dr_grpo" and tc.loss_agg_mode != "seq-mean-token-sum-norm":
        out.append(
            f"adv_estimator dr_grpo runs with loss_agg_mode {tc.loss_agg_mode}: Dr. GRPO's second half is the "
            "length-unbiased aggregation; set astuner.trainer_common.loss_agg_mode: seq-mean-token-sum-norm."
        )
    if tc.policy_loss.loss_mode == "gspo" and max(tc.clip_ratio_low, tc.clip_ratio_high) > 0.01:
        out.append(
            f"policy_loss.loss_mode gspo with clip ratios {tc.clip_ratio_low:g} / {tc.clip_ratio_high:g}: the GSPO "
            "ratio is a per-sequence geometric mean and stays close to 1, so token-level ranges barely ever clip; "
            "the GSPO paper uses clip_ratio_low 3e-4 and clip_ratio_high 4e-4."
        )
    return out
