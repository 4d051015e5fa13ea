"""Load a user YAML: compose it over the packaged defaults with Hydra, apply overrides, validate, save.

Hydra resolves `hydra.searchpath` entries against the process's working directory, so the seeds' relative
`file://astuner/default_config` only works from the repository root. To make a YAML work from any folder (and
from an installed wheel) we compose a rewritten copy of it from a temporary folder: searchpath entries made
absolute (YAML folder, then cwd, then the packaged defaults), the packaged defaults always on the path, and
the defaults list completed when missing.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from astuner.config.backbones import BACKBONES
from astuner.config.derived import stale_samples_uncorrected, staleness_bound
from astuner.config.loaded import LoadedConfig
from astuner.config.schema import old_names
from astuner.config.validate import (
    DEFAULT_CONFIG_DIR,
    SECTION_KEYS,
    ConfigError,
    check_user_shape,
    default_at,
    raise_problems,
    OPEN_MAPS,
    unknown_key_message,
    validate_tree,
)

_WITH_DEFAULTS = [b for b in BACKBONES.values() if b.defaults_dir]  # backbones with packaged defaults of their own
PACKAGED_DEFAULTS = (*(f"{b.name}_default" for b in _WITH_DEFAULTS), "astuner_default")
PACKAGED_SEARCHPATH = (DEFAULT_CONFIG_DIR, *(DEFAULT_CONFIG_DIR / b.defaults_dir for b in _WITH_DEFAULTS))
_PRIMARY_NAME = "astuner_user_config"  # name of the rewritten copy; swapped back for the user's file in errors


def load_config(yaml_path: str | Path, overrides: Sequence[str] = (), backbone: str | None = None) -> LoadedConfig:
    """Compose `yaml_path` over the packaged defaults, apply Hydra-style `overrides`, validate, resolve. With the
    `backbone` that will run it, the defaults that depend on it are derived too (`derive_for_backbone`).

    Raises ConfigError (a UserError) with a one-paragraph message naming the file for any bad input.
    """
    path = _locate(yaml_path)
    raw = _read_yaml(path)
    check_user_shape(raw, path)
    overrides = tuple(quote_class_paths(overrides))
    origins = _check_overrides(overrides, path)
    primary = _rewrite_primary(raw, path)
    cfg = _compose(primary, overrides, path)
    tree = _resolve(cfg, path)
    user_keys = _user_keys({k: v for k, v in raw.items() if k in SECTION_KEYS})
    overridden: set[str] = set()
    for key, override in origins.items():
        overridden |= _user_keys(_nest(key, override[1]))
    user_keys |= overridden
    raise_problems(path, apply_old_names(tree, user_keys, overridden))
    derived = derive_defaults(tree, user_keys)
    notes, wrong = derive_for_backbone(tree, user_keys, backbone)
    raise_problems(path, wrong)
    typed, problems = validate_tree(tree)
    raise_problems(path, [_with_origin(key, msg, origins) for key, msg in problems])

    final = OmegaConf.create(tree)
    OmegaConf.set_struct(final, True)
    OmegaConf.set_readonly(final, True)
    return LoadedConfig(
        cfg=final,
        typed=typed,
        yaml_path=path,
        config_dir=path.parent,
        user_keys=user_keys,
        experiment_dir=_experiment_dir(typed, path),
        overrides=overrides,
        derived=tuple(derived + notes),
    )


_UNSET = object()


def apply_old_names(tree: dict, user_keys: set[str], overridden: set[str]) -> list[str]:
    """Give each renamed key and its old name (schema.old_names) one value, in place; returns the conflicts.

    The name set most specifically wins: an override, then the user's YAML, then a defaults file that differs
    from the schema's default. Both names set at the same level to different values is a conflict; otherwise
    the winner's value goes to both, so code reading either name sees the same."""
    problems = []
    for old, new in old_names().items():
        old_value, new_value = _get(tree, old), _get(tree, new)
        old_level = _level(old, old_value, user_keys, overridden)
        new_level = _level(new, new_value, user_keys, overridden)
        if old_level == new_level >= 0 and old_value != new_value:
            problems.append(f"'{new}' and its old name '{old}' are set to different values ({new_value!r} and "
                            f"{old_value!r}); set only '{new}'")
            continue
        value = old_value if old_level > new_level else new_value
        if value is _UNSET:
            value = default_at(new)[1]
        for name in (old, new):
            _set(tree, name, value)
    return problems


