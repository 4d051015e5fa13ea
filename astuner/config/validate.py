"""Schema checks for a config: unknown or misplaced keys, value types, enumerations and numeric ranges.

The schema is the packaged defaults themselves: a key is valid when one of the three default YAMLs has it, and
its default value gives its type. Keeping no second copy of the key list means a key documented in
`astuner_default.yaml` can never be missing from validation. Imports only omegaconf, so `--help` stays fast.
"""

from __future__ import annotations

import difflib
import operator
from collections.abc import Iterable
from functools import lru_cache
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from astuner.errors import UserError

DEFAULT_CONFIG_DIR = Path(__file__).resolve().parent.parent / "default_config"
# Relative to DEFAULT_CONFIG_DIR; together they define every valid key.
DEFAULT_FILES = ("verl/verl_default.yaml", "trinity/trinity_default.yaml", "astuner_default.yaml")
# Sections a config may hold, and the Hydra bookkeeping keys allowed beside them in the user's YAML.
SECTION_KEYS = ("astuner", "trinity", "verl")
HYDRA_KEYS = ("hydra", "defaults")

# Keys whose documented values form a fixed set. For a list-valued key each entry must be in the set.
ALLOWED_VALUES: dict[str, tuple[str, ...]] = {
    "astuner.task_reader.type": ("jsonl_dataset_file", "huggingface_dat_repo"),
    "astuner.rollout.engine": ("hf", "vllm"),
    "astuner.rollout.tool_prompt": ("auto", "template", "builtin"),
    "astuner.rollout.tool_parser": ("hermes",),
    "astuner.rollout.compute_madness_checklist": ("nonsense", "wrong_toolcall"),
    "astuner.trainer_common.algorithm.adv_estimator": ("grpo",),
    "astuner.trainer_common.kl_loss_type": ("k1", "k3"),
    "astuner.trainer_common.loss_agg_mode": ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"),
}

# Numeric sanity limits: key -> ((comparison, bound), ...). A null value (where allowed) is not checked.
BOUNDS: dict[str, tuple[tuple[str, float], ...]] = {
    "astuner.data.train_batch_size": ((">=", 1),),
    "astuner.data.max_prompt_length": ((">=", 1),),
    "astuner.data.max_response_length": ((">=", 1),),
    "astuner.rollout.temperature": ((">=", 0),),
    "astuner.rollout.max_env_worker": ((">=", 1),),
    "astuner.rollout.num_repeat": ((">=", 1),),
    "astuner.rollout.episode_timeout": ((">", 0),),
    "astuner.rollout.max_response_length_in_one_turn": ((">=", 1),),
    "astuner.rollout.max_model_len": ((">=", 1),),
    "astuner.rollout.tensor_model_parallel_size": ((">=", 1),),
    "astuner.rollout.max_num_seqs": ((">=", 1),),
    "astuner.rollout.gpu_memory_utilization": ((">", 0), ("<=", 1)),
    "astuner.rollout.multi_turn.max_sample_per_task": ((">=", 1),),
    "astuner.trainer_common.save_freq": ((">=", 1),),
    "astuner.trainer_common.test_freq": ((">=", 1),),
    "astuner.trainer_common.total_epochs": ((">=", 1),),
    "astuner.trainer_common.total_training_steps": ((">=", 1),),
    "astuner.trainer_common.trinity_only__n_vllm_engine": ((">=", 1),),
    "astuner.trainer_common.mini_batch_num": ((">=", 1),),
    "astuner.trainer_common.optim.lr": ((">=", 0),),
    "astuner.trainer_common.optim.weight_decay": ((">=", 0),),
    "astuner.trainer_common.optim.lr_warmup_steps": ((">=", 0),),
    "astuner.trainer_common.optim.grad_clip": ((">", 0),),
    "astuner.trainer_common.algorithm.epsilon": ((">=", 0),),
    "astuner.trainer_common.clip_ratio_low": ((">=", 0),),
    "astuner.trainer_common.clip_ratio_high": ((">=", 0),),
    "astuner.trainer_common.kl_loss_coef": ((">=", 0),),
    "trinity.trainer.max_token_len_per_gpu": ((">=", 1),),
}

