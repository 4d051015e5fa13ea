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

Path-valued keys (`PATH_KEYS`) are compared as the files they name, found as the run finds them (the working
directory and the YAML's folder, in the reader's order): `data/train.jsonl`, `./data/train.jsonl` and its absolute
path are one file. A saved config records the working directory it was composed in, so an old relative path is
resolved where that run resolved it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
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
    ("astuner.data.val_max_samples", "checkpoints and validation"),
    ("astuner.offline_data", "the data"),
    ("astuner.rollout", "the rollout shape"),
    ("astuner.rollout.engine", "placement"),
    ("astuner.rollout.max_env_worker", "placement"),
    ("astuner.rollout.tensor_model_parallel_size", "placement"),
    ("astuner.rollout.max_num_seqs", "placement"),
    ("astuner.rollout.gpu_memory_utilization", "placement"),
    ("astuner.rollout.episode_timeout", "deadlines"),
    ("astuner.rollout.env_timeout", "deadlines"),
    ("astuner.rollout.env_retries", "deadlines"),
    ("astuner.rollout.preflight", "checks"),
    ("astuner.task_judge", "the reward"),
    ("astuner.task_judge.timeout", "deadlines"),
    ("astuner.auxiliary_models", "the rollout shape"),
    ("astuner.models", "the models trained"),
    ("astuner.agents", "the rollout shape"),
    # Who the student imitates (its folder, server or served name) is the objective; its engine, batch size, key
    # variable and deadline are not.
    ("astuner.teacher", "the teacher"),
    ("astuner.teacher.engine", "placement"),
    ("astuner.teacher.batch_size", "placement"),
    ("astuner.teacher.api_key_env", "placement"),
    ("astuner.teacher.timeout_s", "deadlines"),
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
    ("astuner.trainer_common.trainer_groups", "placement"),
    ("astuner.trainer_common.cpus_per_worker", "placement"),
    ("astuner.trainer_common.micro_batch_token_budget", "placement"),
    ("astuner.trainer_common.gradient_checkpointing", "placement"),
    ("astuner.trainer_common.shared_prefix_min_tokens", "placement"),
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


# Keys holding a file or folder, and where a relative one is looked for, in order (as task_reader/base.py,
# hf_reader.py, workflow.load_class and from_pretrained look). "auxiliary_models.*" and "models.*" match any
# entry's name.
PATH_KEYS: dict[str, tuple[str, ...]] = {
    "astuner.model.path": ("cwd",),
    "astuner.task_reader.jsonl_dataset_file.training.file_path": ("cwd", "yaml"),
    "astuner.task_reader.jsonl_dataset_file.validation.file_path": ("cwd", "yaml"),
    "astuner.task_reader.huggingface_dat_repo.dataset_path": ("cwd", "yaml"),
    "astuner.offline_data.train_file": ("cwd", "yaml"),
    "astuner.offline_data.val_file": ("cwd", "yaml"),
    "astuner.rollout.agentscope_workflow": ("yaml", "cwd"),
    "astuner.task_judge.judge_protocol": ("yaml", "cwd"),
    "astuner.auxiliary_models.*.model_path": ("cwd",),
    "astuner.models.*.path": ("cwd",),
    "astuner.teacher.model": ("cwd",),
}


@dataclass(frozen=True)
class Bases:
    """Where a run resolved its relative paths: its working directory and its YAML's folder."""

    cwd: Path
    yaml_dir: Path


def _path_order(key: str) -> tuple[str, ...] | None:
    parts = key.split(".")
    if len(parts) == 4 and parts[:2] in (["astuner", "auxiliary_models"], ["astuner", "models"]):
        key = ".".join([*parts[:2], "*", parts[3]])
    return PATH_KEYS.get(key)


def resolved_path(key: str, value: Any, bases: Bases) -> Any:
    """`value` of a path key as the absolute file it names when that exists (a `file.py->Class` spec keeps its
    class); any other value, or a path that exists nowhere (a hub id, a demo model), as given."""
    order = _path_order(key)
    if order is None or not isinstance(value, str) or not value:
        return value
    target, arrow, rest = value.rpartition("->") if "->" in value else (value, "", "")
    target = target.strip()
    if arrow and not (target.endswith(".py") or target.endswith(".pkl") or "/" in target):
        return value  # a module name, not a file
    path = Path(target).expanduser()
    roots = {"cwd": bases.cwd, "yaml": bases.yaml_dir}
    for candidate in [path] if path.is_absolute() else [roots[r] / path for r in order]:
        if candidate.exists():
            return f"{candidate.resolve()}{arrow}{rest.strip() if arrow else ''}"
    return value


@dataclass(frozen=True)
class Change:
    key: str
    old: Any
    new: Any
    group: str
    default_changed: bool = False  # this run did not set the key: it runs at a default that differs from `old`

    @property
    def allowed(self) -> bool:
        return self.group in ALLOWED

    def __str__(self) -> str:
        why = f"{self.group}; the default changed, set {self.key}={_show(self.old)} to keep it" \
            if self.default_changed else self.group
        return f"{self.key} ({_show(self.old)} -> {_show(self.new)}; {why})"


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


def config_changes(old: Mapping, new: Mapping, defaults: Mapping[str, Any] | None = None,
                   bases: tuple[Bases, Bases] | None = None) -> list[Change]:
    """Leaf keys whose value differs between the checkpoint's config `old` and this run's `new`, grouped.

    A key only `new` has (added to astuner since `old` was written) counts as unchanged at its default
    (`defaults`: dotted key -> default): a new key defaults to the behaviour that came before it. A key only
    `old` has no longer exists and acts on nothing. With `bases` (old run's, this run's), path keys compare as
    the files they resolve to; a change still shows the values as written."""
    flat_old, flat_new = flatten(old), flatten(new)
    if bases is not None:
        same = {k for k in flat_old.keys() & flat_new.keys() if _path_order(k) is not None
                and resolved_path(k, flat_old[k], bases[0]) == resolved_path(k, flat_new[k], bases[1])}
        flat_old = {k: flat_new[k] if k in same else v for k, v in flat_old.items()}
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
