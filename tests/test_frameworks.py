"""The agent frameworks people use, trained unchanged through the CLI (tutorial/frameworks/): a LangGraph ReAct
agent over LangChain's ChatOpenAI, the OpenAI Agents SDK and smolagents, on the tiny random model, 3 steps each
(langchain_openai's client cached across steps included). The tiny model cannot write a tool call, so the first
call of every episode is a scripted one (tests/scripted_engine.py), scored by the model itself; the agent must
then run the tool and call the model again with the result."""

from __future__ import annotations

import pytest
from scripted_engine import train_framework_agent

from conftest import REPO

FRAMEWORKS = {
    "langgraph": "langgraph_agent.py->LangGraphCodeAgent",
    "openai_agents": "openai_agents_sdk_agent.py->OpenAIAgentsCodeAgent",
    "smolagents": "smolagents_agent.py->SmolagentsCodeAgent",
}


@pytest.mark.parametrize("framework", list(FRAMEWORKS))
@pytest.mark.slow
def test_framework_agent_trains_unchanged(tmp_path, tiny_model_dir, monkeypatch, framework):
    train = train_framework_agent(REPO, tmp_path, tiny_model_dir, monkeypatch, FRAMEWORKS[framework], steps=3)
    assert all(m["rollout/tool_call_rate"] >= 1 and m["rollout/calls_per_episode"] >= 2 for m in train)
    assert all(m["sync/verified"] == 1 for m in train)  # every sync checked against the trainer's weights
