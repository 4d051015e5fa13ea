"""Which config changes a resumed run may carry: the one table, and pure functions over it.

A checkpoint continues the run that wrote it. A key in an *identity* group defines that run (the model, the data,
the episodes and their reward, the algorithm, the seed): changing it and continuing the checkpoint would report
one run's results under another's config, so `astuner.resume` refuses. A key in an *allowed* group only says how
long the run goes, what it logs, when it checkpoints or validates, where it runs and how long it may wait: the
resumed run takes the new value and names it.

Sampling (temperature, top_p, top_k) is an identity key: the policy gradient is computed on samples drawn at that
temperature, so a change is a change of algorithm. The engine (hf | vllm) and every placement key are allowed: a
checkpoint resumes under any strategy, node count or engine (tests/test_ray_backbones.py resumes across them).
A new length is allowed although a cosine or linear learning-rate schedule then stretches to it (README says so).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

# (dotted key prefix, group). The longest matching prefix decides; a group in ALLOWED may change on resume.
KEY_GROUPS: tuple[tuple[str, str], ...] = (
    ("astuner.seed", "the seed (data order, sampling)"),
    ("astuner.model", "the model"),
    ("astuner.trainer_common.lora", "the model"),
    ("astuner.trainer_common.precision", "the model"),
    ("astuner.task_reader", "the data"),
    ("astuner.task_reader.env_service.request_timeout", "deadlines"),
    ("astuner.task_reader.env_service.retries", "deadlines"),
    ("astuner.data", "the data"),
    ("astuner.offline_data", "the data"),
    ("astuner.rollout", "the rollout shape"),
    ("astuner.rollout.engine", "placement"),
    ("astuner.rollout.max_env_worker", "placement"),
    ("astuner.rollout.tensor_model_parallel_size", "placement"),
    ("astuner.rollout.max_num_seqs", "placement"),
    ("astuner.rollout.gpu_memory_utilization", "placement"),
    ("astuner.rollout.episode_timeout", "deadlines"),
    ("astuner.rollout.preflight", "checks"),
    ("astuner.task_judge", "the reward"),
    ("astuner.task_judge.timeout", "deadlines"),
    ("astuner.auxiliary_models", "the rollout shape"),
    ("astuner.trainer_common", "the algorithm"),
    ("astuner.trainer_common.total_epochs", "the run's length"),
    ("astuner.trainer_common.total_training_steps", "the run's length"),
    ("astuner.trainer_common.save_freq", "checkpoints and validation"),
    ("astuner.trainer_common.test_freq", "checkpoints and validation"),
    ("astuner.trainer_common.val_before_train", "checkpoints and validation"),
    ("astuner.trainer_common.val_num_repeat", "checkpoints and validation"),
    ("astuner.trainer_common.resume_mode", "checkpoints and validation"),
    ("astuner.trainer_common.max_idle_steps", "deadlines"),
    ("astuner.trainer_common.watchdog_factor", "deadlines"),
    ("astuner.trainer_common.stage_timeout_s", "deadlines"),
    ("astuner.trainer_common.actor_timeout_s", "deadlines"),
    ("astuner.trainer_common.n_explorers", "placement"),
    ("astuner.trainer_common.trinity_only__n_vllm_engine", "placement"),
    ("astuner.trainer_common.nnodes", "placement"),
    ("astuner.trainer_common.n_gpus_per_node", "placement"),
    ("astuner.trainer_common.strategy", "placement"),
    ("astuner.trainer_common.cpus_per_worker", "placement"),
    ("astuner.trainer_common.micro_batch_token_budget", "placement"),
    ("astuner.trainer_common.gradient_checkpointing", "placement"),
    ("astuner.project_name", "logging"),
    ("astuner.experiment_dir", "logging"),
    ("astuner.logview", "logging"),
    # How stale a sample may be (sync_interval, offset, style, max_staleness) is part of the algorithm.
    ("trinity.synchronizer", "the algorithm"),
    ("trinity.synchronizer.sync_timeout", "deadlines"),
    ("trinity.synchronizer.sync_method", "placement"),
    ("trinity.trainer.max_token_len_per_gpu", "placement"),
)
ALLOWED = frozenset({"the run's length", "logging", "checkpoints and validation", "placement", "deadlines", "checks"})
# A key no prefix covers (verl's native keys, a section added later) refuses: a wrong refusal costs a rerun with
# resume_mode disable, a wrong continuation costs a result that silently belongs to another config.
UNCLASSIFIED = "unclassified (refused to be safe)"


@dataclass(frozen=True)
class Change:
    key: str
    old: Any
    new: Any
    group: str

    @property
    def allowed(self) -> bool:
        return self.group in ALLOWED

    def __str__(self) -> str:
        return f"{self.key} ({_show(self.old)} -> {_show(self.new)}; {self.group})"


def group_of(key: str) -> str:
    best = max((p for p, _ in KEY_GROUPS if key == p or key.startswith(p + ".")), key=len, default=None)
    return dict(KEY_GROUPS)[best] if best is not None else UNCLASSIFIED


def flatten(tree: Mapping, prefix: str = "") -> dict[str, Any]:
    """Dotted leaf keys of a nested mapping; a list (or an empty mapping) is one leaf."""
    out: dict[str, Any] = {}
    for name, value in tree.items():
        key = f"{prefix}{name}"
        if isinstance(value, Mapping) and value:
            out.update(flatten(value, key + "."))
        else:
            out[key] = value
    return out


def config_changes(old: Mapping, new: Mapping, defaults: Mapping[str, Any] | None = None) -> list[Change]:
    """Leaf keys whose value differs between the checkpoint's config `old` and this run's `new`, grouped.

    A key only `new` has (added to astuner since `old` was written) counts as unchanged at its default
    (`defaults`: dotted key -> default): a new key defaults to the behaviour that came before it. A key only
    `old` has no longer exists and acts on nothing."""
    flat_old, flat_new = flatten(old), flatten(new)
    changes = []
    for key in sorted(flat_new):
        value = flat_new[key]
        if key not in flat_old:
            if defaults is not None and key in defaults and defaults[key] == value:
                continue
            changes.append(Change(key, "(absent)", value, group_of(key)))
        elif flat_old[key] != value:
            changes.append(Change(key, flat_old[key], value, group_of(key)))
    return changes


def _show(value: Any) -> str:
    return "null" if value is None else str(value)
