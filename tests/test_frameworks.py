"""The agent frameworks people use, trained unchanged through the CLI (tutorial/frameworks/): a LangGraph ReAct
agent over LangChain's ChatOpenAI, the OpenAI Agents SDK and smolagents, on the tiny random model, 3 steps each
(langchain_openai's client cached across steps included). The tiny model cannot write a tool call, so the first
call of every episode is a scripted one (tests/scripted_engine.py), scored by the model itself; the agent must
then run the tool and call the model again with the result."""

from __future__ import annotations

import json

import pytest
import scripted_engine

from astuner.cli import main
from conftest import REPO

FRAMEWORKS = {
    "langgraph": "langgraph_agent.py->LangGraphCodeAgent",
    "openai_agents": "openai_agents_sdk_agent.py->OpenAIAgentsCodeAgent",
    "smolagents": "smolagents_agent.py->SmolagentsCodeAgent",
}
STEPS = 3


@pytest.mark.parametrize("framework", list(FRAMEWORKS))
def test_framework_agent_trains_unchanged(tmp_path, tiny_model_dir, monkeypatch, framework):
    engines = scripted_engine.install(monkeypatch, scripted_engine.hermes_call(
        "lookup_code", "name", r"access code of ([A-Z][a-z]+ [A-Z][a-z]+)\?"))
    code = main(["--conf", str(REPO / "tutorial/frameworks/frameworks.yaml"), "--backbone", "debug",
                 f"astuner.experiment_dir={tmp_path}", f"astuner.model.path={tiny_model_dir}",
                 "astuner.rollout.engine=hf", f"astuner.rollout.agentscope_workflow='{FRAMEWORKS[framework]}'",
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
            # The framework received the call, ran its tool and sent the result back for a second call.
            assert first["tool_calls"][0]["name"] == "lookup_code"
            assert "The access code of" in second["prompt"] and second["prompt"].startswith(first["prompt"])
    assert engines[0].scripted >= 4 * STEPS  # and the final validation's
    assert all(m["rollout/tool_call_rate"] >= 1 and m["rollout/calls_per_episode"] >= 2 for m in train)
    assert all(m["sync/verified"] == 1 for m in train)  # every sync checked against the trainer's weights
