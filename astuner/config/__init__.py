"""Config loading: compose a user YAML over the packaged defaults (Hydra), validate it, save a backup.

Imports nothing heavier than Hydra/OmegaConf, so the CLI's `--help` stays instant.

    loaded = load_config("my.yaml", ["astuner.rollout.temperature=0.5"])
    loaded.cfg.astuner.rollout.temperature  # 0.5
"""

from astuner.config.applicability import APPLIES_ONLY_WITH, format_inapplicable_warning, inapplicable_keys
from astuner.config.compose import LoadedConfig, load_config, save_config
from astuner.config.validate import ALLOWED_VALUES, DEFAULT_CONFIG_DIR, ConfigError, default_tree, valid_keys

__all__ = [
    "ALLOWED_VALUES",
    "APPLIES_ONLY_WITH",
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
