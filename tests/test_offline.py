"""SFT, DPO and ORPO on data, and rejection-sampling fine-tuning in the loop: hand-computed losses, the
assistant-token mask on the real tokenizer, and runs through the CLI on the tiny model."""

from __future__ import annotations

import json
import math

import pytest
import torch

from astuner.algorithm.preference import dpo_loss, orpo_loss
from astuner.model_tuner import ChatRenderer
from astuner.task_reader.offline_data import tokenize_conversation

END = ("<|im_end|>",)
TOOL = {"type": "function", "function": {"name": "add", "description": "Add two numbers.",
                                         "parameters": {"type": "object", "properties": {"a": {"type": "integer"},
                                                                                         "b": {"type": "integer"}}}}}


def test_assistant_mask_covers_assistant_turns_only(demo_tokenizer):
    renderer = ChatRenderer(demo_tokenizer)
    messages = [
        {"role": "user", "content": "What is 2 + 3?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "5"},
        {"role": "assistant", "content": "The answer is \\boxed{5}."},
    ]
    ex = tokenize_conversation(renderer, messages, [TOOL], END)
    trained = demo_tokenizer.decode([i for i, m in zip(ex.ids, ex.mask) if m])
    assert '"name": "add"' in trained and "The answer is \\boxed{5}." in trained
    assert trained.count("<|im_end|>") == 2  # each assistant turn ends with its marker: the model learns to stop
    untrained = demo_tokenizer.decode([i for i, m in zip(ex.ids, ex.mask) if not m])
    assert "What is 2 + 3?" in untrained and "<tool_response>" in untrained and "boxed" not in untrained
    # The prompt before the first assistant token is exactly what a rollout's first call sees.
    assert ex.ids[: ex.mask.index(1)] == renderer.render(messages[:1], [TOOL])
    with pytest.raises(ValueError, match="no assistant message"):
        tokenize_conversation(renderer, messages[:1], None, END)


def test_dpo_loss_by_hand():
    # beta 0.5. Pair 1: policy-ref on chosen +1, on rejected -1 -> margin 0.5 * 2 = 1, loss -log sigmoid(1) = 0.3132617.
    # Pair 2: chosen -1, rejected +1 -> margin -1, loss 1.3132617. Mean over P = 2: 0.8132617.
    pi_c, pi_r = torch.tensor([-3.0, -5.0]), torch.tensor([-6.0, -2.0])
    ref_c, ref_r = torch.tensor([-4.0, -4.0]), torch.tensor([-5.0, -3.0])
    contrib, stats = dpo_loss(pi_c, pi_r, ref_c, ref_r, beta=0.5, num_pairs=2)
    assert contrib.sum().item() == pytest.approx(0.8132617, abs=1e-6)
    assert stats["rewards/chosen"].tolist() == [0.5, -0.5] and stats["rewards/accuracy"].tolist() == [1.0, 0.0]


def test_orpo_loss_by_hand():
    # One pair, beta 0.1. Chosen: S = -2 over 4 tokens -> M = -0.5; rejected: S = -6 over 3 tokens -> M = -2.
    # log_odds = (-0.5 + 2) - (log(1 - e^-0.5) - log(1 - e^-2)) = 1.5 - (-0.9327521 + 0.1454135) = 2.2873386
    # NLL = 2 / 4 = 0.5; loss = 0.5 - 0.1 * log sigmoid(2.2873386) = 0.5 + 0.1 * 0.0966335 = 0.5096634
    contrib, stats = orpo_loss(torch.tensor([-2.0]), torch.tensor([-6.0]), chosen_len_P=torch.tensor([4.0]),
                               rejected_len_P=torch.tensor([3.0]), beta=0.1, num_pairs=1, chosen_tokens_total=4.0)
    expected_odds = 1.5 - (math.log(1 - math.exp(-0.5)) - math.log(1 - math.exp(-2)))
    assert stats["log_odds_ratio"].item() == pytest.approx(expected_odds, abs=1e-5)
    assert contrib.sum().item() == pytest.approx(0.5 + 0.1 * math.log1p(math.exp(-expected_odds)), abs=1e-5)


def _write(folder, name, rows):
    path = folder / name
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _config(folder, model_dir, kind, extra=""):
    yaml = folder / f"{kind}.yaml"
    yaml.write_text(f"""
astuner:
  project_name: {kind}
  experiment_dir: {folder / ('out_' + kind)}
  model: {{path: {model_dir}}}
  data: {{train_batch_size: 2}}
  rollout: {{max_model_len: 256}}
  offline_data: {{train_file: train.jsonl, val_file: val.jsonl}}
  trainer_common: {{total_epochs: 3, test_freq: 3, save_freq: 99, algorithm: {{type: {kind}, beta: 0.5}},
                   optim: {{lr: 1.0e-3}} {extra}}}
trinity: {{trainer: {{max_token_len_per_gpu: 512}}}}
""")
    return yaml


def _metrics(folder):
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


def _rows(n):
    return [{"messages": [{"role": "user", "content": f"What is {i} + 1?"},
                          {"role": "assistant", "content": f"{i} + 1 = {i + 1}. The answer is \\boxed{{{i + 1}}}."}]}
            for i in range(n)]


def test_sft_through_the_cli_lowers_the_validation_loss(tmp_path, tiny_model_dir, monkeypatch):
    from astuner.cli import main

    monkeypatch.chdir(tmp_path)
    _write(tmp_path, "train.jsonl", _rows(4))
    _write(tmp_path, "val.jsonl", _rows(4))
    assert main(["--conf", str(_config(tmp_path, tiny_model_dir, "sft"))]) == 0
    out = tmp_path / "out_sft"
    losses = [m["val/loss"] for m in _metrics(out) if "val/loss" in m]
    assert len(losses) == 3 and losses[-1] < losses[0] - 0.5  # steps 0, 3, 6 on the same 4 conversations
    trained = [m for m in _metrics(out) if "actor/sft_loss" in m]
    assert len(trained) == 6 and all(m["actor/num_optimizer_steps"] == 1 for m in trained)
    assert (out / "global_step_6" / "config.json").is_file()


@pytest.mark.parametrize("kind", ["dpo", "orpo"])
def test_preference_training_prefers_the_chosen_answer(tmp_path, tiny_model_dir, monkeypatch, kind):
    from astuner.cli import main

    monkeypatch.chdir(tmp_path)
    pairs = [{"prompt": [{"role": "user", "content": f"What is {i} + 1?"}],
              "chosen": [{"role": "assistant", "content": f"\\boxed{{{i + 1}}}"}],
              "rejected": [{"role": "assistant", "content": "I do not know."}]} for i in range(4)]
    _write(tmp_path, "train.jsonl", pairs)
    _write(tmp_path, "val.jsonl", pairs)
    assert main(["--conf", str(_config(tmp_path, tiny_model_dir, kind))]) == 0
    val = [m for m in _metrics(tmp_path / f"out_{kind}") if "val/loss" in m]
    assert val[-1]["val/loss"] < val[0]["val/loss"]
    assert val[-1]["val/rewards/accuracy"] == 1.0
    if kind == "dpo":
        assert val[0]["val/rewards/margin"] == pytest.approx(0.0, abs=1e-5)  # policy == reference at step 0
        assert val[-1]["val/rewards/margin"] > 0


@pytest.mark.slow
def test_bad_offline_data_names_the_line(tmp_path, tiny_model_dir, monkeypatch, capsys):
    from astuner.cli import main

    monkeypatch.chdir(tmp_path)
    # A blank line counts: the message names the file's own line number.
    (tmp_path / "train.jsonl").write_text(json.dumps(_rows(1)[0]) + "\n\n{not json\n")
    _write(tmp_path, "val.jsonl", _rows(1))
    assert main(["--conf", str(_config(tmp_path, tiny_model_dir, "sft"))]) == 2
    assert "train.jsonl, line 3: invalid JSON" in capsys.readouterr().err
    _write(tmp_path, "train.jsonl", [{"messages": [{"role": "user", "content": "hi"}]}])
    assert main(["--conf", str(_config(tmp_path, tiny_model_dir, "sft"))]) == 2
    assert "line 1: no assistant message" in capsys.readouterr().err
    _write(tmp_path, "train.jsonl", [{"prompt": "hi", "chosen": "a"}])
    assert main(["--conf", str(_config(tmp_path, tiny_model_dir, "dpo"))]) == 2
    assert "field 'rejected' must be a list of chat messages" in capsys.readouterr().err


@pytest.mark.slow
def test_sft_resumes_at_the_exact_batch(tmp_path, tiny_model_dir, monkeypatch):
    from astuner.cli import main

    monkeypatch.chdir(tmp_path)
    _write(tmp_path, "train.jsonl", _rows(6))
    _write(tmp_path, "val.jsonl", _rows(2))
    yaml = _config(tmp_path, tiny_model_dir, "sft")
    every_step = "astuner.trainer_common.save_freq=1"
    assert main(["--conf", str(yaml), every_step, "astuner.trainer_common.total_training_steps=2"]) == 0
    assert main(["--conf", str(yaml), every_step, "astuner.trainer_common.total_training_steps=5"]) == 0
    steps = [m["step"] for m in _metrics(tmp_path / "out_sft") if "actor/sft_loss" in m]
    assert steps == [1, 2, 3, 4, 5]  # each step once, continuing at step 3
    state = json.loads((tmp_path / "out_sft" / "global_step_5" / "astuner_resume" / "state.json").read_text())
    assert (state["epoch"], state["position"]) == (1, 4)  # 6 rows, 2 per step: step 5 ends at row 4 of epoch 1


def test_offline_rows_read_like_task_files(tmp_path):
    from astuner.errors import UserError
    from astuner.task_reader.offline_data import read_rows

    (tmp_path / "train.json").write_text(json.dumps(_rows(2)))
    rows = read_rows(tmp_path / "train.json", "astuner.offline_data.train_file")
    assert [where for where, _ in rows] == ["row 0", "row 1"] and rows[0][1] == _rows(2)[0]
    (tmp_path / "bad.json").write_text(json.dumps([_rows(1)[0], ["not", "an", "object"]]))
    with pytest.raises(UserError, match=r"astuner.offline_data.train_file: .*bad.json, row 1: expected a JSON object"):
        read_rows(tmp_path / "bad.json", "astuner.offline_data.train_file")
    (tmp_path / "train.csv").write_text("a,b\n")
    with pytest.raises(UserError, match="unsupported file type '.csv'"):
        read_rows(tmp_path / "train.csv", "astuner.offline_data.train_file")
