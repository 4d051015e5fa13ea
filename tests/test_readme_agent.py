"""README.md followed as written: the "Your own agent" blocks build a tool agent that trains, the log viewer's route
table matches the app, and every run folder a tutorial README reads is one that its own commands write."""

from __future__ import annotations

import json
import re
import shlex
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from astuner.cli import main

from conftest import REPO

FENCE = re.compile(r"^( *)```(\w*)\n(.*?)^\1```", re.MULTILINE | re.DOTALL)
FILE_COMMENT = re.compile(r"# (\S+\.(?:py|yaml))\n")


def section(text: str, heading: str) -> str:
    start = text.index(f"\n## {heading}\n")
    end = text.find("\n## ", start + 1)
    return text[start:end if end >= 0 else None]


def code_blocks(markdown: str) -> list[tuple[str, str]]:
    """(language, body) of each fenced block, list-item indentation removed."""
    return [(lang, textwrap.dedent(indent_body(indent, body))) for indent, lang, body in FENCE.findall(markdown)]


def indent_body(indent: str, body: str) -> str:
    # Blank lines inside an indented block carry no indentation; dedent handles the rest.
    return "\n".join(line if line.strip() else "" for line in body.splitlines()) + "\n"


def write_own_agent(readme: str, folder: Path) -> list[str]:
    """Write the files the section names into `folder`; return its `astuner ...` command as arguments."""
    files, jsonl, commands = {}, [], []
    for lang, body in code_blocks(section(readme, "Your own agent")):
        named = FILE_COMMENT.match(body)
        if lang in ("python", "yaml") and named:
            files[named.group(1)] = body
        elif lang == "jsonl":
            jsonl.append(body)
        elif lang == "bash" and body.startswith("astuner "):
            commands.append(shlex.split(body, comments=True))
    assert {"my_agent.py", "my_judge.py", "my_agent.yaml"} <= set(files), f"README names the files {sorted(files)}"
    assert len(jsonl) == 2 and len(commands) == 1, "the section should show the training and validation tasks " \
        "and one command"
    for name, body in files.items():
        (folder / name).write_text(body)
    # The task files go where the YAML reads them: the training tasks first, then the validation tasks.
    files = yaml.safe_load(files["my_agent.yaml"])["astuner"]["task_reader"]["jsonl_dataset_file"]
    for split, body in zip(("training", "validation"), jsonl):
        (folder / files[split]["file_path"]).parent.mkdir(parents=True, exist_ok=True)
        (folder / files[split]["file_path"]).write_text(body)
    return commands[0]


@pytest.mark.slow
def test_readme_own_agent_trains_two_steps_as_written(tmp_path, tiny_model_dir, monkeypatch, capsys):
    command = write_own_agent((REPO / "README.md").read_text(), tmp_path)
    assert command[0] == "astuner"
    monkeypatch.chdir(tmp_path)  # "from the folder that holds the files"
    # Only the model and the sizes change: a tiny random model and 2 short steps keep this inside CI's budget.
    code = main(command[1:] + [
        f"astuner.model.path={tiny_model_dir}", "astuner.rollout.engine=hf", "astuner.rollout.num_repeat=2",
        "astuner.rollout.max_response_length_in_one_turn=16", "astuner.trainer_common.total_training_steps=2",
    ])
    err = capsys.readouterr().err
    assert code == 0, err[-3000:]
    # The folder rule the section states: launcher_record/<the YAML's file name>/ under the working directory.
    run = tmp_path / "launcher_record" / Path(command[command.index("--conf") + 1]).stem
    assert run.name == "my_agent" and f"config saved in {run}" in err
    train = [m for m in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "train/reward_mean" in m]
    # A failed workflow or judge (a missing import, a wrong metadata key) would show as failed episodes.
    assert len(train) == 2 and all(m["train/failure_rate"] == 0 for m in train), train
    val = [m for m in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "val/failure_rate" in m]
    assert [m["step"] for m in val] == [0, 2] and all(m["val/failure_rate"] == 0 for m in val), val
    episodes = [json.loads(line) for line in (run / "trajectories/train_step_000001.jsonl").read_text().splitlines()]
    assert len(episodes) == 4 and all(e["calls"] for e in episodes)
    assert "convert" in episodes[0]["calls"][0]["prompt"] and "from_unit" in episodes[0]["calls"][0]["prompt"]
    assert episodes[0]["task_id"].startswith("train-")  # the README's default id
    assert (run / "global_step_2" / "config.json").is_file()


