"""An OpenEnv environment with MCP tools: a sum to work out with `add`, answered with `submit_answer`.

Written as any OpenEnv environment is (an `MCPEnvironment` whose FastMCP tools are the agent's actions); astuner
trains on it unchanged (tutorial/openenv/README.md). The question comes with the reset's observation; a submitted
answer ends the episode with reward 1 when it is right, else 0.
"""

from __future__ import annotations

import random
from typing import Any, Optional
from uuid import uuid4

from fastmcp import FastMCP
from openenv.core.env_server.mcp_environment import MCPEnvironment
from openenv.core.env_server.mcp_types import CallToolAction
from openenv.core.env_server.types import Action, Observation, State


class CalcState(State):
    question: str = ""
    answer: int = 0


class CalcEnvironment(MCPEnvironment):
    SUPPORTS_CONCURRENT_SESSIONS = True  # each session gets its own instance

    def __init__(self) -> None:
        mcp = FastMCP("calc_env")

        @mcp.tool
        def add(a: int, b: int) -> int:
            """Add two integers."""
            return a + b

        @mcp.tool
        def submit_answer(answer: int) -> str:
            """Submit the final answer; this ends the episode."""
            right = answer == self._state.answer
            self._outcome = (1.0 if right else 0.0, True)
            return "correct" if right else "wrong"

        super().__init__(mcp)
        self._state = CalcState(episode_id=str(uuid4()))
        self._outcome = (0.0, False)  # (reward, done) of the last tool call

    def reset(self, seed: Optional[int] = None, episode_id: Optional[str] = None, **kwargs: Any) -> Observation:
        rng = random.Random(seed)
        a, b = rng.randint(1, 9), rng.randint(1, 9)
        question = f"What is {a} + {b}? Use the tools: add, then submit_answer."
        self._state = CalcState(episode_id=episode_id or str(uuid4()), question=question, answer=a + b)
        self._outcome = (0.0, False)
        return Observation(done=False, reward=0.0, metadata={"question": question})

    def _step_impl(self, action: Action, timeout_s: Optional[float] = None, **kwargs: Any) -> Observation:
        return Observation(done=False, reward=0.0, metadata={"error": f"unknown action {type(action).__name__}"})

    def _scored(self, observation: Observation, action: Action) -> Observation:
        if isinstance(action, CallToolAction):
            self._state.step_count += 1
            observation.reward, observation.done = self._outcome
            self._outcome = (0.0, self._outcome[1])
        return observation

    # The WebSocket session calls step_async, HTTP /step calls step: a tool's reward goes out through both.
    async def step_async(self, action: Action, timeout_s: Optional[float] = None, **kwargs: Any) -> Observation:
        return self._scored(await super().step_async(action, timeout_s=timeout_s, **kwargs), action)

    def step(self, action: Action, timeout_s: Optional[float] = None, **kwargs: Any) -> Observation:
        return self._scored(super().step(action, timeout_s=timeout_s, **kwargs), action)

    @property
    def state(self) -> CalcState:
        return self._state
