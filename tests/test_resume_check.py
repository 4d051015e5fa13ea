"""A resume cannot mislead: a checkpoint continues only under a config that keeps what it was trained with
(the model, the data, the rollout shape, the reward, the algorithm); allowed changes are named, and the
checkpoint's own saved config is never overwritten."""

from __future__ import annotations

import json
import shutil

import pytest
from omegaconf import OmegaConf
from test_run_contract import write_run

from astuner.cli import main
from astuner.config import load_config, save_config, valid_keys
from astuner.config.resume_keys import UNCLASSIFIED, config_changes, flatten, group_of
from astuner.config.validate import default_at, default_tree
from astuner.errors import UserError
from astuner.resume import checkpoint_config, plan_start

OLD = {"astuner": {"model": {"path": "m1"}, "rollout": {"num_repeat": 4, "temperature": 1.0},
                   "trainer_common": {"total_training_steps": 4, "save_freq": 2, "lora": {"rank": 0},
                                      "algorithm": {"adv_estimator": "grpo"}}}}


def changed(**keys) -> dict:
    new = json.loads(json.dumps(OLD))
    for dotted, value in keys.items():
        node = new
        *parents, leaf = dotted.split("__")
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = value
    return new


def test_model_rollout_shape_and_algorithm_changes_refuse_and_name_old_and_new():
    changes = config_changes(OLD, changed(astuner__model__path="m2", astuner__rollout__num_repeat=8,
                                          astuner__rollout__temperature=0.7,
                                          astuner__trainer_common__lora__rank=8,
                                          astuner__trainer_common__algorithm__adv_estimator="rloo"))
    assert [(c.key, c.old, c.new, c.allowed) for c in changes] == [
        ("astuner.model.path", "m1", "m2", False),
        ("astuner.rollout.num_repeat", 4, 8, False),
        ("astuner.rollout.temperature", 1.0, 0.7, False),
        ("astuner.trainer_common.algorithm.adv_estimator", "grpo", "rloo", False),
        ("astuner.trainer_common.lora.rank", 0, 8, False),
    ]
    assert str(changes[0]) == "astuner.model.path (m1 -> m2; the model)"


def test_length_logging_and_checkpoint_frequency_changes_are_allowed():
    changes = config_changes(OLD, changed(astuner__trainer_common__total_training_steps=8,
                                          astuner__trainer_common__save_freq=1, astuner__project_name="renamed"))
    assert {c.key: c.allowed for c in changes} == {
        "astuner.project_name": True,
        "astuner.trainer_common.save_freq": True,
        "astuner.trainer_common.total_training_steps": True,
    }
    assert config_changes(OLD, OLD) == []


@pytest.mark.parametrize("key, allowed", [
    ("astuner.data.train_batch_size", False),
    ("astuner.task_reader.jsonl_dataset_file.training.file_path", False),
    ("astuner.task_reader.query_field", False),
    ("astuner.rollout.max_response_length_in_one_turn", False),
    ("astuner.task_judge.judge_protocol", False),
    ("astuner.trainer_common.precision", False),
    ("astuner.trainer_common.optim.lr", False),
    ("astuner.seed", False),
    ("astuner.trainer_common.total_epochs", True),
    ("astuner.trainer_common.test_freq", True),
    ("astuner.trainer_common.watchdog_factor", True),
    ("astuner.logview.port", True),
    ("astuner.trainer_common.n_gpus_per_node", True),
    ("astuner.rollout.engine", True),
    ("astuner.teacher.base_url", False),
    ("astuner.teacher.timeout_s", True),
])
def test_each_key_is_in_the_group_the_docs_promise(key, allowed):
    old: dict = {}
    new: dict = {}
    *parents, leaf = key.split(".")
    o, n = old, new
    for p in parents:
        o, n = o.setdefault(p, {}), n.setdefault(p, {})
    o[leaf], n[leaf] = "before", "after"
    [change] = config_changes(old, new)
    assert change.allowed is allowed, change