def test_readme_own_agent_tasks_can_be_won_and_its_yaml_runs_the_steps_it_states(tmp_path, monkeypatch):
    """Each example task: its tool's printed result is within the judge's tolerance of the answer (a `:g` format
    rounds 3 mi to 4828.03); the YAML's steps are what its tasks, batch and epochs give."""
    write_own_agent((REPO / "README.md").read_text(), tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    import importlib

    agent = importlib.import_module("my_agent")
    tolerance = float(re.search(r"\) < ([0-9.e-]+)", (tmp_path / "my_judge.py").read_text()).group(1))
    units = {"millimetres": "mm", "centimetres": "cm", "metres": "m", "kilometres": "km", "miles": "mi"}
    rows = [json.loads(line) for line in (tmp_path / "data" / "train.jsonl").read_text().splitlines() if line]
    held_out = [json.loads(line) for line in (tmp_path / "data" / "val.jsonl").read_text().splitlines() if line]
    for row in rows + held_out:
        to_unit, value, from_unit = re.match(r"How many (\w+) are ([\d.]+) (\w+)\?", row["question"]).groups()
        text = agent.convert(float(value), units[from_unit], units[to_unit]).content[0]["text"]
        printed = float(text.split("= ")[1].split()[0])
        assert abs(printed - float(row["answer"])) < tolerance, (row, text)
    trainer = yaml.safe_load((tmp_path / "my_agent.yaml").read_text())["astuner"]
    batch = trainer["data"]["train_batch_size"]
    epochs = trainer["trainer_common"].get("total_epochs", 1)
    stated = trainer["trainer_common"].get("total_training_steps")
    assert stated is None or stated == -(-len(rows) // batch) * epochs, trainer
    sys.modules.pop("my_agent", None)


def test_readme_logview_route_table_matches_the_app(tmp_path):
    from astuner.logview.app import build_app

    table = section((REPO / "README.md").read_text(), "Seeing what the agent did: the log viewer")
    documented = {re.sub(r"\{\w+\}", "{}", route.split("?")[0])
                  for route in re.findall(r"^\| `GET (/api/[^`]*)`", table, re.MULTILINE)}
    served = {re.sub(r"\{\w+(:\w+)?\}", "{}", r.path) for r in build_app(tmp_path).routes if r.path.startswith("/api")}
    assert documented == served


def tutorial_readmes() -> list[Path]:
    return sorted((REPO / "tutorial").glob("**/README.md"))


@pytest.mark.parametrize("readme", tutorial_readmes(), ids=lambda p: str(p.relative_to(REPO / "tutorial").parent))
def test_tutorial_readme_reads_only_run_folders_its_commands_write(readme):
    """A path launcher_record/<run>/... in a tutorial's commands names a folder one of its `astuner --conf` runs
    writes: the YAML's file name, or the command's astuner.experiment_dir (`astuner warmstart`: the YAML's name and
    `_warmstart`)."""
    written, read = set(), set()
    for lang, body in code_blocks(readme.read_text()):
        if lang != "bash":
            continue
        for line in body.replace("\\\n", " ").splitlines():
            args = shlex.split(line, comments=True)
            if args[:2] == ["astuner", "--conf"]:
                chosen = [a.split("=", 1)[1] for a in args if a.startswith("astuner.experiment_dir=")]
                written.add(chosen[0] if chosen else f"launcher_record/{Path(args[2]).stem}")
            if args[:3] == ["astuner", "warmstart", "--conf"]:  # its SFT's folder: <experiment_dir>_warmstart
                written.add(f"launcher_record/{Path(args[3]).stem}_warmstart")
            read |= {m for a in args for m in re.findall(r"launcher_record/[^/\s=]+(?=/)", a)}
    assert read <= written, f"{readme}: reads {sorted(read - written)}, its commands write {sorted(written)}"


def test_readme_hand_written_demonstration_is_one_valid_sft_row(demo_tokenizer):
    """The fallback row the section shows, its wrapped lines joined, is an offline_data row SFT trains on: both
    tool calls and the computed answer are trained tokens."""
    blocks = [body for lang, body in code_blocks(section((REPO / "README.md").read_text(), "Your own agent"))
              if lang == "text" and body.lstrip().startswith('{"tools"')]
    assert len(blocks) == 1
    row = json.loads(" ".join(line.strip() for line in blocks[0].splitlines()))
    assert [m["role"] for m in row["messages"]] == ["user", "assistant", "tool", "assistant", "tool", "assistant"]
    assert {t["function"]["name"] for t in row["tools"]} == {
        c["function"]["name"] for m in row["messages"] for c in m.get("tool_calls", [])}
    from astuner.model_tuner import ChatRenderer
    from astuner.task_reader.offline_data import tokenize_conversation

    example = tokenize_conversation(ChatRenderer(demo_tokenizer), row["messages"], row["tools"], ("<|im_end|>",))
    trained = demo_tokenizer.decode([i for i, m in zip(example.ids, example.mask) if m])
    assert '"name": "stock"' in trained and '"name": "price"' in trained and "\\boxed{87.5}" in trained