def _level(key: str, value: Any, user_keys: set[str], overridden: set[str]) -> int:
    """How specifically `key` was set: 2 an override, 1 the user's YAML, 0 another defaults file, -1 not at all."""
    if key in overridden:
        return 2
    if key in user_keys:
        return 1
    return 0 if value is not _UNSET and value != default_at(key)[1] else -1


def _get(tree: dict, dotted: str) -> Any:
    node: Any = tree
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return _UNSET
        node = node[part]
    return node


def _set(tree: dict, dotted: str, value: Any) -> None:
    *parents, leaf = dotted.split(".")
    node = tree
    for part in parents:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            return  # a scalar where the schema has a section: validation reports it
    node[leaf] = value


PER_TURN = "astuner.rollout.max_response_length_in_one_turn"


def derive_defaults(tree: dict, user_keys: set[str]) -> list[str]:
    """Fit defaults the user did not choose to the keys they did (in place); returns what changed, in words.

    max_response_length_in_one_turn (default 1024) must leave room for a prompt in max_model_len: when the user
    set max_model_len alone and the default does not fit, a turn gets half of it."""
    rollout = tree.get("astuner", {}).get("rollout", {})
    max_len, per_turn = rollout.get("max_model_len"), rollout.get("max_response_length_in_one_turn")
    if (PER_TURN not in user_keys and isinstance(max_len, int) and isinstance(per_turn, int) and max_len > 1
            and per_turn >= max_len):
        rollout["max_response_length_in_one_turn"] = max_len // 2
        return [f"{PER_TURN}={max_len // 2} (half of max_model_len={max_len}; its default {per_turn} leaves no "
                "room for a prompt). Set it to choose another."]
    return []


OLD_LOGPROBS = "astuner.trainer_common.old_logprobs"
DEFAULT_IS_CAP = 2.0  # astuner.trainer_common.rollout_is_cap where stale samples are corrected and none is set


def derive_for_backbone(tree: dict, user_keys: set[str], backbone: str | None) -> tuple[list[str], list[str]]:
    """(What changed, in words; what is refused) for the backbone that will run the config, in place, before
    validation (the config is never rewritten after it).

    A backbone whose explorers roll out ahead (trinity) with a staleness bound above 0 trains on samples up to that
    many policy versions old: the loss then recomputes old logprobs with the trainer and weights each token by
    min(pi_old / pi_behaviour, rollout_is_cap), unless the user asked for old_logprobs: engine (refused)."""
    record = BACKBONES.get(backbone) if backbone is not None else None
    if record is None or not record.explorers:
        return [], []
    tc = tree.get("astuner", {}).get("trainer_common", {})
    sync = tree.get("trinity", {}).get("synchronizer", {})
    try:
        bound = staleness_bound(int(sync["sync_interval"]), int(sync["sync_offset"]), sync.get("max_staleness"))
    except (KeyError, TypeError, ValueError):  # validation names the bad value
        return [], []
    if not isinstance(bound, int) or not stale_samples_uncorrected(bound, tc.get("old_logprobs"),
                                                                  tc.get("rollout_is_cap")):
        return [], []
    if OLD_LOGPROBS in user_keys and tc.get("old_logprobs") == "engine":
        return [], [
            f"{backbone}: samples may be up to {bound} policy versions stale (trinity.synchronizer), and "
            f"{OLD_LOGPROBS}: engine would trust their behaviour logprobs as the PPO anchor. Remove that key (the "
            "backbone then recomputes old logprobs with the trainer and corrects each token by "
            "min(pi_old / pi_behaviour, rollout_is_cap)), or set sync_interval 1 and sync_offset 0"]
    cap = tc.get("rollout_is_cap") if tc.get("rollout_is_cap") is not None else DEFAULT_IS_CAP
    tc["old_logprobs"], tc["rollout_is_cap"] = "trainer", cap
    return [f"{OLD_LOGPROBS}=trainer and astuner.trainer_common.rollout_is_cap={cap:g}: on the {backbone} backbone "
            f"samples may be up to {bound} policy versions stale, so old logprobs are recomputed by the trainer and "
            f"each token is weighted by min(pi_old / pi_behaviour, {cap:g})"], []


