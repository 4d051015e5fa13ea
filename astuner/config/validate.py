"""Schema checks for a config: unknown or misplaced keys (with a suggestion), then types, enumerations and ranges.

The schema is `astuner.config.schema.RunConfig`; the packaged default YAMLs are generated from it. Unknown keys
are found here (pydantic would reject them too, but without saying which key the user meant); everything else
is pydantic's strict validation, its errors turned into one line per key. Imports only omegaconf and pydantic.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from functools import lru_cache
from pathlib import Path
from typing import Any

from astuner.config.backbones import BACKBONES
from astuner.errors import UserError

DEFAULT_CONFIG_DIR = Path(__file__).resolve().parent.parent / "default_config"
# Sections a config may hold, and the Hydra bookkeeping keys allowed beside them in the user's YAML.
SECTION_KEYS = ("astuner", *(b.name for b in BACKBONES.values() if b.defaults_dir))  # a backbone's: keys named after it
HYDRA_KEYS = ("hydra", "defaults")

class ConfigError(UserError):
    """The config file or an override is wrong; the message names the file and the key."""


@lru_cache(maxsize=1)
def default_tree() -> dict[str, Any]:
    """Every key of the schema with its default, as plain containers. Do not mutate."""
    from astuner.config.schema import RunConfig

    return RunConfig().model_dump(mode="python")


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
    return closest_name(key, candidates)


def closest_name(word: str, options: Iterable[str], cutoff: float = 0.6) -> str | None:
    """The option spelled most like `word` (difflib), or None: the "did you mean" of key and class-name typos."""
    near = difflib.get_close_matches(word, list(options), n=1, cutoff=cutoff)
    return near[0] if near else None


def unknown_key_message(key: str) -> str:
    hint = suggest_key(key)
    tail = f" (did you mean '{hint}'?)" if hint else " (see astuner/default_config/astuner_default.yaml for all keys)"
    return f"unknown key '{key}'{tail}"


# Keys whose entries are named by the user (checked entry by entry by pydantic, or, for a game's arguments, by
# the game itself at start), not here.
OPEN_MAPS = ("astuner.auxiliary_models", "astuner.models", "astuner.agents", "astuner.task_reader.textarena.env_kwargs",
             "astuner.task_reader.openenv.reset_kwargs", "astuner.task_reader.verifiers.env_args",
             "astuner.task_reader.verifiers.agent")


def _unknown_keys(value: Any, default: Any, path: str, problems: list[tuple[str, str]]) -> None:
    """Keys the schema does not have, and scalars where the schema has a section."""
    if not isinstance(default, dict) or path in OPEN_MAPS:
        return
    if not isinstance(value, dict):
        problems.append((path, f"'{path}' must be a mapping (a section of keys), got {value!r}"))
        return
    for key, sub in value.items():
        sub_path = f"{path}.{key}" if path else str(key)
        if key not in default:
            problems.append((sub_path, unknown_key_message(sub_path)))
        else:
            _unknown_keys(sub, default[key], sub_path, problems)


def _annotation_words(annotation: Any) -> str:
    """'an integer', 'one of hf, vllm', 'a list of nonsense, wrong_toolcall' for a field's annotation."""
    import typing

    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    origin = typing.get_origin(annotation)
    if origin is typing.Literal:
        return "one of " + ", ".join(map(str, args))
    if origin is list:
        return "a list, each entry " + _annotation_words(args[0])
    if origin is typing.Union and len(args) == 1:
        return _annotation_words(args[0]) + " or null"
    name = getattr(annotation, "__name__", str(annotation))
    return {"int": "an integer", "float": "a number", "bool": "true or false", "str": "a string"}.get(name, name)


def _field_at(loc: tuple) -> Any:
    """The pydantic FieldInfo of a dotted location, or None."""
    from astuner.config.schema import RunConfig, Section

    cls: Any = RunConfig
    info = None
    for part in loc:
        if not (isinstance(cls, type) and issubclass(cls, Section)) or part not in cls.model_fields:
            return info if isinstance(part, int) else None
        info = cls.model_fields[part]
        cls = info.annotation
    return info


_BOUND_WORDS = {"ge": ">=", "gt": ">", "le": "<=", "lt": "<"}


def _pydantic_problem(error: dict) -> tuple[str, str]:
    loc = tuple(error["loc"])
    names = tuple(p for p in loc if not isinstance(p, int))
    path = ".".join(map(str, names))
    value = error.get("input")
    info = _field_at(names)
    ctx = error.get("ctx") or {}
    bound = next((k for k in _BOUND_WORDS if k in ctx), None)
    if bound is not None:
        return path, f"'{path}' must be {_BOUND_WORDS[bound]} {ctx[bound]}, got {value!r}"
    words = _annotation_words(info.annotation) if info is not None else "valid"
    if value is None:
        default = info.get_default(call_default_factory=True) if info is not None else None
        return path, f"'{path}' must not be null (it must be {words}; its default is {default!r})"
    refused = (info.json_schema_extra or {}).get("refused") if info is not None else None
    if refused and error.get("type") == "literal_error":
        return path, f"'{path}' {value!r} is refused: {refused}"
    if len(loc) > len(names):  # an entry of a list
        return path, f"entries of '{path}' must be {words.split('each entry ', 1)[-1]}; got {value!r}"
    hint = " (quote it to make it a string)" if words.startswith("a string") else ""
    return path, f"'{path}' must be {words}, got {value!r} ({type(value).__name__}){hint}"


def validate_tree(tree: dict) -> tuple[Any, list[tuple[str, str]]]:
    """(typed RunConfig or None, problems as (dotted key, message)) of a resolved config tree."""
    from pydantic import ValidationError

    from astuner.config.schema import RunConfig
    from astuner.config.schema_models import roster_problems, teacher_problems

    problems: list[tuple[str, str]] = []
    _unknown_keys(tree, default_tree(), "", problems)
    try:
        # Unknown keys are reported above, with a suggestion; the rest is checked without them, so that one
        # message lists every problem.
        typed = RunConfig.model_validate(_known_only(tree, default_tree(), ""))
        problems += roster_problems(typed.astuner.models, typed.astuner.agents) + teacher_problems(typed)
        return (typed if not problems else None), problems
    except ValidationError as exc:
        seen = {path for path, _ in problems}
        for error in exc.errors(include_url=False):
            path, message = _pydantic_problem(error)
            if path not in seen:  # a union (e.g. int or null) reports once per branch; once is enough
                seen.add(path)
                problems.append((path, message))
        return None, problems


def _known_only(value: Any, default: Any, path: str) -> Any:
    if not (isinstance(value, dict) and isinstance(default, dict)) or path in OPEN_MAPS:
        return value
    return {k: _known_only(v, default[k], f"{path}.{k}" if path else str(k)) for k, v in value.items() if k in default}

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
