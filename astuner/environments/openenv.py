"""OpenEnv environments (https://github.com/meta-pytorch/OpenEnv), played unchanged from the user's package.

    astuner:
      task_reader:
        type: openenv
        openenv:
          app_dir: my_env          # the environment's package; its openenv.yaml names the app
          app: null                # or "module:attribute" (server.app:app)
          size: 256                # training episodes (reset seeds)
          validation_size: 32
          max_turns: 16            # the model's turns before an episode stops unfinished
          action_field: null       # null: its MCP tools are the agent's tools; else the reply becomes this field

One episode is one session (OpenEnv's WebSocket client, `GenericEnvClient`) on a server of this machine
(astuner/environments/openenv_servers.py), reset with the task's seed and `reset_kwargs`; then turn by turn:

  * tools (`action_field` null, an `MCPEnvironment`): the environment's MCP tools (`list_tools`) are offered to the
    model as OpenAI tools, each tool call the model makes is a `call_tool` step, and its result (or the tool's
    error) is the tool message the model reads next; a reply without a tool call ends the episode.
  * actions (`action_field` set): the model's whole reply is the action `{action_field: reply}`, and the
    observation after it the next user message.

The first user message is the reset's observation, and each later one a step's, as text (a lone text field as
itself, else JSON; OpenEnv's `metadata` included). The episode ends when the environment says done, or after
`max_turns` model turns (counted as `metrics/unfinished`). The reward is the sum of the steps' rewards (None
counts 0), a success when it reaches 1. A server that cannot be reached, a call that times out
(`rollout.env_timeout`) or an error the environment raised is the environment's failure, not a 0: the episode is
flagged and played again on a fresh session, after the server was restarted if it died
(astuner/environments/failures.py).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from astuner.environments import failures as env_failures
from astuner.environments import outcome_of
from astuner.environments.openenv_servers import AppSpec, pool_for
from astuner.model_tuner import ModelTuner
from astuner.task_judge.base_judge import BaseJudge
from astuner.task_reader.openenv_reader import RECIPE_KEY, log_dir
from astuner.workflow import Workflow, WorkflowOutput, WorkflowTask

OUTCOME_KEY = "openenv_outcome"  # WorkflowOutput.metadata: what the judge scores
HIDDEN = ("done", "reward", "metadata")


def observation_text(observation: dict | None, metadata: dict | None = None) -> str:
    """What the model reads of an observation: its one text field as itself, else its fields (and metadata) as
    JSON; `done` and `reward` are the trainer's, not the model's."""
    fields = {k: v for k, v in (observation or {}).items() if k not in HIDDEN and v not in (None, "", [], {})}
    fields.update({k: v for k, v in (metadata or (observation or {}).get("metadata") or {}).items()
                   if v not in (None, "", [], {})})
    if len(fields) == 1 and isinstance(next(iter(fields.values())), str):
        return next(iter(fields.values()))
    return json.dumps(fields, ensure_ascii=False, default=str)


def tool_result_text(observation: dict) -> str:
    """A `call_tool` step's observation as the tool message: the tool's error, its value, or its text content."""
    error = observation.get("error")
    if error:
        return f"error: {error.get('message', error) if isinstance(error, dict) else error}"
    result = observation.get("result") or {}
    if not isinstance(result, dict):
        return str(result)
    if result.get("data") is not None:
        data = result["data"]
        return data if isinstance(data, str) else json.dumps(data, ensure_ascii=False, default=str)
    return " ".join(c.get("text", "") for c in result.get("content") or [] if isinstance(c, dict))


def openai_tools(tools: list[dict]) -> list[dict]:
    """MCP tool descriptions ({name, description, input_schema}) as OpenAI function tools."""
    return [{"type": "function", "function": {
        "name": t["name"], "description": t.get("description") or "",
        "parameters": t.get("input_schema") or t.get("inputSchema") or {"type": "object", "properties": {}}}}
        for t in tools]


class Session:
    """One episode's session on a leased server; every call an EnvironmentFailure when it fails."""

    def __init__(self, recipe: dict) -> None:
        self.recipe = recipe
        self.name = f"{Path(recipe['app_dir']).name} ({recipe['app']})"  # what a failure names
        self.pool = pool_for(AppSpec(recipe["app"], recipe["app_dir"]), recipe["servers"],
                             recipe["sessions_per_server"], log_dir())
        self.index: int | None = None
        self.client = None

    async def __aenter__(self) -> "Session":
        from openenv.core import GenericEnvClient

        try:
            self.index = await self.pool.lease()
        except RuntimeError as exc:  # the server would not start
            raise env_failures.failure(self.name, "server start", exc) from exc
        timeout = env_failures.current_timeout()
        self.client = GenericEnvClient(base_url=self.pool.servers[self.index].url, connect_timeout_s=timeout,
                                       message_timeout_s=timeout)
        return self

    async def __aexit__(self, *exc_info) -> None:
        try:
            if self.client is not None:
                await self.client.close()
        except Exception:  # noqa: BLE001 - a session on a dead server closes with an error; it is over either way
            pass
        finally:
            if self.index is not None:
                self.pool.release(self.index)

    async def call(self, operation: str, *args, **kwargs):
        """`client.<operation>(...)`; a failure is the environment's, and a lost server is checked and restarted."""
        try:
            return await getattr(self.client, operation)(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001 - the client's transport errors and the server's error frames
            if not (isinstance(exc, RuntimeError) and str(exc).startswith("Server error")):
                await self.pool.check(self.index)  # connection lost or timed out: a dead server is restarted
            raise env_failures.failure(self.name, operation, exc) from exc


class EpisodeWorkflow(Workflow):
    """One episode of the task's environment (module docstring); its outcome goes to the judge."""

    name = "openenv"

    async def execute(self, workflow_task: WorkflowTask, model_tuner: ModelTuner) -> WorkflowOutput:
        recipe = workflow_task.task.metadata[RECIPE_KEY]
        async with Session(recipe) as env:
            result = await env.call("reset", seed=recipe["seed"], **recipe["reset_kwargs"])
            tools = None
            if recipe["action_field"] is None:
                listed = await env.call("step", {"type": "list_tools"})
                tools = openai_tools((listed.observation or {}).get("tools") or [])
                if not tools:
                    raise env_failures.failure(env.name, "list_tools", "the environment offers no MCP tools; set "
                                               "astuner.task_reader.openenv.action_field to send replies as actions")
            messages = [{"role": "system", "content": recipe["system_prompt"]}] if recipe["system_prompt"] else []
            messages.append({"role": "user", "content": observation_text(result.observation, result.metadata)})
            turns, reward, done, last = 0, float(result.reward or 0.0), bool(result.done), ""
            while not done and turns < recipe["max_turns"]:
                reply = await model_tuner.chat(messages, tools=tools)
                turns, last = turns + 1, reply.get("content") or ""
                messages.append(reply)
                if tools is None:
                    result = await env.call("step", {recipe["action_field"]: last})
                    reward, done = reward + float(result.reward or 0.0), bool(result.done)
                    if not done:
                        messages.append({"role": "user", "content": observation_text(result.observation,
                                                                                     result.metadata)})
                    continue
                if not reply.get("tool_calls"):
                    break  # the model answered without a tool: the episode is over
                for call in reply["tool_calls"]:
                    result = await env.call("step", {"type": "call_tool", "tool_name": call["function"]["name"],
                                                     "arguments": _arguments(call["function"]["arguments"])})
                    reward, done = reward + float(result.reward or 0.0), done or bool(result.done)
                    messages.append({"role": "tool", "tool_call_id": call.get("id", ""),
                                     "content": tool_result_text(result.observation or {})})
        outcome = {"finished": done, "turns": turns, "reward": reward}
        return WorkflowOutput(reward=None, metadata={OUTCOME_KEY: outcome, "final_answer": last}, response=last)


def _arguments(text: Any) -> dict:
    """A tool call's arguments as the dict MCP takes (a model's malformed JSON: no arguments, the tool says what is
    missing)."""
    if isinstance(text, dict):
        return text
    try:
        value = json.loads(text or "{}")
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


class EpisodeJudge(BaseJudge):
    """The environment's own reward, summed over the episode's steps; a reward of 1 or more is a success."""

    def compute_reward(self, workflow_task: WorkflowTask, workflow_output: WorkflowOutput) -> tuple[float, bool]:
        outcome = outcome_of(workflow_output, OUTCOME_KEY, "openenv")
        workflow_output.metrics.update({"unfinished": float(not outcome["finished"]), "turns": float(outcome["turns"])})
        return outcome["reward"], outcome["reward"] >= 1.0
