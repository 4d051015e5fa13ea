"""AgentScope 2.x, in its own environment (.venv-as2: AgentScope 2.x needs mcp>=2, the 1.x line of the main
environment needs mcp<2; scripts/test.sh runs this file there). Its `Agent` with a `Toolkit` trains unchanged
through the CLI, with its `OpenAIChatModel` pointed at the loopback endpoint, and as a `tune()`-style function
whose `model` is AgentScope 2.x's own model object. The tiny model's first call of each episode is a scripted
tool call (tests/scripted_engine.py)."""

from __future__ import annotations

import json

import pytest
import scripted_engine

from astuner.cli import main
from conftest import REPO

STEPS = 3


@pytest.mark.parametrize("workflow", ["agentscope2_agent.py->AgentScope2CodeAgent",
                                      "agentscope2_agent.py->run_agent"])
def test_agentscope2_agent_trains_unchanged(tmp_path, tiny_model_dir, monkeypatch, workflow):
    engines = scripted_engine.install(monkeypatch, scripted_engine.hermes_call(
        "lookup_code", "name", r"access code of ([A-Z][a-z]+ [A-Z][a-z]+)\?"))
    code = main(["--conf", str(REPO / "tutorial/frameworks/frameworks.yaml"), "--backbone", "debug",
                 f"astuner.experiment_dir={tmp_path}", f"astuner.model.path={tiny_model_dir}",
                 "astuner.rollout.engine=hf", f"astuner.rollout.agentscope_workflow='{workflow}'",
                 "astuner.data.train_batch_size=2", "astuner.rollout.num_repeat=2",
                 "astuner.rollout.max_response_length_in_one_turn=48", "astuner.rollout.max_model_len=2048",
                 "astuner.rollout.compute_madness_checklist=[]", "astuner.trainer_common.val_before_train=false",
                 f"astuner.trainer_common.total_training_steps={STEPS}", "astuner.trainer_common.test_freq=99",
                 "astuner.trainer_common.save_freq=99", "trinity.trainer.max_token_len_per_gpu=4096"])
    assert code == 0
    metrics = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    train = [m for m in metrics if "train/failure_rate" in m]
    assert len(train) == STEPS and all(m["train/failure_rate"] == 0 for m in train)
    for step in range(1, STEPS + 1):
        episodes = [json.loads(line) for line in
                    (tmp_path / "trajectories" / f"train_step_{step:06d}.jsonl").read_text().splitlines()]
        assert len(episodes) == 4 and not any(e["flags"] for e in episodes), [e["error_summary"] for e in episodes]
        for e in episodes:
            first, second = e["calls"][0], e["calls"][1]
            assert first["tool_calls"][0]["name"] == "lookup_code"
            assert "The access code of" in second["prompt"] and second["prompt"].startswith(first["prompt"])
    assert engines[0].scripted >= 4 * STEPS