# Keys with a non-null default whose documentation gives null a meaning.
NULLABLE = frozenset({"astuner.trainer_common.optim.grad_clip"})

_COMPARE = {">=": operator.ge, ">": operator.gt, "<=": operator.le}


class ConfigError(UserError):
    """The config file or an override is wrong; the message names the file and the key."""


@lru_cache(maxsize=1)
def default_tree() -> dict[str, Any]:
    """The union of the packaged default YAMLs as plain containers (the schema). Do not mutate."""
    merged = OmegaConf.create({})
    for name in DEFAULT_FILES:
        merged = OmegaConf.merge(merged, OmegaConf.load(DEFAULT_CONFIG_DIR / name))
    return OmegaConf.to_container(merged, resolve=False)


@lru_cache(maxsize=1)
def valid_keys() -> tuple[str, ...]:
    """Every dotted path of the schema, sections included (e.g. "astuner.rollout", "astuner.rollout.engine")."""
    out: list[str] = []

    def walk(node: dict, prefix: str) -> None:
        for key, value in node.items():
            path = f"{prefix}.{key}" if prefix else str(key)
            out.append(path)
            if isinstance(value, dict):
                walk(value, path)

    walk(default_tree(), "")
    return tuple(out)


def default_at(path: str) -> tuple[bool, Any]:
    """(found, default value) of a dotted path in the schema."""
    node: Any = default_tree()
    for part in path.split("."):
        if not isinstance(node, dict) or part not in node:
            return False, None
        node = node[part]
    return True, node


def suggest_key(key: str) -> str | None:
    """The valid key the user most likely meant: same leaf elsewhere (misplaced), else a close spelling."""
    candidates = [k for k in valid_keys() if k != key]
    leaf = key.rsplit(".", 1)[-1]

    def closest(options: Iterable[str]) -> str:
        return max(options, key=lambda k: difflib.SequenceMatcher(None, k, key).ratio())

    same_leaf = [k for k in candidates if k.rsplit(".", 1)[-1] == leaf]
    if same_leaf:
        return closest(same_leaf)
    leaves = {k.rsplit(".", 1)[-1] for k in candidates}
    near_leaf = difflib.get_close_matches(leaf, leaves, n=1, cutoff=0.75)
    if near_leaf:
        return closest(k for k in candidates if k.rsplit(".", 1)[-1] == near_leaf[0])
    near = difflib.get_close_matches(key, candidates, n=1, cutoff=0.6)
    return near[0] if near else None


def unknown_key_message(key: str) -> str:
    hint = suggest_key(key)
    tail = f" (did you mean '{hint}'?)" if hint else " (see astuner/default_config/astuner_default.yaml for all keys)"
    return f"unknown key '{key}'{tail}"


def _kind(value: Any) -> str:
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int):
        return "int"
    if isinstance(value, float):
        return "float"
    if isinstance(value, str):
        return "str"
    if isinstance(value, list):
        return "list"
    if isinstance(value, dict):
        return "dict"
    return type(value).__name__


_KIND_WORDS = {
    "bool": "true or false",
    "int": "an integer",
    "float": "a number",
    "str": "a string",
    "list": "a list",
    "dict": "a mapping",
}


def _type_ok(value: Any, expected: str) -> bool:
    got = _kind(value)
    # An int is a fine float (lr: 1); the reverse would silently truncate.
    return got == expected or (expected == "float" and got == "int")


def _walk(value: Any, default: Any, path: str, problems: list[tuple[str, str]]) -> None:
    if default is None:  # a null default accepts any value
        return
    if isinstance(default, dict):
        if not isinstance(value, dict):
            problems.append((path, f"'{path}' must be a mapping (a section of keys), got {value!r}"))
            return
        for key, sub in value.items():
            sub_path = f"{path}.{key}" if path else str(key)
            if key not in default:
                problems.append((sub_path, unknown_key_message(sub_path)))
            else:
                _walk(sub, default[key], sub_path, problems)
        return
    if value is None:
        if path not in NULLABLE:
            problems.append((path, f"'{path}' must not be null (its default is {default!r})"))
        return
    expected = _kind(default)
    if not _type_ok(value, expected):
        words = _KIND_WORDS.get(expected, expected)
        hint = " (quote it to make it a string)" if expected == "str" else ""
        problems.append((path, f"'{path}' must be {words}, got {value!r} ({_kind(value)}){hint}"))