def save_config(loaded: LoadedConfig, resumed_at: int | None = None) -> Path:
    """Write `<experiment_dir>/config.yaml` (the composed config) and a verbatim copy of the user's YAML.

    The copy keeps the YAML's file name, except a YAML itself named config.yaml is copied as
    user_config.yaml so that it does not replace the composed one. A run resumed at step `resumed_at` keeps the
    checkpoint's files: its composed config goes to config.resumed_<step>.yaml beside them, and an existing copy
    stays. Returns the experiment folder.
    """
    out = loaded.experiment_dir
    composed = out / "config.yaml"
    copy_name = "user_config.yaml" if loaded.yaml_path.name == "config.yaml" else loaded.yaml_path.name
    copy = out / copy_name
    keep = resumed_at is not None and composed.exists()
    if keep:
        composed = out / f"config.resumed_{resumed_at}.yaml"
    # The working directory too: a resume resolves this config's relative paths where this run did.
    header = f"# Composed by astuner from {loaded.yaml_path}\n# Working directory: {Path.cwd()}\n"
    if loaded.overrides:
        header += f"# Overrides: {' '.join(loaded.overrides)}\n"
    try:
        out.mkdir(parents=True, exist_ok=True)
        composed.write_text(header + OmegaConf.to_yaml(loaded.cfg, resolve=True), encoding="utf-8")
        if not (copy.exists() and (keep or copy.samefile(loaded.yaml_path))):
            shutil.copyfile(loaded.yaml_path, copy)
    except OSError as exc:
        raise ConfigError(
            f"cannot write the config backup of {loaded.yaml_path} into {out}: {exc.strerror or exc}; "
            "set astuner.experiment_dir to a writable folder."
        ) from None
    return out


def _locate(yaml_path: str | Path) -> Path:
    path = Path(yaml_path).expanduser().absolute()
    if not path.exists():
        raise ConfigError(f"config file {path} does not exist (working directory: {Path.cwd()}).")
    if path.is_dir():
        raise ConfigError(f"config {path} is a directory; pass the YAML file inside it, e.g. --conf {path}/x.yaml.")
    return path.resolve()


def _read_yaml(path: Path) -> Any:
    try:
        return OmegaConf.to_container(OmegaConf.load(path), resolve=False)
    except yaml.YAMLError as exc:
        raise ConfigError(f"config {path} is not valid YAML: {_one_line(exc)}") from None
    except (OSError, UnicodeDecodeError, ValueError, OmegaConfBaseException) as exc:
        raise ConfigError(f"cannot read config {path}: {_one_line(exc)}") from None


def _one_line(text: Any) -> str:
    return " ".join(str(text).split())


def _packaged_equivalent(rel: Path) -> Path | None:
    """default_config, default_config/verl or default_config/trinity (under any prefix) -> the packaged one."""
    parts = rel.parts
    if "default_config" not in parts:
        return None
    tail = parts[len(parts) - parts[::-1].index("default_config") :]
    if tail in ((), *((b.defaults_dir,) for b in _WITH_DEFAULTS)):
        return DEFAULT_CONFIG_DIR.joinpath(*tail)
    return None


