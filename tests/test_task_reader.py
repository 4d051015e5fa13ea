"""Task readers: local files and local `datasets` folders, offline; every bad input is a UserError that says where."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from astuner.errors import UserError
from astuner.task_reader import TASK_READERS, build_task_reader

GSM8K_ROWS = [
    {"question": "Tom has 3 apples and buys 4. How many?", "answer": "3 + 4 = 7\n#### 7", "level": 1},
    {"question": "What is 6 * 12?", "answer": "#### 72", "level": 2},
]


def make_cfg(
    type_="jsonl_dataset_file",
    train=None,
    val=None,
    query_field="question",
    task_id_field=None,
    dataset_path=None,
    dataset_name=None,
    training_split="train",
    validation_split=None,
):
    """The `astuner.task_reader` section of astuner_default.yaml with the given values."""
    return OmegaConf.create(
        {
            "astuner": {
                "task_reader": {
                    "type": type_,
                    "query_field": query_field,
                    "task_id_field": task_id_field,
                    "jsonl_dataset_file": {"training": {"file_path": train}, "validation": {"file_path": val}},
                    "huggingface_dat_repo": {
                        "dataset_path": dataset_path,
                        "dataset_name": dataset_name,
                        "training_split": training_split,
                        "validation_split": validation_split,
                    },
                }
            }
        }
    )


def write_jsonl(path: Path, rows) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def test_registry_names_match_config_contract():
    import typing

    from astuner.config.schema_episode import TaskReaderSection

    declared = set(typing.get_args(TaskReaderSection.model_fields["type"].annotation))
    assert set(TASK_READERS) == declared
    assert {"jsonl_dataset_file", "huggingface_dat_repo", "env_service", "reasoning_gym", "textarena",
            "openenv", "verifiers"} <= declared


def test_unknown_type_suggests_closest(tmp_path):
    with pytest.raises(UserError, match="jsonl_dataset_file"):
        build_task_reader(make_cfg(type_="jsonl_dataset_fil"), tmp_path)


def test_jsonl_rows_become_tasks_with_whole_row_as_metadata(tmp_path):
    path = write_jsonl(tmp_path / "train.jsonl", GSM8K_ROWS)
    val = write_jsonl(tmp_path / "val.jsonl", GSM8K_ROWS[:1])
    reader = build_task_reader(make_cfg(train=str(path), val=str(val)), tmp_path)
    tasks = reader.training_tasks()
    assert [t.task_id for t in tasks] == ["train-0", "train-1"]
    assert tasks[1].main_query == "What is 6 * 12?"
    assert tasks[1].metadata == GSM8K_ROWS[1]
    assert tasks[0].init_messages == []
    assert [t.task_id for t in reader.validation_tasks()] == ["validation-0"]


def test_no_validation_file_gives_empty_list(tmp_path):
    path = write_jsonl(tmp_path / "train.jsonl", GSM8K_ROWS)
    assert build_task_reader(make_cfg(train=str(path)), tmp_path).validation_tasks() == []


def test_field_mapping_task_id_field_and_messages(tmp_path):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    rows = [
        {"uid": 17, "prompt": "first", "messages": messages},
        {"uid": "b", "prompt": "second", "messages": "not a list"},
    ]
    path = write_jsonl(tmp_path / "t.jsonl", rows)
    tasks = build_task_reader(make_cfg(train=str(path), query_field="prompt", task_id_field="uid"), tmp_path)
    tasks = tasks.training_tasks()
    assert [(t.task_id, t.main_query) for t in tasks] == [("17", "first"), ("b", "second")]
    assert tasks[0].init_messages == messages
    assert tasks[1].init_messages == []
    assert tasks[1].metadata["messages"] == "not a list"


def test_json_list_and_json_lines(tmp_path):
    as_list = tmp_path / "list.json"
    as_list.write_text(json.dumps(GSM8K_ROWS, indent=2))
    as_lines = tmp_path / "lines.json"
    as_lines.write_text("\n".join(json.dumps(r) for r in GSM8K_ROWS))
    for path in (as_list, as_lines):
        tasks = build_task_reader(make_cfg(train=str(path)), tmp_path).training_tasks()
        assert [t.metadata for t in tasks] == GSM8K_ROWS


def test_parquet(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist(GSM8K_ROWS), path)
    tasks = build_task_reader(make_cfg(train=str(path)), tmp_path).training_tasks()
    assert [t.metadata for t in tasks] == GSM8K_ROWS
    assert tasks[0].task_id == "train-0"


def test_parquet_bad_row_names_row_index(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "train.parquet"
    pq.write_table(pa.Table.from_pylist([{"question": "ok"}, {"question": ""}]), path)
    with pytest.raises(UserError, match=r"train\.parquet, row 1: field 'question'"):
        build_task_reader(make_cfg(train=str(path)), tmp_path).training_tasks()


@pytest.mark.parametrize(
    "lines, pattern",
    [
        (['{"question": "a"}', "{not json"], r"bad\.jsonl, line 2: invalid JSON"),
        (['{"question": "a"}', "", "[1, 2]"], r"bad\.jsonl, line 3: expected a JSON object"),
        (['{"question": "a"}', '{"q": "b"}'], r"bad\.jsonl, line 2: field 'question' is missing"),
        (['{"question": "   "}'], r"bad\.jsonl, line 1: field 'question' must be a non-empty string"),
        (['{"question": 5}'], r"bad\.jsonl, line 1: field 'question' must be a non-empty string"),
    ],
)
def test_bad_jsonl_rows_name_file_line_and_field(tmp_path, lines, pattern):
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join(lines) + "\n")
    with pytest.raises(UserError, match=pattern):
        build_task_reader(make_cfg(train=str(path)), tmp_path).training_tasks()


def test_bad_json_list_row_names_row_index(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps([{"question": "a"}, "oops"]))
    with pytest.raises(UserError, match=r"bad\.json, row 1: expected an object"):
        build_task_reader(make_cfg(train=str(path)), tmp_path).training_tasks()


def test_missing_task_id_field(tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", [{"id": 1, "question": "a"}, {"question": "b"}])
    with pytest.raises(UserError, match=r"t\.jsonl, line 2: task id field 'id'"):
        build_task_reader(make_cfg(train=str(path), task_id_field="id"), tmp_path).training_tasks()


def test_duplicate_task_ids(tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", [{"id": 1, "question": "a"}, {"id": "1", "question": "b"}])
    with pytest.raises(UserError, match=r"task id '1' appears at line 1 and again at line 2"):
        build_task_reader(make_cfg(train=str(path), task_id_field="id"), tmp_path).training_tasks()


def test_empty_dataset(tmp_path):
    path = tmp_path / "empty.jsonl"
    path.write_text("\n\n")
    with pytest.raises(UserError, match="no rows"):
        build_task_reader(make_cfg(train=str(path)), tmp_path).training_tasks()


def test_relative_path_against_base_dir(tmp_path, monkeypatch):
    config_dir = tmp_path / "configs"
    write_jsonl(config_dir / "data" / "train.jsonl", GSM8K_ROWS)
    monkeypatch.chdir(tmp_path)  # not found from the working directory, so base_dir is used
    tasks = build_task_reader(make_cfg(train="data/train.jsonl"), config_dir).training_tasks()
    assert len(tasks) == 2


def test_relative_path_prefers_working_directory(tmp_path, monkeypatch):
    config_dir = tmp_path / "configs"
    write_jsonl(config_dir / "train.jsonl", GSM8K_ROWS)
    write_jsonl(tmp_path / "train.jsonl", GSM8K_ROWS[:1])
    monkeypatch.chdir(tmp_path)
    assert len(build_task_reader(make_cfg(train="train.jsonl"), config_dir).training_tasks()) == 1


def test_missing_file_fails_at_build_naming_key_and_places(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UserError, match=r"jsonl_dataset_file\.training\.file_path='nope\.jsonl': file not found"):
        build_task_reader(make_cfg(train="nope.jsonl"), tmp_path / "cfg")


def test_training_file_not_set(tmp_path):
    with pytest.raises(UserError, match=r"training\.file_path is not set"):
        build_task_reader(make_cfg(), tmp_path)


def test_unsupported_suffix(tmp_path):
    path = tmp_path / "t.csv"
    path.write_text("question\nq\n")
    with pytest.raises(UserError, match="unsupported file type"):
        build_task_reader(make_cfg(train=str(path)), tmp_path)


def _hf_folder(root: Path) -> Path:
    folder = root / "my_dataset"
    write_jsonl(folder / "train.jsonl", GSM8K_ROWS)
    write_jsonl(folder / "test.jsonl", [{"question": "Held-out question?", "answer": "#### 3", "level": 3}])
    return folder


def test_hf_local_folder_infers_splits(tmp_path, monkeypatch):
    _hf_folder(tmp_path / "configs")
    monkeypatch.chdir(tmp_path)  # relative dataset_path resolves against base_dir
    cfg = make_cfg(type_="huggingface_dat_repo", dataset_path="my_dataset/", validation_split="test")
    reader = build_task_reader(cfg, tmp_path / "configs")
    train, val = reader.training_tasks(), reader.validation_tasks()
    assert [t.task_id for t in train] == ["train-0", "train-1"]
    assert [t.metadata for t in train] == GSM8K_ROWS
    assert [(t.task_id, t.main_query) for t in val] == [("test-0", "Held-out question?")]


def test_hf_no_validation_split(tmp_path):
    folder = _hf_folder(tmp_path)
    reader = build_task_reader(make_cfg(type_="huggingface_dat_repo", dataset_path=str(folder)), tmp_path)
    assert reader.validation_tasks() == []


def test_hf_unknown_split_is_user_error(tmp_path):
    folder = _hf_folder(tmp_path)
    cfg = make_cfg(type_="huggingface_dat_repo", dataset_path=str(folder), validation_split="validation")
    with pytest.raises(UserError, match="validation"):
        build_task_reader(cfg, tmp_path).validation_tasks()


def test_hf_bad_row_names_row_index(tmp_path):
    folder = tmp_path / "ds"
    write_jsonl(folder / "train.jsonl", [{"question": "a"}, {"question": None}])
    cfg = make_cfg(type_="huggingface_dat_repo", dataset_path=str(folder))
    with pytest.raises(UserError, match=r"split 'train'\), row 1: field 'question' is missing"):
        build_task_reader(cfg, tmp_path).training_tasks()


def test_hf_hub_id_offline_is_user_error_and_fast(tmp_path, monkeypatch):
    import datasets

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    # `datasets` reads the offline flag when first imported; make sure it holds even if it was imported earlier.
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True, raising=False)
    monkeypatch.chdir(tmp_path)
    cfg = make_cfg(type_="huggingface_dat_repo", dataset_path="no-such-org/no-such-dataset", dataset_name="main")
    start = time.monotonic()
    with pytest.raises(UserError, match="no hub access at run time"):
        build_task_reader(cfg, tmp_path).training_tasks()
    assert time.monotonic() - start < 30


def test_hf_dataset_path_not_set(tmp_path):
    with pytest.raises(UserError, match="dataset_path is not set"):
        build_task_reader(make_cfg(type_="huggingface_dat_repo"), tmp_path)


def test_importing_task_reader_does_not_import_datasets():
    import subprocess
    import sys

    code = "import sys, astuner.task_reader; print('datasets' in sys.modules, 'pyarrow' in sys.modules)"
    repo = Path(__file__).resolve().parents[1]
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=repo).stdout
    assert out.split() == ["False", "False"]


def test_verifiers_outside_its_own_environment_says_how_to_install_it(monkeypatch):
    """The main environment has no verifiers (it pins mcp==2.0.0, which AgentScope 1.x refuses): a run of one
    stops at start naming the install line and the environment to use (.venv-vf)."""
    import sys

    from astuner.config import load_config
    from conftest import REPO

    monkeypatch.setitem(sys.modules, "verifiers", None)  # as where it is not installed
    yaml = REPO / "tutorial" / "verifiers" / "verifiers.yaml"
    with pytest.raises(UserError, match=r"pip install 'astuner\[verifiers\]'.*\.venv-vf"):
        build_task_reader(load_config(yaml).typed, yaml.parent)


def test_max_samples_take_part_of_the_tasks_as_verl_does(tmp_path):
    import random

    from astuner.task_reader import first_samples

    tasks = list("abcdefgh")
    assert first_samples(tasks, -1, True, 0) == tasks and first_samples(tasks, 8, True, 0) == tasks
    assert first_samples(tasks, 3, False, 0) == ["a", "b", "c"]  # no shuffle: the first N
    # shuffle: N drawn with the seed, kept in their order
    drawn = sorted(random.Random(7).sample(range(8), 3))
    assert first_samples(tasks, 3, True, 7) == [tasks[i] for i in drawn]
    assert first_samples(tasks, 0, True, 7) == []

    train = write_jsonl(tmp_path / "train.jsonl", [{"question": f"q{i}"} for i in range(10)])
    val = write_jsonl(tmp_path / "val.jsonl", [{"question": f"v{i}"} for i in range(6)])
    cfg = make_cfg(train=str(train), val=str(val))
    cfg.astuner.data = {"train_max_samples": 4, "val_max_samples": 2, "shuffle": False}
    reader = build_task_reader(cfg, tmp_path)
    assert [t.main_query for t in reader.training_tasks()] == ["q0", "q1", "q2", "q3"]
    assert [t.main_query for t in reader.validation_tasks()] == ["v0", "v1"]