def test_a_key_the_table_does_not_know_refuses():
    [change] = config_changes({"verl": {"actor": {"x": 1}}}, {"verl": {"actor": {"x": 2}}})
    assert change.group == UNCLASSIFIED and not change.allowed


def test_every_schema_key_has_a_deliberate_group():
    leaves = [k for k in valid_keys() if not isinstance(default_at(k)[1], dict) or not default_at(k)[1]]
    assert leaves
    assert [k for k in leaves if group_of(k) == UNCLASSIFIED and k != "verl"] == []


def test_a_key_added_since_the_checkpoint_is_unchanged_at_its_default():
    defaults = flatten(default_tree())
    new = changed(astuner__rollout__top_k=0)
    assert config_changes(OLD, new, defaults) == []
    [change] = config_changes(OLD, changed(astuner__rollout__top_k=5), defaults)
    assert (change.key, change.old, change.allowed) == ("astuner.rollout.top_k", "(absent)", False)


def test_the_checkpoints_config_is_the_one_of_the_run_that_wrote_it(tmp_path):
    for step in (2, 4, 6):
        (tmp_path / f"global_step_{step}").mkdir()
    assert checkpoint_config(tmp_path / "global_step_2") is None
    for name in ("config.yaml", "config.resumed_2.yaml", "config.resumed_4.yaml"):
        (tmp_path / name).write_text("astuner: {}\n")
    assert checkpoint_config(tmp_path / "global_step_2") == tmp_path / "config.yaml"
    assert checkpoint_config(tmp_path / "global_step_4") == tmp_path / "config.resumed_2.yaml"
    assert checkpoint_config(tmp_path / "global_step_6") == tmp_path / "config.resumed_4.yaml"


def fake_checkpoint(yaml, step: int = 2):
    """A run folder as a first run leaves it: its saved config and a complete checkpoint."""
    loaded = load_config(yaml)
    out = save_config(loaded)
    state = out / f"global_step_{step}" / "astuner_resume" / "state.json"
    state.parent.mkdir(parents=True)
    state.write_text(json.dumps({"step": step}))
    return out


def test_plan_start_refuses_a_changed_model_and_says_how_to_start_fresh(tmp_path, tiny_model_dir):
    yaml = write_run(tmp_path, tiny_model_dir)
    out = fake_checkpoint(yaml)
    with pytest.raises(UserError) as raised:
        plan_start(load_config(yaml, ["astuner.model.path=/elsewhere/model", "astuner.rollout.num_repeat=2"]))
    message = str(raised.value)
    assert f"astuner.model.path ({tiny_model_dir} -> /elsewhere/model; the model)" in message
    assert "astuner.rollout.num_repeat (3 -> 2; the rollout shape)" in message
    # First remedy: another experiment_dir, whose rerun resumes normally (a rerun with disable would not).
    assert "set another astuner.experiment_dir (e.g. " + str(tmp_path / "out_1") in message
    assert "resume_mode=disable" not in message and "set the keys named above back" in message
    assert str(out / "config.yaml") in message
    # The path form of resume_mode is checked too.
    with pytest.raises(UserError, match="astuner.seed"):
        plan_start(load_config(yaml, [f"astuner.trainer_common.resume_mode={out / 'global_step_2'}",
                                      "astuner.seed=7"]))


def test_plan_start_names_allowed_changes_in_one_line(tmp_path, tiny_model_dir):
    yaml = write_run(tmp_path, tiny_model_dir)
    fake_checkpoint(yaml)
    start = plan_start(load_config(yaml, ["astuner.trainer_common.total_training_steps=9"]))
    assert start.checkpoint is not None and start.resumed_step == 2
    assert start.note == ("resuming with allowed config changes: astuner.trainer_common.total_training_steps "
                          "(4 -> 9; the run's length)")
    assert plan_start(load_config(yaml)).note is None


