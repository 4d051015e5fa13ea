"""OpenEnv environments played unchanged (astuner/environments/openenv.py): the real package, the tutorial's
MCP environment (tutorial/openenv/calc_env) served by uvicorn on this machine, a model scripted where the
environment's side is what is checked, a server killed mid-run and restarted, and the tutorial's commands in
tests/test_tutorial_commands.py."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import sys

import pytest

from astuner.environments.openenv import (
    EpisodeJudge,
    EpisodeWorkflow,
    _arguments,
    observation_text,
    openai_tools,
    tool_result_text,
)
from astuner.errors import UserError
from astuner.task_reader.openenv_reader import RECIPE_KEY
from astuner.types import Task
from astuner.workflow import WorkflowTask
from conftest import REPO

YAML = REPO / "tutorial" / "openenv" / "calc.yaml"


@pytest.fixture(autouse=True)
def fresh_servers():
    """Each test starts and ends with no environment server of this process (another module's run may have left
    some: a process keeps its servers until it exits)."""
    from astuner.environments import openenv_servers

    openenv_servers.stop_all()
    yield
    openenv_servers.stop_all()


def test_what_the_model_reads_of_observations_and_tool_results():
    assert observation_text({"done": False, "reward": 0.0, "metadata": {}}, {"question": "What is 2 + 3?"}) == \
        "What is 2 + 3?"
    assert observation_text({"board": "X..", "turn": 2, "reward": 1.0, "done": False}) == '{"board": "X..", "turn": 2}'
    assert tool_result_text({"result": {"data": 7, "content": [{"type": "text", "text": "7"}]}}) == "7"
    assert tool_result_text({"result": {"data": None, "content": [{"type": "text", "text": "a"},
                                                                    {"type": "text", "text": "b"}]}}) == "a b"
    assert tool_result_text({"error": {"error_type": "tool_not_found", "message": "no tool 'mul'"}}) == \
        "error: no tool 'mul'"
    tools = openai_tools([{"name": "add", "description": "Add.", "input_schema": {"type": "object", "properties": {
        "a": {"type": "integer"}}, "required": ["a"]}}])
    assert tools == [{"type": "function", "function": {"name": "add", "description": "Add.", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}}}]
    assert _arguments('{"a": 1}') == {"a": 1} and _arguments("{not json") == {} and _arguments("[1]") == {}


def _tasks(n: int = 2, overrides: tuple = ()):
    from astuner.config import load_config
    from astuner.task_reader import build_task_reader

    loaded = load_config(YAML, [f"astuner.task_reader.openenv.size={n}", *overrides])
    return build_task_reader(loaded.typed, YAML.parent).training_tasks()


class Solver:
    """A model that uses the tools as asked: `add` the question's two numbers, then submit the tool's result
    (plus `off`: 1 to answer wrong)."""

    def __init__(self, off: int = 0) -> None:
        self.off, self.calls = off, []

    async def chat(self, messages, tools=None):
        self.calls.append(([dict(m) for m in messages], tools))
        last = messages[-1]
        if last["role"] == "user":
            a, b = map(int, re.findall(r"(\d) \+ (\d)", last["content"])[0])
            return _call("add", {"a": a, "b": b})
        return _call("submit_answer", {"answer": int(last["content"]) + self.off})


def _call(name: str, arguments: dict) -> dict:
    return {"role": "assistant", "content": "", "tool_calls": [
        {"id": f"call-{name}", "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}]}


@pytest.mark.slow
def test_an_episode_offers_the_environments_tools_and_takes_its_reward():
    task = _tasks(1)[0]
    assert task.metadata[RECIPE_KEY]["app"] == "server.app:app"  # from the package's own openenv.yaml

    async def play(model):
        return await EpisodeWorkflow().execute(WorkflowTask(task), model)

    right, wrong = Solver(), Solver(off=1)
    output = asyncio.run(play(right))
    assert EpisodeJudge(None).compute_reward(WorkflowTask(task), output) == (1.0, True)
    assert output.metrics == {"unfinished": 0.0, "turns": 2.0}
    (first, tools), (second, _) = right.calls
    assert [t["function"]["name"] for t in tools] == ["add", "submit_answer"]
    assert first == [{"role": "user", "content": first[0]["content"]}] and "+" in first[0]["content"]
    assert second[-1] == {"role": "tool", "tool_call_id": "call-add", "content": str(int(second[-1]["content"]))}
    output = asyncio.run(play(wrong))
    assert EpisodeJudge(None).compute_reward(WorkflowTask(task), output) == (0.0, False)


def test_a_missing_package_an_unknown_folder_and_an_app_that_does_not_start_stop_at_start(tmp_path, monkeypatch):
    with pytest.raises(UserError, match="app_dir='nowhere': no such folder"):
        _tasks(overrides=("astuner.task_reader.openenv.app_dir=nowhere",))
    with pytest.raises(UserError, match="openenv.yaml does not exist"):
        _tasks(overrides=(f"astuner.task_reader.openenv.app_dir={tmp_path}",))
    (tmp_path / "broken.py").write_text("raise ImportError('the environment needs numpy 9')\n")
    with pytest.raises(UserError, match="exited with code .* the environment needs numpy 9"):
        _tasks(overrides=(f"astuner.task_reader.openenv.app_dir={tmp_path}", "astuner.task_reader.openenv.app=broken:app"))
    monkeypatch.setitem(sys.modules, "openenv.core", None)
    with pytest.raises(UserError, match=r"pip install 'astuner\[openenv\]'"):
        _tasks()


def solver_reply(tokenizer):
    """The engine's side of Solver, as text the hermes parser reads: `add` first, then submit what it returned."""

    def reply(prompt_ids):
        prompt = tokenizer.decode(prompt_ids)
        results = re.findall(r"<tool_response>\s*(\d+)\s*</tool_response>", prompt)  # (the system prompt names tags)
        if not results:
            a, b = map(int, re.findall(r"What is (\d) \+ (\d)", prompt)[-1])
            return f'<tool_call>\n{{"name": "add", "arguments": {{"a": {a}, "b": {b}}}}}\n</tool_call>'
        total = int(results[-1])
        return f'<tool_call>\n{{"name": "submit_answer", "arguments": {{"answer": {total}}}}}\n</tool_call>'
    return reply


