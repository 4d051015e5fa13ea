"""Config loading: compose a user YAML over the packaged defaults (Hydra), validate it, save a backup.

Imports nothing heavier than Hydra/OmegaConf, so the CLI's `--help` stays instant.

    loaded = load_config("my.yaml", ["astuner.rollout.temperature=0.5"])
    loaded.typed.astuner.rollout.temperature  # 0.5 (typed, validated); loaded.cfg is the DictConfig
"""

from astuner.config.applicability import (
    APPLIES_ONLY_WITH,
    config_warnings,
    format_inapplicable_warning,
    inapplicable_keys,
)
from astuner.config.compose import load_config, save_config
from astuner.config.loaded import LoadedConfig
from astuner.config.validate import DEFAULT_CONFIG_DIR, ConfigError, default_tree, valid_keys

__all__ = [
    "APPLIES_ONLY_WITH",
    "config_warnings",
    "DEFAULT_CONFIG_DIR",
    "ConfigError",
    "LoadedConfig",
    "default_tree",
    "format_inapplicable_warning",
    "inapplicable_keys",
    "load_config",
    "save_config",
    "valid_keys",
]
