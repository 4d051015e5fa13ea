"""The shipped tutorials run through the real CLI: the quick-start for a CPU step with the demo model (the real
135M model), and the ReAct math agent (AgentScope) for a step with the tiny model and the demo tokenizer: its
prompts, tools and trajectories are the demo model's; tests/test_tutorial_commands.py runs its README's commands."""

from __future__ import annotations

import json

import pytest

from astuner.cli import main

from conftest import REPO


@pytest.mark.slow
def test_quickstart_one_step(tmp_path, demo_model_dir):
    code = main(["--conf", str(REPO / "tutorial/quickstart/quickstart.yaml"), "--backbone", "debug",
                 f"astuner.experiment_dir={tmp_path}", "astuner.data.train_batch_size=2",
                 "astuner.rollout.num_repeat=2", "astuner.trainer_common.total_training_steps=1",
                 "astuner.trainer_common.val_before_train=false", "astuner.data.val_max_samples=4"])
    assert code == 0
    record = [json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert record[0]["train/failure_rate"] == 0 and "val/accuracy" in record[-1]
    assert (tmp_path / "global_step_1" / "config.json").is_file()


@pytest.mark.slow
def test_math_agent_one_step_on_cpu(tmp_path, tiny_model_dir, capsys):
    code = main([
        "--conf", str(REPO / "tutorial/example_math_agent/math_agent.yaml"), "--backbone", "debug",
        f"astuner.experiment_dir={tmp_path}",
        f"astuner.model.path={tiny_model_dir}", "astuner.rollout.engine=hf",
        f"astuner.task_reader.huggingface_dat_repo.dataset_path={REPO / 'tutorial/example_math_agent/gsm8k_sample'}",
        "astuner.data.train_batch_size=2", "astuner.rollout.num_repeat=2",
        "astuner.rollout.max_response_length_in_one_turn=192", "astuner.rollout.max_model_len=2048",
        "astuner.trainer_common.total_training_steps=1", "astuner.trainer_common.val_before_train=false",
        "trinity.trainer.max_token_len_per_gpu=2048",
    ])
    err = capsys.readouterr().err
    assert code == 0, err
    assert "max_num_seqs" in err and "tensor_model_parallel_size" in err  # the one inapplicable-keys warning
    steps = [json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    train = [m for m in steps if "train/reward_mean" in m]
    assert len(train) == 1 and all(m["train/failure_rate"] == 0 for m in train)
    episodes = [json.loads(l) for l in (tmp_path / "trajectories/train_step_000001.jsonl").read_text().splitlines()]
    assert len(episodes) == 4 and all(e["calls"] for e in episodes)
    # The ReAct agent offers its Python tool through the built-in tool prompt (SmolLM2's template has none).
    assert "execute_python_code" in episodes[0]["calls"][0]["prompt"]
    assert (tmp_path / "global_step_1" / "model.safetensors").is_file()
