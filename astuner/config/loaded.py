"""The record a loaded config travels in. Its own module so that the rules that read a loaded config
(applicability.py) sit below the loader that builds one (compose.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig


@dataclass(frozen=True)
class LoadedConfig:
    """A composed, resolved and validated config, and where it came from.

    cfg is read-only and in struct mode: reading a misspelt key raises instead of returning None.
    """

    cfg: DictConfig  # what user code (workflows, judges) receives
    typed: Any  # astuner.config.schema.RunConfig: what astuner's own stages read
    yaml_path: Path  # absolute path of the user's YAML
    config_dir: Path  # its folder: relative paths in the config (data files, workflow files) start here
    user_keys: set[str]  # dotted keys the YAML or an override set (as written), e.g. "astuner.rollout.max_num_seqs"
    experiment_dir: Path  # absolute output folder
    overrides: tuple[str, ...] = field(default=())
    derived: tuple[str, ...] = field(default=())  # defaults changed to fit what the user set, in words
    # A workflow class the caller holds, run in place of the one astuner.rollout.agentscope_workflow names (which
    # stays the config's record): `astuner serve` gives its remote agents' workflow, bound to its episode board.
    workflow: Any = None
