"""Config loading: Hydra composition from any cwd, validation messages, applicability warnings, backups."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from omegaconf import OmegaConf
from omegaconf.errors import ConfigAttributeError, ReadonlyConfigError

from astuner.config import (
    APPLIES_ONLY_WITH,
    DEFAULT_CONFIG_DIR,
    ConfigError,
    LoadedConfig,
    default_tree,
    format_inapplicable_warning,
    inapplicable_keys,
    load_config,
    save_config,
    valid_keys,
)
from astuner.config.default_yaml import DEFAULT_FILE_OF, render_yaml
from astuner.config.schema import RunConfig
from astuner.errors import UserError

REPO = Path(__file__).resolve().parents[1]

# The shape of the seed projects' YAML, kept verbatim: relative searchpaths and an explicit defaults list.
SEED_YAML = """\
astuner:
  project_name: math_agent
  task_reader: {type: huggingface_dat_repo, huggingface_dat_repo: {dataset_path: 'gsm8k/main', training_split: train, validation_split: test}}
  data: {train_batch_size: 264, max_prompt_length: 3000, max_response_length: 10000}
  rollout: {agentscope_workflow: math_agent.math_agent->MathAgentWorkflow, temperature: 0.7, max_env_worker: 64,
            num_repeat: 4, agent_madness_reward: 0.0, tensor_model_parallel_size: 1, max_num_seqs: 40,
            multi_turn: {max_sample_per_task: 4}, compute_madness_checklist: [nonsense, wrong_toolcall],
            max_response_length_in_one_turn: 1024, max_model_len: 13000}
  task_judge: {judge_protocol: astuner.task_judge.math_answer_as_judge->MathAnswerAsJudge}
  model: {path: Qwen/Qwen2.5-14B-Instruct}
  trainer_common: {save_freq: 99999, test_freq: 99999, total_epochs: 99999, trinity_only__n_vllm_engine: 2}