def _lookup(tree: dict, path: str) -> tuple[bool, Any]:
    node: Any = tree
    for part in path.split("."):
        if not isinstance(node, dict) or part not in node:
            return False, None
        node = node[part]
    return True, node


def _check_values(tree: dict, skip: set[str], problems: list[tuple[str, str]]) -> None:
    for path, allowed in ALLOWED_VALUES.items():
        found, value = _lookup(tree, path)
        if not found or path in skip or value is None:
            continue
        entries = value if isinstance(value, list) else [value]
        bad = [v for v in entries if v not in allowed]
        if bad:
            what = "entries of" if isinstance(value, list) else "value of"
            problems.append(
                (path, f"{what} '{path}' must be one of {', '.join(allowed)}; got {', '.join(map(repr, bad))}")
            )
    for path, limits in BOUNDS.items():
        found, value = _lookup(tree, path)
        if not found or path in skip or value is None or _kind(value) not in ("int", "float"):
            continue
        for op, bound in limits:
            if not _COMPARE[op](value, bound):
                problems.append((path, f"'{path}' must be {op} {bound}, got {value!r}"))
                break


def check_tree(tree: dict) -> list[tuple[str, str]]:
    """All problems of a resolved config tree as (dotted key, message) pairs; empty when it is valid."""
    problems: list[tuple[str, str]] = []
    _walk(tree, default_tree(), "", problems)
    _check_values(tree, {path for path, _ in problems}, problems)
    return problems


def check_user_shape(raw: Any, source: Path) -> None:
    """Checks of the user's YAML itself, before composing: top-level keys and the Hydra bookkeeping."""
    if not isinstance(raw, dict):
        raise ConfigError(
            f"config {source} must be a mapping with an 'astuner:' section at the top, got a {type(raw).__name__}."
        )
    if not raw:
        raise ConfigError(f"config {source} is empty; it needs at least an 'astuner:' section.")
    problems = []
    for key in raw:
        if key in SECTION_KEYS or key in HYDRA_KEYS:
            continue
        found, _ = default_at(f"astuner.{key}")
        hint = f"; did you mean 'astuner.{key}' (indent it under astuner:)?" if found else ""
        allowed = ", ".join(SECTION_KEYS + HYDRA_KEYS)
        problems.append(f"top-level key '{key}' is not allowed (allowed: {allowed}){hint}")
    hydra_section = raw.get("hydra")
    if hydra_section is not None:
        if not isinstance(hydra_section, dict):
            problems.append("'hydra' must be a mapping such as {searchpath: [...]}")
        else:
            # Only the search path means anything when astuner composes; other Hydra keys would be ignored.
            problems += [
                f"'hydra.{k}' is not read by astuner (only hydra.searchpath is)"
                for k in hydra_section
                if k != "searchpath"
            ]
            searchpath = hydra_section.get("searchpath")
            if searchpath is not None and not (
                isinstance(searchpath, list) and all(isinstance(e, str) for e in searchpath)
            ):
                problems.append("'hydra.searchpath' must be a list of strings such as file://astuner/default_config")
    if "defaults" in raw and not isinstance(raw["defaults"], list):
        problems.append("'defaults' must be a list such as [verl_default, trinity_default, astuner_default, _self_]")
    raise_problems(source, problems)


def raise_problems(source: Path | str, problems: list[str]) -> None:
    """Raise one ConfigError whose single paragraph lists every problem."""
    if not problems:
        return
    if len(problems) == 1:
        raise ConfigError(f"config {source}: {problems[0]}.")
    listed = "; ".join(f"({i}) {p}" for i, p in enumerate(problems, 1))
    raise ConfigError(f"config {source} has {len(problems)} problems: {listed}.")
