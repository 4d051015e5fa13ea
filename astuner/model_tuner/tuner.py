"""ModelTuner: the trainable model as one episode's agent sees it.

Every call renders the messages to token ids, generates through the inference engine, parses tool calls and
records an `LLMCall` holding exactly the ids the engine saw and produced (they are never rebuilt from text: a
decode/encode round trip is not the identity, and training on ids the policy did not sample biases the loss).

The same object answers two ways: `await tuner.chat(messages, tools)` (OpenAI-shaped dicts), and
`await tuner(messages, tools=..., tool_choice=...)` which returns an AgentScope `ChatResponse`, so that
`ReActAgent(model=tuner, ...)` works unchanged.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

from astuner.engine.base import InferenceEngine
from astuner.madness import CallView, run_checks, validate_checklist
from astuner.model_tuner.chat_format import ChatRenderer, tool_names_of
from astuner.model_tuner.tool_parser import ParsedOutput, ParsedToolCall, ToolParser
from astuner.types import LLMCall, SamplingParams


@dataclass
class TunerLimits:
    max_model_len: int  # prompt + response of one call (rollout.max_model_len)
    max_tokens_per_turn: int  # new tokens of one call (rollout.max_response_length_in_one_turn)
    max_response_tokens: int  # new tokens over the whole episode (data.max_response_length)
    max_prompt_length: int  # tokens of the episode's first prompt (data.max_prompt_length)


class EpisodeOverflow(RuntimeError):
    """The episode ran out of context or token budget. The rollout ends the episode, flags it "overflow" and
    keeps the calls recorded so far (also when the workflow catches this exception)."""


class EpisodeTimeout(RuntimeError):
    """The episode's deadline passed: every later LLM call of the episode raises this at once. The rollout flags
    the episode "timeout" whatever the workflow returns (agents that swallow it cannot train on a late answer)."""


@dataclass
class _Turn:
    """One completed call, in the shapes both front ends need."""

    call: LLMCall
    content: str
    tool_calls: list[ParsedToolCall] = field(default_factory=list)
    seconds: float = 0.0


def special_token_ids(tokenizer) -> set[int]:
    """Ids of tokens that must never appear inside a response (control tokens such as <|im_start|>)."""
    ids = set(getattr(tokenizer, "all_special_ids", []) or [])
    for token_id, token in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items():
        if getattr(token, "special", False):
            ids.add(int(token_id))
    return ids


class ModelTuner:
    """One instance per episode; not reusable across episodes (it holds the episode's calls and budget)."""

    stream = False  # AgentScope reads this to decide whether a response is an async generator

    def __init__(
        self,
        engine: InferenceEngine,
        tokenizer,
        renderer: ChatRenderer,
        tool_parser: ToolParser,
        limits: TunerLimits,
        temperature: float,
        stop_token_ids: tuple[int, ...],
        madness_checks: tuple[str, ...] = ("nonsense", "wrong_toolcall"),
        seed: int | None = None,
        deadline: float | None = None,
        episode_uid: str = "",
    ) -> None:
        self.engine = engine
        self.tokenizer = tokenizer
        self.renderer = renderer
        self.tool_parser = tool_parser
        self.limits = limits
        self.temperature = float(temperature)
        self.stop_token_ids = tuple(int(i) for i in stop_token_ids)
        self.madness_checks = validate_checklist(madness_checks)
        self.seed = seed
        self.deadline = deadline  # time.monotonic() after which no LLM call starts; None: no deadline
        self.episode_uid = episode_uid
        self.expired_reason: str | None = None
        self._in_flight: set[str] = set()  # engine request ids of calls awaiting the engine
        name = str(getattr(tokenizer, "name_or_path", "") or "model").rstrip("/").rsplit("/", 1)[-1]
        self.model_name = f"astuner/{name}"

        self.calls: list[LLMCall] = []
        # (index in self.calls, flag, reason) for every madness check that fired: the "why" behind call.flags.
        self.flag_reasons: list[tuple[int, str, str]] = []
        self.overflowed = False
        self.overflow_reason: str | None = None
        self.generated_tokens = 0
        self._special_ids = special_token_ids(tokenizer)
        self._stop_ids = set(self.stop_token_ids)
        self._started = 0  # calls begun (concurrent calls may finish out of order)

    # --- OpenAI-shaped front end ---------------------------------------------------------------------------
    async def chat(self, messages: list[dict], tools: list[dict] | None = None) -> dict:
        """Generate one assistant message: {"role": "assistant", "content": str, "tool_calls": [...]}, the
        `tool_calls` key present only when the model called tools (arguments as JSON strings)."""
        turn = await self._complete(messages, tools)
        message: dict[str, Any] = {"role": "assistant", "content": turn.content}
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

    # --- AgentScope chat-model front end -------------------------------------------------------------------
    async def __call__(
        self,
        messages: list[dict],
        tools: list[dict] | None = None,
        tool_choice: str | None = None,
        structured_model: Any = None,
        **kwargs: Any,
    ):
        """Duck type of `agentscope.model.ChatModelBase.__call__`: returns a `ChatResponse`.

        tool_choice "none" hides the tools; "auto", "required" or a function name offer them (a sampled model
        cannot be forced to call one; the agent sees whatever it produced). Extra kwargs (e.g. per-call
        generation settings) are ignored: sampling is fixed by the rollout so the recorded logprobs match.
        """
        from astuner.model_tuner.agentscope_adapter import offered_tools, to_chat_response

        if structured_model is not None:
            raise NotImplementedError(
                "ModelTuner does not support structured_model (constrained JSON output); use tools instead, "
                "e.g. ReActAgent's structured output, which goes through the generate_response tool"
            )
        turn = await self._complete(messages, offered_tools(tools, tool_choice))
        return to_chat_response(turn)

    # --- the deadline ---------------------------------------------------------------------------------------
    @property
    def expired(self) -> bool:
        return self.expired_reason is not None

    def expire(self, reason: str) -> None:
        """End the episode's access to the model: abort its pending engine requests; later calls raise."""
        if self.expired_reason is None:
            self.expired_reason = reason
        for request_id in list(self._in_flight):
            self.engine.abort(request_id)

    def _check_deadline(self) -> None:
        if self.expired_reason is None and self.deadline is not None and time.monotonic() >= self.deadline:
            self.expire("episode deadline passed")
        if self.expired_reason is not None:
            raise EpisodeTimeout(f"{self.expired_reason}: no more LLM calls in this episode")

    # --- the call itself ------------------------------------------------------------------------------------
    def _overflow(self, reason: str) -> EpisodeOverflow:
        self.overflowed = True
        self.overflow_reason = reason
        return EpisodeOverflow(reason)

    def _max_tokens(self, prompt_len: int, first: bool) -> int:
        lim = self.limits
        if self.overflowed:
            raise self._overflow(self.overflow_reason or "episode already overflowed")
        if first and prompt_len > lim.max_prompt_length:
            raise self._overflow(f"first prompt has {prompt_len} tokens > max_prompt_length {lim.max_prompt_length}")
        budget_left = lim.max_response_tokens - self.generated_tokens
        if budget_left <= 0:
            raise self._overflow(f"episode generated {self.generated_tokens} tokens, budget {lim.max_response_tokens}")
        room = lim.max_model_len - prompt_len
        if room <= 0:
            raise self._overflow(f"prompt has {prompt_len} tokens, max_model_len is {lim.max_model_len}")
        return min(lim.max_tokens_per_turn, room, budget_left)

    async def _complete(self, messages: list[dict], tools: list[dict] | None) -> _Turn:
        self._check_deadline()
        tools = tools or None
        prompt_ids = self.renderer.render(messages, tools)
        index = self._started
        max_tokens = self._max_tokens(len(prompt_ids), first=index == 0)
        self._started += 1
        sampling = SamplingParams(
            temperature=self.temperature,
            max_tokens=max_tokens,
            stop_token_ids=self.stop_token_ids,
            # Distinct per call so repeated prompts within an episode are not sampled identically.
            seed=None if self.seed is None else self.seed + index,
        )
        started = time.perf_counter()
        request_id = f"{self.episode_uid}/{index}/{id(self):x}"
        self._in_flight.add(request_id)
        try:
            result = await self.engine.generate(list(prompt_ids), sampling, request_id=request_id)
        finally:
            self._in_flight.discard(request_id)
        self._check_deadline()  # a call that outlived the deadline is not handed back to the agent
        seconds = time.perf_counter() - started
        response_ids = [int(i) for i in result.token_ids]
        self.generated_tokens += len(response_ids)

        text_ids = response_ids[:-1] if response_ids and response_ids[-1] in self._stop_ids else response_ids
        text = self.tokenizer.decode(text_ids, skip_special_tokens=True)
        parsed = self._parse(text, tools, call_index=index)

        view = CallView(response_ids, text, self._special_ids, self._stop_ids, parsed.errors)
        fired = run_checks(self.madness_checks, view)
        call = LLMCall(
            prompt_ids=list(prompt_ids),
            response_ids=response_ids,
            response_logprobs=[float(x) for x in result.logprobs],
            finish_reason=result.finish_reason,
            temperature=self.temperature,
            response_text=text,
            flags=list(fired),
        )
        for flag, reason in fired.items():
            self.flag_reasons.append((len(self.calls), flag, reason))
        self.calls.append(call)
        return _Turn(call=call, content=parsed.content, tool_calls=parsed.tool_calls, seconds=seconds)

    def _parse(self, text: str, tools: list[dict] | None, call_index: int) -> ParsedOutput:
        if not tools and not self.tool_parser.has_tool_call(text):
            return ParsedOutput(content=text)
        parsed = self.tool_parser.parse(text, tool_names_of(tools), id_prefix=f"call_{call_index}")
        if not tools:
            # A call nobody offered is flagged but not returned: the agent has nothing to run it with.
            return ParsedOutput(content=text.strip(), errors=parsed.errors)
        return parsed