def test_a_resumed_run_saves_its_config_without_overwriting_the_checkpoints(tmp_path, tiny_model_dir):
    yaml = write_run(tmp_path, tiny_model_dir)
    out = fake_checkpoint(yaml)
    first, copy = (out / "config.yaml").read_text(), (out / "tiny.yaml").read_text()
    yaml.write_text(yaml.read_text().replace("save_freq: 2", "save_freq: 1"))
    save_config(load_config(yaml), resumed_at=2)
    assert (out / "config.yaml").read_text() == first and (out / "tiny.yaml").read_text() == copy
    assert OmegaConf.load(out / "config.resumed_2.yaml").astuner.trainer_common.save_freq == 1


@pytest.mark.slow
def test_rerunning_with_another_model_or_num_repeat_exits_2_and_keeps_the_checkpoints_config(
        tmp_path, tiny_model_dir, capsys):
    yaml = write_run(tmp_path, tiny_model_dir)
    one_step = ["astuner.trainer_common.total_training_steps=1", "astuner.trainer_common.save_freq=1"]
    assert main(["--conf", str(yaml), *one_step]) == 0
    out = tmp_path / "out"
    saved = (out / "config.yaml").read_text()
    other_model = tmp_path / "other_model"
    shutil.copytree(tiny_model_dir, other_model)
    capsys.readouterr()

    code = main(["--conf", str(yaml), *one_step, f"astuner.model.path={other_model}", "astuner.rollout.num_repeat=2"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "resume refused" in err and "Traceback" not in err
    assert f"astuner.model.path ({tiny_model_dir} -> {other_model}; the model)" in err
    assert "astuner.rollout.num_repeat (3 -> 2; the rollout shape)" in err
    assert "another astuner.experiment_dir" in err
    assert (out / "config.yaml").read_text() == saved and not list(out.glob("config.resumed_*"))

    # An allowed change resumes (step 1 of 1: nothing left to train), names it, and keeps the first config.
    assert main(["--conf", str(yaml), *one_step, "astuner.trainer_common.test_freq=5"]) == 0
    err = capsys.readouterr().err
    assert "allowed config changes: astuner.trainer_common.test_freq (99999 -> 5;" in err
    assert (out / "config.yaml").read_text() == saved
    assert OmegaConf.load(out / "config.resumed_1.yaml").astuner.trainer_common.test_freq == 5


def test_the_same_data_file_written_relative_dotted_or_absolute_resumes(tmp_path, tiny_model_dir, monkeypatch):
    yaml = write_run(tmp_path, tiny_model_dir)
    monkeypatch.chdir(tmp_path)
    fake_checkpoint(yaml)
    key = "astuner.task_reader.jsonl_dataset_file.training.file_path"
    for same in ("./train.jsonl", str(tmp_path / "train.jsonl"), "../" + tmp_path.name + "/train.jsonl"):
        assert plan_start(load_config(yaml, [f"{key}={same}"])).note is None, same
    # Run from elsewhere: the saved config's relative path is found where its run found it.
    monkeypatch.chdir(tmp_path.parent)
    assert plan_start(load_config(yaml, [f"{key}={tmp_path / 'train.jsonl'}"])).note is None
    (tmp_path / "other.jsonl").write_text((tmp_path / "train.jsonl").read_text())
    with pytest.raises(UserError, match="file_path \\(train.jsonl -> "):
        plan_start(load_config(yaml, [f"{key}={tmp_path / 'other.jsonl'}"]))


def test_a_key_left_at_a_changed_default_is_named_as_the_default_changing(tmp_path, tiny_model_dir):
    yaml = write_run(tmp_path, tiny_model_dir)
    out = fake_checkpoint(yaml)
    key, old_default = "astuner.rollout.top_p", 0.5  # as if the checkpoint's astuner had another default
    saved = OmegaConf.load(out / "config.yaml")
    OmegaConf.update(saved, key, old_default)
    (out / "config.yaml").write_text(OmegaConf.to_yaml(saved))
    with pytest.raises(UserError) as raised:
        plan_start(load_config(yaml))
    message = str(raised.value)
    assert f"{key} (0.5 -> {default_at(key)[1]}; the rollout shape; the default changed, set {key}=0.5" in message
    assert "set the old defaults named above" in message