trinity: {trainer: {max_token_len_per_gpu: 13000}}
hydra: {searchpath: [file://astuner/default_config, file://astuner/default_config/verl, file://astuner/default_config/trinity]}
defaults: [verl_default, trinity_default, astuner_default, _self_]
"""


@pytest.fixture
def elsewhere(tmp_path, monkeypatch) -> Path:
    """A working directory with no astuner/ or default_config/ in it."""
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    return cwd


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))
    return path


@pytest.fixture
def seed_file(tmp_path) -> Path:
    return write(tmp_path / "configs" / "math_agent.yaml", SEED_YAML)


def config_error(path: Path, overrides=()) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(path, overrides)
    assert isinstance(info.value, UserError)
    message = str(info.value)
    assert "\n" not in message  # one paragraph
    return message


# --- composition --------------------------------------------------------------------------------------------


def test_seed_yaml_composes_verbatim_from_another_cwd(seed_file, elsewhere):
    loaded = load_config(seed_file)
    cfg = loaded.cfg
    assert isinstance(loaded, LoadedConfig)
    assert cfg.astuner.rollout.max_num_seqs == 40
    assert cfg.astuner.rollout.temperature == 0.7
    assert cfg.astuner.task_reader.huggingface_dat_repo.dataset_path == "gsm8k/main"
    assert cfg.trinity.trainer.max_token_len_per_gpu == 13000
    assert cfg.astuner.trainer_common.optim.lr == pytest.approx(1e-6)  # from the packaged defaults only
    assert cfg.astuner.rollout.engine == "auto"
    assert "hydra" not in cfg and "defaults" not in cfg
    assert loaded.yaml_path == seed_file and loaded.yaml_path.is_absolute()
    assert loaded.config_dir == seed_file.parent
    assert loaded.experiment_dir == elsewhere / "launcher_record" / "math_agent"
    assert "astuner.rollout.max_num_seqs" in loaded.user_keys
    assert "astuner.rollout.multi_turn.max_sample_per_task" in loaded.user_keys
    assert "trinity.trainer.max_token_len_per_gpu" in loaded.user_keys
    assert "astuner.trainer_common.optim.lr" not in loaded.user_keys


@pytest.mark.parametrize("value", ["my_agent.py->MyAgent", "'my_agent.py->MyAgent'", '"my_agent.py->MyAgent"',
                                   "pkg.mod->Agent"])
def test_a_class_path_override_needs_no_hydra_quotes(seed_file, elsewhere, value):
    # `key='file.py->Class'` reaches us without its quotes from a shell; Hydra alone would call it malformed.
    loaded = load_config(seed_file, [f"astuner.rollout.agentscope_workflow={value}"])
    assert loaded.cfg.astuner.rollout.agentscope_workflow == value.strip("'\"")
    assert "malformed" in config_error(seed_file, ["astuner.rollout.temperature=0.5>"])


def test_cfg_is_read_only_and_strict(seed_file, elsewhere):
    cfg = load_config(seed_file).cfg
    with pytest.raises(ReadonlyConfigError):
        cfg.astuner.rollout.temperature = 2.0
    with pytest.raises(ConfigAttributeError):
        cfg.astuner.rollout.temprature  # noqa: B018 - a misspelt read must fail, not return None


def test_relative_searchpath_prefers_the_yaml_folder(tmp_path, elsewhere):
    # A project with its own copy of default_config next to the YAML: that copy is used, not the packaged one.
    project = tmp_path / "project"
    for name in ("astuner_default.yaml", "verl/verl_default.yaml", "trinity/trinity_default.yaml"):
        text = (DEFAULT_CONFIG_DIR / name).read_text().replace("seed: 42", "seed: 7")
        write(project / "astuner" / "default_config" / name, text)
    path = write(project / "run.yaml", SEED_YAML)
    assert load_config(path).cfg.astuner.seed == 7
    assert load_config(seed_fallback := write(tmp_path / "plain" / "run.yaml", SEED_YAML)).cfg.astuner.seed == 42
    assert seed_fallback.exists()


def test_astuner_only_yaml_composes(tmp_path, elsewhere):
    path = write(tmp_path / "mini.yaml", "astuner: {project_name: mini, rollout: {temperature: 0.3}}\n")
    loaded = load_config(path)
    assert loaded.cfg.astuner.project_name == "mini"
    assert loaded.cfg.astuner.rollout.temperature == 0.3
    assert loaded.cfg.astuner.data.train_batch_size == 32
    assert loaded.cfg.trinity.trainer.max_token_len_per_gpu == 13000
    assert loaded.user_keys == {"astuner.project_name", "astuner.rollout.temperature"}


def test_partial_defaults_list_is_completed(tmp_path, elsewhere):
    path = write(tmp_path / "c.yaml", "defaults: [_self_]\nastuner: {seed: 3}\n")
    cfg = load_config(path).cfg
    assert cfg.astuner.seed == 3 and cfg.astuner.rollout.engine == "auto"


def test_extra_defaults_file_next_to_the_yaml(tmp_path, elsewhere):
    write(tmp_path / "base.yaml", "astuner: {seed: 5, data: {train_batch_size: 8}}\n")
    path = write(tmp_path / "c.yaml", "defaults: [astuner_default, base, _self_]\nastuner: {seed: 6}\n")
    cfg = load_config(path).cfg
    assert cfg.astuner.seed == 6  # _self_ last wins
    assert cfg.astuner.data.train_batch_size == 8


def test_self_before_packaged_defaults_is_an_error(tmp_path, elsewhere):
    path = write(tmp_path / "c.yaml", "defaults: [_self_, astuner_default]\nastuner: {seed: 6}\n")
    assert "_self_" in config_error(path)


def test_interpolation_is_resolved(tmp_path, elsewhere):
    path = write(tmp_path / "c.yaml", "astuner: {rollout: {max_model_len: '${astuner.data.max_prompt_length}'}}\n")
    assert load_config(path).cfg.astuner.rollout.max_model_len == 3000
    bad = write(tmp_path / "d.yaml", "astuner: {rollout: {max_model_len: '${astuner.nope}'}}\n")
    assert "interpolation" in config_error(bad)


@pytest.mark.parametrize(
    "name", sorted(str(p.relative_to(DEFAULT_CONFIG_DIR)) for p in DEFAULT_CONFIG_DIR.rglob("*.yaml"))
)
def test_every_packaged_default_yaml_composes(name, elsewhere):
    loaded = load_config(DEFAULT_CONFIG_DIR / name)
    assert loaded.cfg.astuner.rollout.engine == "auto"


def test_packaged_defaults_are_found():
    assert len(list(DEFAULT_CONFIG_DIR.rglob("*.yaml"))) >= 3
    assert "astuner.data.train_batch_size" in valid_keys()


# Every YAML under tutorial/ but OpenEnv's own manifests (an environment package's openenv.yaml names its app).
TUTORIAL_YAMLS = sorted(str(p.relative_to(REPO)) for p in (REPO / "tutorial").rglob("*.yaml") if p.name != "openenv.yaml")


@pytest.mark.parametrize("name", ["<seed yaml>"] + TUTORIAL_YAMLS)
def test_tutorial_yamls_compose_and_validate(name, tmp_path, elsewhere):
    # The seed case always runs, so this test never passes by testing nothing.
    path = write(tmp_path / "seed.yaml", SEED_YAML) if name == "<seed yaml>" else REPO / name
    raw = OmegaConf.to_container(OmegaConf.load(path))
    assert isinstance(raw, dict) and "astuner" in raw, f"{name}: every YAML under tutorial/ is an astuner config"
    loaded = load_config(path)
    assert loaded.cfg.astuner.data.train_batch_size >= 1


# --- overrides ----------------------------------------------------------------------------------------------


def test_overrides_apply_and_count_as_user_keys(seed_file, elsewhere):
    loaded = load_config(
        seed_file,
        [
            "astuner.rollout.temperature=0.5",
            "astuner.rollout.compute_madness_checklist=[nonsense]",
            "trinity.trainer.max_token_len_per_gpu=2048",
            "astuner.trainer_common.optim.lr=1e-5",
        ],
    )
    cfg = loaded.cfg
    assert cfg.astuner.rollout.temperature == 0.5
    assert list(cfg.astuner.rollout.compute_madness_checklist) == ["nonsense"]
    assert cfg.trinity.trainer.max_token_len_per_gpu == 2048
    assert cfg.astuner.trainer_common.optim.lr == pytest.approx(1e-5)
    assert "astuner.trainer_common.optim.lr" in loaded.user_keys
    assert loaded.overrides[0] == "astuner.rollout.temperature=0.5"


def test_unknown_override_names_key_and_suggestion(seed_file, elsewhere):
    message = config_error(seed_file, ["astuner.rollout.temprature=0.5"])
    assert "astuner.rollout.temprature" in message and "astuner.rollout.temperature" in message
    assert str(seed_file) in message


def test_misplaced_override(seed_file, elsewhere):
    message = config_error(seed_file, ["astuner.rollout.train_batch_size=8"])
    assert "did you mean 'astuner.data.train_batch_size'" in message


@pytest.mark.parametrize("override", ["astuner.rollout.temperature", "astuner.x=[1", "~astuner.seed", "foo=1"])
def test_malformed_or_foreign_override(seed_file, elsewhere, override):
    assert override in config_error(seed_file, [override])


def test_override_type_error_says_it_came_from_the_override(seed_file, elsewhere):
    message = config_error(seed_file, ["astuner.data.train_batch_size=1.5"])
    assert "astuner.data.train_batch_size" in message and "override" in message


# --- validation ---------------------------------------------------------------------------------------------


def test_unknown_key_names_key_and_suggestion(tmp_path, elsewhere):
    path = write(tmp_path / "c.yaml", "astuner: {rollout: {temprature: 0.5}}\n")
    message = config_error(path)
    assert "unknown key 'astuner.rollout.temprature'" in message
    assert "did you mean 'astuner.rollout.temperature'" in message
    assert str(path) in message


def test_misplaced_key_suggests_its_real_place(tmp_path, elsewhere):
    path = write(tmp_path / "c.yaml", "astuner: {rollout: {train_batch_size: 8}}\n")
    assert "did you mean 'astuner.data.train_batch_size'" in config_error(path)


def test_unknown_top_level_key(tmp_path, elsewhere):
    path = write(tmp_path / "c.yaml", "rollout: {temperature: 0.5}\nastuner: {seed: 1}\n")
    message = config_error(path)
    assert "'rollout'" in message and "astuner.rollout" in message


def test_unknown_key_under_verl_is_reported(tmp_path, elsewhere):
    path = write(tmp_path / "c.yaml", "verl: {actor: {lr: 1}}\n")
    assert "verl.actor" in config_error(path)


def test_hydra_keys_other_than_searchpath_are_errors(tmp_path, elsewhere):
    path = write(tmp_path / "c.yaml", "hydra: {job: {chdir: true}}\nastuner: {seed: 1}\n")
    assert "hydra.job" in config_error(path)


def test_all_problems_in_one_message(tmp_path, elsewhere):
    path = write(tmp_path / "c.yaml", "astuner: {seed: x, rollout: {num_repeat: 0, foo: 1}}\n")
    message = config_error(path)
    assert "3 problems" in message
    assert "astuner.seed" in message and "num_repeat" in message and "astuner.rollout.foo" in message


@pytest.mark.parametrize(
    "yaml_text, key",
    [
        ("astuner: {rollout: {temperature: hot}}", "astuner.rollout.temperature"),
        ("astuner: {data: {train_batch_size: 1.5}}", "astuner.data.train_batch_size"),
        ("astuner: {data: {train_batch_size: true}}", "astuner.data.train_batch_size"),
        ("astuner: {data: {shuffle: 1}}", "astuner.data.shuffle"),
        ("astuner: {project_name: 12}", "astuner.project_name"),
        ("astuner: {rollout: {compute_madness_checklist: nonsense}}", "astuner.rollout.compute_madness_checklist"),
        ("astuner: {rollout: {multi_turn: 3}}", "astuner.rollout.multi_turn"),
        ("astuner: {data: {max_prompt_length: null}}", "astuner.data.max_prompt_length"),
    ],
)
def test_type_errors(tmp_path, elsewhere, yaml_text, key):
    message = config_error(write(tmp_path / "c.yaml", yaml_text + "\n"))
    assert f"'{key}'" in message


@pytest.mark.parametrize(
    "yaml_text",
    [
        "astuner: {trainer_common: {optim: {lr: 1}}}",  # int where a float is expected
        "astuner: {rollout: {agentscope_workflow: null}}",  # workflow is checked when the run needs it
        "astuner: {task_reader: {task_id_field: id}}",  # a null default accepts anything
        "astuner: {trainer_common: {optim: {grad_clip: null}}}",  # documented as "null: no clipping"
    ],
)
def test_accepted_values(tmp_path, elsewhere, yaml_text):
    load_config(write(tmp_path / "c.yaml", yaml_text + "\n"))


@pytest.mark.parametrize(
    "yaml_text, needle",
    [
        ("astuner: {rollout: {engine: tgi}}", "auto, vllm, hf"),
        ("astuner: {rollout: {compute_madness_checklist: [nonsense, bogus]}}", "'bogus'"),
        ("astuner: {task_reader: {type: csv}}", "jsonl_dataset_file"),
        ("astuner: {trainer_common: {kl_loss_type: k2}}", "k1, k3"),
        ("astuner: {trainer_common: {loss_agg_mode: sum}}", "token-mean"),
        ("astuner: {trainer_common: {algorithm: {adv_estimator: ppo}}}", "grpo"),
        ("astuner: {rollout: {tool_prompt: none}}", "builtin"),
        ("astuner: {rollout: {tool_call_parser: json}}", "hermes"),
    ],
)
def test_bad_enum(tmp_path, elsewhere, yaml_text, needle):
    assert needle in config_error(write(tmp_path / "c.yaml", yaml_text + "\n"))


@pytest.mark.parametrize(
    "yaml_text, key",
    [
        ("astuner: {rollout: {num_repeat: 0}}", "num_repeat"),
        ("astuner: {data: {train_batch_size: 0}}", "train_batch_size"),
        ("astuner: {rollout: {max_env_worker: 0}}", "max_env_worker"),
        ("astuner: {rollout: {temperature: -0.1}}", "temperature"),
    ],
)
def test_numeric_sanity(tmp_path, elsewhere, yaml_text, key):
    assert key in config_error(write(tmp_path / "c.yaml", yaml_text + "\n"))


def test_packaged_yamls_are_generated_from_the_schema():
    # The default YAMLs are what Hydra composes; the schema is what validates. They must say the same.
    for name, rel in DEFAULT_FILE_OF.items():
        assert (DEFAULT_CONFIG_DIR / rel).read_text() == render_yaml(name), (
            f"{rel} is stale: run python -m astuner.config.default_yaml --write"
        )
    assert OmegaConf.to_container(load_config(DEFAULT_CONFIG_DIR / "astuner_default.yaml").cfg) == default_tree()


def test_every_key_is_documented_and_applicability_names_real_keys():
    keys = set(valid_keys())
    assert set(APPLIES_ONLY_WITH) <= keys
    for path in keys:
        node, cls = path.split("."), RunConfig
        for part in node[:-1]:
            cls = cls.model_fields[part].annotation
        info = cls.model_fields[node[-1]]
        assert info.description or node[-1] in ("training", "validation", "multi_turn", "trainer", "optim",
                                                 "algorithm", "model", "task_reader", "data", "rollout",
                                                 "task_judge", "trainer_common", "astuner", "trinity", "verl",
                                                 "jsonl_dataset_file", "huggingface_dat_repo"), path


@pytest.mark.parametrize(
    "override, needle",
    [
        ("astuner.trainer_common.total_training_steps=2.5", "must be an integer or null, got 2.5"),
        ("astuner.trainer_common.total_training_steps=abc", "must be an integer or null, got 'abc'"),
        ("astuner.rollout.temperature=0", "'astuner.rollout.temperature' must be > 0"),
        ("astuner.trainer_common.algorithm.epsilon=0", "'astuner.trainer_common.algorithm.epsilon' must be > 0"),
        ("astuner.trainer_common.optim.lr=-1e-5", "'astuner.trainer_common.optim.lr' must be >= 0"),
        ("astuner.rollout.max_model_len=0", "'astuner.rollout.max_model_len' must be >= 1"),
        ("astuner.data.max_response_length=0", "'astuner.data.max_response_length' must be >= 1"),
        ("astuner.experiment_dir=[a]", "'astuner.experiment_dir' must be a string or null"),
        ("astuner.trainer_common.clip_ratio_c=1", "'astuner.trainer_common.clip_ratio_c' must be > 1"),
        ("astuner.trainer_common.max_idle_steps=0", "'astuner.trainer_common.max_idle_steps' must be >= 1"),
        ("astuner.rollout.max_env_worker=1.5", "'astuner.rollout.max_env_worker' must be an integer"),
    ],
)
def test_typed_values_and_ranges(seed_file, elsewhere, override, needle):
    assert needle in config_error(seed_file, [override])


def test_experiment_dir_that_is_a_file(tmp_path, elsewhere):
    (tmp_path / "afile").write_text("x")
    message = config_error(write(tmp_path / "c.yaml", f"astuner: {{experiment_dir: {tmp_path / 'afile'}}}\n"))
    assert "is a file" in message


def test_stages_get_a_typed_frozen_config(seed_file, elsewhere):
    typed = load_config(seed_file, ["astuner.trainer_common.optim.lr=1"]).typed
    assert isinstance(typed, RunConfig)
    assert typed.astuner.trainer_common.optim.lr == 1.0 and isinstance(typed.astuner.trainer_common.optim.lr, float)
    assert typed.astuner.rollout.num_repeat == 4
    with pytest.raises(Exception):
        typed.astuner.rollout.num_repeat = 3


@pytest.mark.parametrize(
    "text, needle",
    [
        ("astuner: {seed: [1\n", "not valid YAML"),
        ("astuner: {seed: 1, seed: 2}\n", "not valid YAML"),
        ("- astuner\n", "mapping"),
        ("", "empty"),
    ],
)
def test_unreadable_yaml(tmp_path, elsewhere, text, needle):
    path = write(tmp_path / "c.yaml", text)
    message = config_error(path)
    assert needle in message and str(path) in message


def test_missing_file_and_directory(tmp_path, elsewhere):
    assert "does not exist" in config_error(tmp_path / "nope.yaml")
    assert "directory" in config_error(tmp_path)


def test_relative_yaml_path_and_experiment_dir(tmp_path, elsewhere):
    write(elsewhere / "sub" / "c.yaml", "astuner: {experiment_dir: out/run1}\n")
    loaded = load_config("sub/c.yaml")
    assert loaded.yaml_path == elsewhere / "sub" / "c.yaml"
    assert loaded.experiment_dir == elsewhere / "out" / "run1"


def test_hydra_global_state_is_left_clean(seed_file, elsewhere):
    from hydra.core.global_hydra import GlobalHydra

    load_config(seed_file)
    with pytest.raises(ConfigError):
        load_config(seed_file, ["astuner.rollout.foo=1"])
    assert not GlobalHydra.instance().is_initialized()


# --- applicability warnings ---------------------------------------------------------------------------------


def test_inapplicable_keys_for_debug_with_hf(seed_file, elsewhere):
    loaded = load_config(seed_file, ["astuner.rollout.engine=hf"])
    keys = inapplicable_keys(loaded, "debug")
    assert "astuner.rollout.max_num_seqs" in keys
    assert "astuner.rollout.tensor_model_parallel_size" in keys
    assert "astuner.trainer_common.trinity_only__n_vllm_engine" in keys
    assert "astuner.rollout.temperature" not in keys
    message = format_inapplicable_warning(keys, "debug", "hf")
    assert all(k in message for k in keys)
    assert "vllm" in message and "trinity" in message


@pytest.mark.parametrize(
    "yaml_text, inactive, active",
    [
        ("astuner: {trainer_common: {kl_loss_coef: 0.1, kl_loss_type: k1}}",
         ["astuner.trainer_common.kl_loss_coef", "astuner.trainer_common.kl_loss_type"], []),
        ("astuner: {trainer_common: {use_kl_loss: true, kl_loss_coef: 0.1}}", [], ["astuner.trainer_common.kl_loss_coef"]),
        ("astuner: {trainer_common: {algorithm: {norm_adv_by_std_in_grpo: false, epsilon: 0.01}}}",
         ["astuner.trainer_common.algorithm.epsilon"], []),
        ("astuner: {task_reader: {type: jsonl_dataset_file, huggingface_dat_repo: {dataset_path: x}}}",
         ["astuner.task_reader.huggingface_dat_repo.dataset_path"], []),
        ("astuner: {task_reader: {type: huggingface_dat_repo, jsonl_dataset_file: {training: {file_path: a}}}}",
         ["astuner.task_reader.jsonl_dataset_file.training.file_path"], []),
        ("astuner: {trainer_common: {optim: {min_lr_ratio: 0.1}}}", ["astuner.trainer_common.optim.min_lr_ratio"], []),
        ("astuner: {trainer_common: {optim: {lr_scheduler_type: cosine, min_lr_ratio: 0.1}}}", [],
         ["astuner.trainer_common.optim.min_lr_ratio"]),
        ("astuner: {trainer_common: {optim: {lr_scheduler_type: linear, min_lr_ratio: 0.1}}}", [],
         ["astuner.trainer_common.optim.min_lr_ratio"]),
        ("astuner: {trainer_common: {algorithm: {adv_estimator: rloo, norm_adv_by_std_in_grpo: true, epsilon: 0.1}}}",
         ["astuner.trainer_common.algorithm.epsilon", "astuner.trainer_common.algorithm.norm_adv_by_std_in_grpo"], []),
        ("astuner: {trainer_common: {algorithm: {filter_groups: {metric: acc, max_num_gen_batches: 3}}}}",
         ["astuner.trainer_common.algorithm.filter_groups.max_num_gen_batches",
          "astuner.trainer_common.algorithm.filter_groups.metric"], []),
        ("astuner: {trainer_common: {policy_loss: {loss_mode: gspo}, clip_ratio_c: 5, clip_ratio_low: 0.0003, "
         "clip_ratio_high: 0.0004}}", ["astuner.trainer_common.clip_ratio_c"], ["astuner.trainer_common.clip_ratio_low"]),
        ("astuner: {trainer_common: {rollout_is_cap: 2.0}}", ["astuner.trainer_common.rollout_is_cap"], []),
        ("astuner: {trainer_common: {old_logprobs: trainer, rollout_is_cap: 2.0}}", [],
         ["astuner.trainer_common.rollout_is_cap"]),
    ],
)
def test_keys_that_act_only_under_another_setting(tmp_path, elsewhere, yaml_text, inactive, active):
    loaded = load_config(write(tmp_path / "c.yaml", yaml_text + "\n"))
    keys = inapplicable_keys(loaded, "debug")
    assert keys == inactive
    assert not set(active) & set(keys)


def test_num_repeat_one_warns_no_baseline(tmp_path, elsewhere):
    from astuner.config import config_warnings

    loaded = load_config(write(tmp_path / "c.yaml", "astuner: {rollout: {num_repeat: 1}}\n"))
    assert any("no baseline" in w for w in config_warnings(loaded, "debug"))
    assert config_warnings(load_config(write(tmp_path / "d.yaml", "astuner: {seed: 1}\n")), "debug") == []


def test_grpo_family_settings_that_defeat_their_purpose_warn(tmp_path, elsewhere):
    from astuner.config import config_warnings

    def warnings(text):
        return config_warnings(load_config(write(tmp_path / "c.yaml", text + "\n")), "debug")

    assert any("seq-mean-token-sum-norm" in w for w in warnings(
        "astuner: {trainer_common: {algorithm: {adv_estimator: dr_grpo}}}"))
    assert warnings("astuner: {trainer_common: {algorithm: {adv_estimator: dr_grpo}, "
                    "loss_agg_mode: seq-mean-token-sum-norm}}") == []
    assert any("3e-4" in w for w in warnings("astuner: {trainer_common: {policy_loss: {loss_mode: gspo}}}"))
    offline = warnings("astuner: {trainer_common: {algorithm: {type: sft}, clip_ratio_low: 0.1}, "
                       "rollout: {num_repeat: 4, max_model_len: 512}, offline_data: {train_file: a.jsonl}}")
    assert any("without rollouts" in w and "astuner.rollout.num_repeat" in w and "clip_ratio_low" in w
               and "max_model_len" not in w for w in offline)
    # dpo takes one optimizer step per batch (the catalog): a mini-batch split is named as doing nothing.
    pairs = "offline_data: {train_file: a.jsonl}, trainer_common: {algorithm: {type: TYPE}, mini_batch_num: 2}"
    assert any("mini_batch_num has no effect" in w for w in warnings("astuner: {" + pairs.replace("TYPE", "dpo") + "}"))
    assert not any("mini_batch_num" in w for w in warnings("astuner: {" + pairs.replace("TYPE", "sft") + "}"))


def test_inapplicable_keys_follow_engine_and_backbone(seed_file, elsewhere):
    loaded = load_config(seed_file, ["astuner.rollout.engine=vllm"])
    keys = inapplicable_keys(loaded, "debug")
    assert "astuner.rollout.max_num_seqs" not in keys
    assert keys == ["astuner.trainer_common.trinity_only__n_vllm_engine"]
    assert inapplicable_keys(loaded, "trinity") == []
    hf = inapplicable_keys(load_config(seed_file, ["astuner.rollout.engine=hf"]), "debug")
    assert "astuner.rollout.max_num_seqs" in hf


def test_default_values_are_never_reported(tmp_path, elsewhere):
    loaded = load_config(write(tmp_path / "c.yaml", "astuner: {seed: 1}\n"))
    assert inapplicable_keys(loaded, "debug") == []
    assert format_inapplicable_warning([], "debug", "hf") is None


# --- old names ----------------------------------------------------------------------------------------------

OLD_BUDGET, NEW_BUDGET = "trinity.trainer.max_token_len_per_gpu", "astuner.trainer_common.micro_batch_token_budget"


def test_an_old_name_sets_the_new_key_with_one_notice(seed_file, elsewhere):
    from astuner.config import config_warnings

    loaded = load_config(seed_file, ["astuner.rollout.engine=vllm"])  # the seed sets both old names
    tc = loaded.typed.astuner.trainer_common
    assert tc.micro_batch_token_budget == 13000 and tc.n_explorers == 2
    assert loaded.cfg.astuner.trainer_common.n_explorers == 2
    notices = [w for w in config_warnings(loaded, "trinity") if "old name" in w]
    assert notices == ["astuner.trainer_common.trinity_only__n_vllm_engine is an old name: use "
                       "astuner.trainer_common.n_explorers.", f"{OLD_BUDGET} is an old name: use {NEW_BUDGET}."]
    # An override of either name wins over the YAML's, and both names hold its value.
    for override in (f"{OLD_BUDGET}=2048", f"{NEW_BUDGET}=2048"):
        loaded = load_config(seed_file, [override])
        assert loaded.typed.astuner.trainer_common.micro_batch_token_budget == 2048
        assert loaded.cfg.trinity.trainer.max_token_len_per_gpu == 2048


def test_the_new_name_alone_gets_no_notice_and_fills_the_old(tmp_path, elsewhere):
    from astuner.config import config_warnings

    loaded = load_config(write(tmp_path / "c.yaml", "astuner: {trainer_common: {micro_batch_token_budget: 4096}}\n"))
    assert loaded.cfg.trinity.trainer.max_token_len_per_gpu == 4096
    assert config_warnings(loaded, "debug") == []


def test_an_old_and_a_new_name_set_to_different_values_is_an_error(tmp_path, elsewhere):
    path = write(tmp_path / "c.yaml", "astuner: {trainer_common: {micro_batch_token_budget: 4096}}\n"
                                      "trinity: {trainer: {max_token_len_per_gpu: 2048}}\n")
    message = config_error(path)
    assert OLD_BUDGET in message and NEW_BUDGET in message and "different values" in message
    assert "different values" in config_error(write(tmp_path / "d.yaml", "astuner: {seed: 1}\n"),
                                              [f"{OLD_BUDGET}=1024", f"{NEW_BUDGET}=2048"])
    same = write(tmp_path / "e.yaml", "astuner: {trainer_common: {micro_batch_token_budget: 2048}}\n"
                                      "trinity: {trainer: {max_token_len_per_gpu: 2048}}\n")
    assert load_config(same).typed.astuner.trainer_common.micro_batch_token_budget == 2048


def test_every_old_name_has_the_type_and_default_of_its_new_key():
    from astuner.config.schema import old_names
    from astuner.config.validate import default_at

    assert old_names() == {OLD_BUDGET: NEW_BUDGET,
                           "astuner.trainer_common.trinity_only__n_vllm_engine": "astuner.trainer_common.n_explorers"}
    for old, new in old_names().items():
        assert default_at(old) == default_at(new) and default_at(new)[0]


def test_a_sync_method_that_is_not_implemented_is_refused(tmp_path, elsewhere):
    path = write(tmp_path / "c.yaml", "trinity: {synchronizer: {sync_method: nccl}}\nastuner: {seed: 1}\n")
    message = config_error(path)
    assert "trinity.synchronizer.sync_method" in message and "only object_store is implemented" in message
    assert "Ray's object store" in message


# --- backups ------------------------------------------------------------------------------------------------


def test_save_config_writes_composed_and_verbatim_copies(seed_file, elsewhere):
    loaded = load_config(seed_file, ["astuner.seed=3"])
    out = save_config(loaded)
    assert out == loaded.experiment_dir == elsewhere / "launcher_record" / "math_agent"
    composed = OmegaConf.load(out / "config.yaml")
    assert "hydra" not in composed and "defaults" not in composed
    assert composed.astuner.seed == 3
    assert composed.astuner.rollout.max_num_seqs == 40
    assert OmegaConf.to_container(composed) == OmegaConf.to_container(loaded.cfg)
    assert (out / "math_agent.yaml").read_text() == SEED_YAML


def test_save_config_does_not_clobber_a_yaml_named_config(tmp_path, elsewhere):
    path = write(tmp_path / "config.yaml", "astuner: {seed: 9}\n")
    out = save_config(load_config(path))
    assert (out / "user_config.yaml").read_text() == path.read_text()
    assert OmegaConf.load(out / "config.yaml").astuner.data.train_batch_size == 32


def test_config_package_imports_nothing_heavy():
    code = (
        "import sys, astuner.config, astuner.cli\n"
        "heavy = [m for m in ('torch', 'vllm', 'ray', 'transformers', 'datasets') if m in sys.modules]\n"
        "print(heavy)\n"
        "sys.exit(1 if heavy else 0)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert result.returncode == 0, result.stdout + result.stderr
