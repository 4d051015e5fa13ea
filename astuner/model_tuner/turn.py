"""The records every front end of ModelTuner shares: one completed call (`Turn`), the per-call options an agent
may pass, the two ways an episode's calls end, and the OpenAI-shaped assistant message.

The lowest module of the package: tuner.py produces these, and the front ends (frontends/: gateway.py,
agentscope_adapter.py, anthropic_api.py) read them without importing the tuner.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from astuner.model_tuner.tool_parser import ParsedToolCall
from astuner.types import LLMCall


class EpisodeOverflow(RuntimeError):
    """The episode ran out of context or token budget. The rollout ends the episode, flags it "overflow" and
    keeps the calls recorded so far (also when the workflow catches this exception)."""


class EpisodeTimeout(RuntimeError):
    """The episode's deadline passed: every later LLM call of the episode raises this at once. The rollout flags
    the episode "timeout" whatever the workflow returns (agents that swallow it cannot train on a late answer)."""


@dataclass
class Turn:
    """One completed call, in the shapes every front end needs."""

    call: LLMCall
    content: str
    tool_calls: list[ParsedToolCall] = field(default_factory=list)
    seconds: float = 0.0
    reasoning: str | None = None
    finish_reason: str = "stop"  # OpenAI's: "stop", "length" or "tool_calls"


@dataclass
class CallOptions:
    """Per-call settings an agent may pass (OpenAI arguments), applied within the configured limits."""

    agent: str = ""
    trainable: bool = True
    temperature: float | None = None  # honoured when > 0; otherwise the rollout's temperature
    max_tokens: int | None = None  # honoured up to rollout.max_response_length_in_one_turn
    stop: tuple[str, ...] = ()  # the response is cut after the token that completes a stop string
    tool_choice: Any = None  # OpenAI/AgentScope tool_choice (chat_format.read_tool_choice)
    # The start of the assistant turn the response continues (Anthropic's prefill): its tokens end the prompt,
    # after the generation prompt, and the returned content is only the continuation.
    prefill: str = ""


def assistant_message(turn: Turn) -> dict:
    """The OpenAI-shaped assistant message for a turn (arguments as JSON strings, as the OpenAI API sends)."""
    message: dict[str, Any] = {"role": "assistant", "content": turn.content}
    if turn.reasoning is not None:
        message["reasoning_content"] = turn.reasoning
    if turn.tool_calls:
        message["tool_calls"] = [
            {
                "id": c.id,
                "type": "function",
                "function": {"name": c.name, "arguments": json.dumps(c.arguments, ensure_ascii=False)},
            }
            for c in turn.tool_calls
        ]
    return message