def _resolve_searchpath(entry: str, yaml_dir: Path) -> str:
    if entry.startswith("pkg://"):
        return entry
    rel = Path(entry[len("file://") :] if entry.startswith("file://") else entry).expanduser()
    if rel.is_absolute():
        return f"file://{rel}"
    for base in (yaml_dir, Path.cwd()):
        if (base / rel).is_dir():
            return f"file://{(base / rel).resolve()}"
    packaged = _packaged_equivalent(rel)
    # A folder found nowhere stays (made absolute): Hydra then reports the config it could not find.
    return f"file://{packaged or (yaml_dir / rel).resolve()}"


def _norm_default(entry: Any) -> Any:
    if isinstance(entry, str):
        name = entry.strip().lstrip("/")
        return name[: -len(".yaml")] if name.endswith(".yaml") else name
    return entry


def _complete_defaults(defaults: list | None, source: Path) -> list:
    entries = list(defaults) if defaults is not None else []
    names = [_norm_default(e) for e in entries]
    missing = [d for d in PACKAGED_DEFAULTS if d not in names]
    entries = missing + entries
    names = missing + names
    if "_self_" not in names:
        entries.append("_self_")
        names.append("_self_")
    # Values listed after _self_ win; a packaged default after it would silently undo the user's settings.
    late = [d for d in PACKAGED_DEFAULTS if names.index(d) > names.index("_self_")]
    if late:
        raise ConfigError(
            f"config {source}: in 'defaults', {', '.join(late)} comes after _self_, so the packaged defaults "
            "would override your values; put _self_ last: [verl_default, trinity_default, astuner_default, _self_]."
        )
    return entries


def _rewrite_primary(raw: dict, path: Path) -> dict:
    """The user's YAML with absolute search paths and a complete defaults list."""
    doc = dict(raw)
    entries = list((doc.get("hydra") or {}).get("searchpath") or [])
    # The YAML's own folder first, as when Hydra loads a primary config from it.
    searchpath = [f"file://{path.parent}"] + [_resolve_searchpath(e, path.parent) for e in entries]
    searchpath += [f"file://{p}" for p in PACKAGED_SEARCHPATH]
    doc["hydra"] = {"searchpath": list(dict.fromkeys(searchpath))}
    doc["defaults"] = _complete_defaults(doc.get("defaults"), path)
    return doc


def quote_class_paths(overrides: Sequence[str]) -> list[str]:
    """`key=file.py->Class` as a shell leaves it (`key='file.py->Class'` loses its quotes there) quoted for Hydra,
    whose grammar reads '>' as an operator: a `module->Class` value is written one way on every shell. Values
    already quoted, and any other override, pass unchanged."""
    out = []
    for text in overrides:
        key, sep, value = text.partition("=") if isinstance(text, str) else ("", "", "")
        if sep and "->" in value and value[:1] not in ("'", '"') and not any(c in value for c in "'\\[]{},"):
            text = f"{key}='{value}'"
        out.append(text)
    return out


def _check_overrides(overrides: Sequence[str], source: Path) -> dict[str, tuple[str, Any]]:
    """Parse and pre-check overrides; returns {dotted key: (override text, value)}.

    Done before Hydra so that an unknown key gets a suggestion rather than Hydra's "use +key=..." advice.
    """
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    parser = OverridesParser.create()
    origins: dict[str, tuple[str, Any]] = {}
    problems: list[str] = []
    for text in overrides:
        if not isinstance(text, str):
            problems.append(f"override {text!r} is not a string")
            continue
        try:
            (override,) = parser.parse_overrides([text])
        except HydraException as exc:
            # Hydra's text: "Error parsing override '...'", the parser's complaint, a link; keep the complaint.
            lines = [ln for ln in str(exc).splitlines() if ln.strip() and not ln.startswith("See ")]
            detail = _one_line(" ".join(lines[1:]) or " ".join(lines) or exc)
            problems.append(
                f"override '{text}' is malformed ({detail}); write key=value, e.g. astuner.rollout.temperature=0.5 "
                "or astuner.rollout.compute_madness_checklist=[nonsense]"
            )
            continue
        key = override.key_or_group
        if override.is_delete():
            problems.append(f"override '{text}' deletes a key, which astuner does not allow; set a value instead")
        elif override.package is not None:
            problems.append(f"override '{text}' uses a package (@...), which astuner configs do not have")
        elif any(key.startswith(m + ".") for m in OPEN_MAPS):
            origins[key] = (text, override.value())  # a user-named entry; pydantic checks its fields
        elif not default_at(key)[0]:
            if key.split(".")[0] not in SECTION_KEYS and not default_at(f"astuner.{key}")[0]:
                problems.append(
                    f"override '{text}' sets '{key}', which is not a config key; "
                    f"overrides set keys under the sections {', '.join(SECTION_KEYS)} (e.g. astuner.seed=1)"
                )
            else:
                problems.append(f"override '{text}': {unknown_key_message(key)}")
        else:
            origins[key] = (text, override.value())
    raise_problems(source, problems)
    return origins


