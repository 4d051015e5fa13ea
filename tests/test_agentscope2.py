"""AgentScope 2.x, in its own environment (.venv-as2: AgentScope 2.x needs mcp>=2, the 1.x line of the main
environment needs mcp<2; scripts/test.sh runs this file there). Its `Agent` with a `Toolkit` trains unchanged
through the CLI, with its `OpenAIChatModel` pointed at the loopback endpoint, and as a `tune()`-style function
whose `model` is AgentScope 2.x's own model object. The tiny model's first call of each episode is a scripted
tool call (tests/scripted_engine.py)."""

from __future__ import annotations

import pytest
from scripted_engine import train_framework_agent

from conftest import REPO


@pytest.mark.parametrize("workflow", ["agentscope2_agent.py->AgentScope2CodeAgent",
                                      "agentscope2_agent.py->run_agent"])
@pytest.mark.slow
def test_agentscope2_agent_trains_unchanged(tmp_path, tiny_model_dir, monkeypatch, workflow):
    train_framework_agent(REPO, tmp_path, tiny_model_dir, monkeypatch, workflow, steps=3)


@pytest.mark.slow
def test_a_function_workflow_gets_each_named_agents_model(tmp_path, tiny_model_dir, monkeypatch):
    import json

    train_framework_agent(REPO, tmp_path, tiny_model_dir, monkeypatch, "agentscope2_agent.py->run_named_agent",
                          steps=1, extra=("+astuner.agents.coder.model=policy",))
    episodes = [json.loads(x) for x in (tmp_path / "trajectories" / "train_step_000001.jsonl").read_text().splitlines()]
    assert {c["agent"] for e in episodes for c in e["calls"]} == {"coder"}