@pytest.mark.slow
def test_a_server_killed_mid_run_is_restarted_and_its_episode_played_again(demo_tokenizer):
    from astuner.environments import openenv_servers
    from astuner.monitor.metrics import pipeline_metrics
    from astuner.rollout import RolloutRunner
    from test_rollout import TextEngine, settings

    tasks = _tasks(2)
    reply = solver_reply(demo_tokenizer)
    killed = []

    def killing_reply(prompt_ids):
        if not killed:  # the first answer of the run: the server dies under the episode
            (pool,) = openenv_servers._POOLS.values()
            killed.append(pool.servers[0].proc.pid)
            os.killpg(pool.servers[0].proc.pid, signal.SIGKILL)
            pool.servers[0].proc.wait()
        return reply(prompt_ids)

    runner = RolloutRunner(settings(num_repeat=2, max_env_worker=1, env_retries=1, episode_timeout=60.0),
                           TextEngine(demo_tokenizer, reply=killing_reply), demo_tokenizer, EpisodeWorkflow,
                           EpisodeJudge(None), (demo_tokenizer.eos_token_id,))
    try:
        episodes = runner.run(tasks)
        (pool,) = openenv_servers._POOLS.values()
        assert killed and pool.restarts == 1 and pool.servers[0].proc.pid != killed[0]
    finally:
        runner.close()
    assert [(e.flags, e.reward, e.env_retries) for e in episodes] == [([], 1.0, 1)] + [([], 1.0, 0)] * 3
    metrics = pipeline_metrics(episodes, {})
    assert (metrics["env/failed"], metrics["env/retried"]) == (1.0, 1.0)