def _compose(primary: dict, overrides: Sequence[str], source: Path) -> DictConfig:
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    gh = GlobalHydra.instance()
    previous = gh.hydra if gh.is_initialized() else None
    try:
        with tempfile.TemporaryDirectory(prefix="astuner_config_") as tmp:
            OmegaConf.save(OmegaConf.create(primary), Path(tmp) / f"{_PRIMARY_NAME}.yaml")
            gh.clear()
            with initialize_config_dir(config_dir=tmp, job_name="astuner", version_base="1.3"):
                return compose(config_name=_PRIMARY_NAME, overrides=list(overrides))
    except Exception as exc:  # Hydra and OmegaConf raise many types; all mean the config could not compose
        message = _one_line(exc).replace(_PRIMARY_NAME, source.name)
        if "Could not find" in message or "Could not load" in message:
            # Hydra's own listing names our temporary folder; list the folders the user can act on.
            message = message.split(" Config search path:")[0].rstrip(".")
            message += f" (searched: {', '.join(primary['hydra']['searchpath'])})"
        raise ConfigError(f"cannot compose config {source}: {message}.") from None
    finally:
        gh.clear()
        if previous is not None:  # give back a Hydra app's own state when we run inside one
            gh.initialize(previous)


def _resolve(cfg: DictConfig, source: Path) -> dict:
    try:
        missing = sorted(OmegaConf.missing_keys(cfg))
        tree = OmegaConf.to_container(cfg, resolve=True)
    except OmegaConfBaseException as exc:
        detail = _one_line(exc).split(" object_type=")[0]
        raise ConfigError(f"config {source}: cannot resolve an interpolation: {detail}.") from None
    raise_problems(source, [f"'{key}' is mandatory (???) but has no value" for key in missing])
    return tree


def _with_origin(key: str, message: str, origins: dict[str, tuple[str, Any]]) -> str:
    for set_key, (text, _) in origins.items():
        if key == set_key or key.startswith(set_key + ".") or set_key.startswith(key + "."):
            return f"{message} (from override '{text}')"
    return message


def _nest(dotted: str, value: Any) -> dict:
    for part in reversed(dotted.split(".")):
        value = {part: value}
    return value


def _user_keys(tree: dict, prefix: str = "") -> set[str]:
    """Dotted keys set in `tree`, descending only where the schema has a section (a null default is a leaf)."""
    keys: set[str] = set()
    for key, value in tree.items():
        path = f"{prefix}.{key}" if prefix else str(key)
        if isinstance(value, dict) and isinstance(default_at(path)[1], dict):
            keys |= _user_keys(value, path)
        else:
            keys.add(path)
    return keys


def _experiment_dir(typed: Any, path: Path) -> Path:
    chosen = typed.astuner.experiment_dir
    if chosen is not None and not chosen.strip():
        raise ConfigError(f"config {path}: 'astuner.experiment_dir' is empty; give a folder or null.")
    out = Path(chosen).expanduser().absolute() if chosen else Path.cwd() / "launcher_record" / path.stem
    if out.exists() and not out.is_dir():
        raise ConfigError(f"config {path}: 'astuner.experiment_dir' {out} is a file, not a folder; give a folder.")
    return out
