"""ModelTuner: the trainable model as one episode's agent sees it.

Every call renders the messages to token ids, generates through the inference engine, parses tool calls and
records an `LLMCall` holding exactly the ids the engine saw and produced (they are never rebuilt from text: a
decode/encode round trip is not the identity, and training on ids the policy did not sample biases the loss).

Front ends, all over the same `complete`:
  `await tuner(messages, tools=..., tool_choice=...)`   an AgentScope `ChatResponse` (ReActAgent(model=tuner))
  `await tuner.chat(messages, tools)`                  an OpenAI-shaped message dict
  `tuner.get_openai_client()`                          an `openai.AsyncOpenAI` served in-process (`sync=True`:
                                                       an `openai.OpenAI`, for code running in a worker thread)
  `tuner.get_anthropic_client()`                       an `anthropic.AsyncAnthropic` (the Messages API), likewise
  `tuner.base_url`, `tuner.api_key`                    a loopback OpenAI-compatible HTTP endpoint (frontends/gateway.py)
  `tuner.for_agent(name, trainable)`                   the same, for one named agent of a multi-agent workflow

Token-exact multi-turn: when a request's messages extend an earlier call's messages plus the assistant message
that call returned, the prompt reuses that call's exact prompt and response ids and only the new messages are
rendered (`ChatRenderer.render_extension`); the call is marked `extends_previous`.

This module holds the front ends and the episode's state; a call's steps are in completion.py, the prompt's
reuse of earlier calls in conversations.py, and the episode's limits and token budget in budget.py.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import Any

from astuner.engine.base import InferenceEngine
from astuner.madness import validate_checklist
from astuner.model_tuner.frontends import agentscope2
from astuner.model_tuner.frontends.agentscope_adapter import to_chat_response
from astuner.model_tuner.budget import EpisodeBudget, TunerLimits  # TunerLimits: importable from here too
from astuner.model_tuner.chat_format import ChatRenderer, normalize_tools, read_tool_choice
from astuner.model_tuner.completion import complete
from astuner.model_tuner.context import state_of
from astuner.model_tuner.conversations import Conversations, Prompt, stop_texts
from astuner.model_tuner.decoding import ResponseDecoder
from astuner.model_tuner.formats import NoReasoningParser
from astuner.model_tuner.roster import Roster
from astuner.model_tuner.tool_parser import TOOL_PARSERS, ToolParser
from astuner.model_tuner.turn import CallOptions, EpisodeTimeout, Turn, assistant_message
from astuner.types import LLMCall
from astuner.watchdog import close_item, current_item


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
        reasoning_parser=None,
        gateway=None,
        top_p: float = 1.0, top_k: int = 0,
        roster: Roster | None = None,
    ) -> None:
        self.engine = engine  # the policy's; the roster says which serves each named agent (astuner.agents)
        self.roster = roster or Roster.single(engine)
        self.top_p, self.top_k = float(top_p), int(top_k)
        self.tokenizer, self.renderer = tokenizer, renderer
        self.tool_parser = tool_parser
        self.limits = limits
        self.temperature = float(temperature)
        self.stop_token_ids = tuple(int(i) for i in stop_token_ids)
        self.madness_checks, self.seed = validate_checklist(madness_checks), seed
        self.deadline = deadline  # time.monotonic() after which no LLM call starts; None: no deadline
        self.deadline_note: str | None = None  # what a timeout says when a workflow moved the deadline (remote)
        self.episode_uid = episode_uid
        self.reasoning_parser = reasoning_parser or NoReasoningParser()
        self.gateway = gateway  # the OpenAI front ends (gateway.Gateway); None: not offered
        # The episode's loop (the rollout builds the tuner inside the episode): the gateway runs every call of
        # this episode there, whichever thread first asked for a key (a sync agent reading `api_key` in a
        # worker thread), so the budget and its waiters live on one loop.
        self.loop: asyncio.AbstractEventLoop | None = _running_loop()
        self.auxiliary_models: dict[str, Any] = {}  # frozen models by name (astuner.auxiliary_models)
        self._keys: dict[tuple[str, bool], str] = {}  # (agent, trainable) -> this episode's API key
        self.conversations = Conversations(stop_texts(tokenizer, stop_token_ids))  # token-exact multi-turn
        self.context = state_of(limits.context_policy, limits.summary_max_tokens)  # context.py
        self.expired_reason: str | None = None
        self.in_flight: dict[str, InferenceEngine] = {}  # request id of a call awaiting an engine -> that engine
        name = str(getattr(tokenizer, "name_or_path", "") or "model").rstrip("/").rsplit("/", 1)[-1]
        self.model_name = f"astuner/{name}"

        self.calls: list[LLMCall] = []
        # (index in self.calls, flag, reason) for every madness check that fired: the "why" behind call.flags.
        self.flag_reasons: list[tuple[int, str, str]] = []
        self.budget = EpisodeBudget(limits)  # the new tokens generated and reserved; overflowed or not
        # Response text keeps the parsers' markers even where they are special tokens (decoding.py).
        self.decoder = ResponseDecoder(tokenizer, (*getattr(tool_parser, "markers", ()),
                                                     *getattr(self.reasoning_parser, "markers", ())))
        self.stop_ids = set(self.stop_token_ids)
        self.parser_name = next((name for name, cls in TOOL_PARSERS.items() if isinstance(tool_parser, cls)),
                                 type(tool_parser).__name__)
        self.started = 0  # calls begun (concurrent calls may finish out of order)
        # The watchdog's view (astuner/watchdog.py): this episode's item, and the tools the agent runs between
        # a response that called them and its next model call.
        self.watch_parent = current_item()
        self.tool_item: int | None = None

    # --- OpenAI-shaped front end ---------------------------------------------------------------------------
    async def chat(self, messages: list[dict], tools: list[dict] | None = None) -> dict:
        """Generate one assistant message: {"role": "assistant", "content": str, "tool_calls": [...]}, the
        `tool_calls` key present only when the model called tools (arguments as JSON strings), and
        `reasoning_content` only when a reasoning parser split some out."""
        return assistant_message(await self.complete(messages, tools))

    def engine_for(self, agent: str) -> InferenceEngine:
        """The engine that serves `agent`'s calls: the policy's (`self.engine`) or its model's."""
        model = self.roster.model_of(agent)
        return self.engine if model == self.roster.default else self.roster.engines[model]

    def for_agent(self, name: str, trainable: bool = True) -> "AgentModel":
        """The model as one named agent of a multi-agent workflow sees it: served by the model astuner.agents
        names for it (`policy` when unlisted). Calls of an agent with trainable=False (here or in astuner.agents)
        are served and recorded, but never become training samples."""
        name = str(name)
        return AgentModel(self, CallOptions(agent=name, trainable=bool(trainable) and self.roster.trainable(name)))

    # --- OpenAI front ends ----------------------------------------------------------------------------------
    def get_openai_client(self, sync: bool = False):
        return self.require_gateway().client(self.api_key_for(CallOptions()), sync=sync)

    @property
    def base_url(self) -> str:
        """The loopback endpoint's base URL (".../v1"); the server starts on first use."""
        return self.require_gateway().base_url()

    def agentscope_model(self, stream: bool = False):
        """This episode's model as an AgentScope 2.x `OpenAIChatModel`, served in-process (frontends/agentscope2.py)."""
        return agentscope2.agentscope_model(self, stream)

    def get_anthropic_client(self):
        """An `anthropic.AsyncAnthropic` on the Messages API (`/v1/messages`), served in-process."""
        return self.require_gateway().anthropic_client(self.api_key_for(CallOptions()))

    @property
    def anthropic_base_url(self) -> str:
        """The loopback endpoint's root for Anthropic clients, which append "/v1/messages" themselves."""
        return self.require_gateway().base_url().removesuffix("/v1")

    @property
    def api_key(self) -> str:
        """This episode's key for `base_url`; revoked when the episode ends."""
        return self.api_key_for(CallOptions())

    def require_gateway(self):
        """The front ends' HTTP gateway; a RuntimeError when this tuner was built without one."""
        if self.gateway is None:
            raise RuntimeError("this ModelTuner was built without the OpenAI gateway (astuner builds it with one)")
        return self.gateway

    def api_key_for(self, options: CallOptions) -> str:
        """The episode's gateway key for calls made with `options` (one per agent and trainability)."""
        slot = (options.agent, options.trainable)
        if slot not in self._keys:
            self._keys[slot] = self.require_gateway().register(self, options)
        return self._keys[slot]

    def end_calls(self) -> None:
        """Revoke the episode's API keys: a later request is refused (408 `episode_ended`) and records nothing.
        Thread-safe: a remote client's result ends its episode's calls from the server's thread, before the
        episode itself returns (serve/remote_board.py)."""
        if self.gateway is not None:
            for key in list(self._keys.values()):
                self.gateway.revoke(key)

    def close(self) -> None:
        """The episode is over: its tools and its API keys (`end_calls`)."""
        close_item(self.tool_item)
        self.end_calls()

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

        tool_choice "none" hides the tools; "auto" offers them; "required"/"any" or a function name offer them
        and check the answer (chat_format.read_tool_choice: sampling is never constrained, a call that breaks the
        choice is flagged `wrong_toolcall`; the agent sees whatever the model produced). Extra kwargs (e.g.
        per-call generation settings) are ignored: sampling is fixed by the rollout so the recorded logprobs match.
        """
        if structured_model is not None:
            raise NotImplementedError(
                "ModelTuner does not support structured_model (constrained JSON output); use tools instead, "
                "e.g. ReActAgent's structured output, which goes through the generate_response tool"
            )
        return to_chat_response(await self.complete(messages, tools, CallOptions(tool_choice=tool_choice)))

    # --- the deadline ---------------------------------------------------------------------------------------
    @property
    def expired(self) -> bool:
        return self.expired_reason is not None

    def expire(self, reason: str) -> None:
        """End the episode's access to the model: abort its pending engine requests; later calls raise."""
        if self.expired_reason is None:
            self.expired_reason = reason
        for request_id, engine in list(self.in_flight.items()):
            engine.abort(request_id)

    def check_deadline(self) -> None:
        if self.expired_reason is None and self.deadline is not None and time.monotonic() >= self.deadline:
            self.expire("episode deadline passed")
        if self.expired_reason is not None:
            raise EpisodeTimeout(f"{self.expired_reason}: no more LLM calls in this episode")

    # --- the episode's token budget (budget.py) --------------------------------------------------------------
    @property
    def overflowed(self) -> bool:
        """Whether a call was refused for the episode's limits (`overflow_reason` says which)."""
        return self.budget.overflowed

    @property
    def overflow_reason(self) -> str | None:
        return self.budget.overflow_reason

    @property
    def overflow_limit(self) -> str:
        """The limit that refused ("budget", "window", "prompt"; astuner/cuts.py), "" when none did."""
        return self.budget.overflow_limit

    @property
    def generated_tokens(self) -> int:
        """New tokens generated by the episode's recorded calls."""
        return self.budget.generated_tokens

    # --- the call itself (completion.py) --------------------------------------------------------------------
    async def complete(self, messages: list[dict], tools: list[dict] | None,
                       options: CallOptions | None = None) -> Turn:
        """One call, whichever front end made it: rendered, generated, parsed, checked and recorded."""
        return await complete(self, messages, tools, options or CallOptions())

    def prompt_length(self, messages: list[dict], tools: list[dict] | None, options: CallOptions) -> int:
        """Tokens of the prompt a call with these arguments would get now (`/v1/messages/count_tokens`): with the
        agent's compaction applied (context.py), not a new one."""
        tools, _ = read_tool_choice(normalize_tools(tools), options.tool_choice)
        shown = self.context.view(options.agent, messages, self.reasoning_parser)
        return len(self.prompt(shown, tools, options.prefill).ids)

    def discard(self, call: LLMCall) -> None:
        """Un-record a call whose answer never reached the agent (its client hung up first, e.g. a client-side
        timeout it will retry). Un-recorded rather than kept untrained: the episode's record stays exactly the
        conversation the agent had, where no later prompt holds this response, its tokens leave the episode's
        budget and metrics, and the retry is the one call with this prompt."""
        index = next((i for i, c in enumerate(self.calls) if c is call), None)
        if index is None:
            return
        last = index == len(self.calls) - 1
        del self.calls[index]
        self.flag_reasons = [(i - (i > index), flag, reason) for i, flag, reason in self.flag_reasons if i != index]
        self.conversations.forget(call)
        self.budget.give_back(len(call.response_ids))
        if last and call.tool_call_attempted:  # the agent will not run tools it never saw
            close_item(self.tool_item)
            self.tool_item = None

    def prompt(self, messages: list[dict], tools: list[dict] | None, prefill: str = "") -> Prompt:
        """The call's prompt, extending an earlier call's ids exactly where it can (conversations.py)."""
        return self.conversations.prompt(self.renderer, self.reasoning_parser, messages, tools, prefill)


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


class AgentModel:
    """`ModelTuner.for_agent(name, trainable)`: the same front ends, recording calls under the agent's name."""

    stream = False

    def __init__(self, tuner: ModelTuner, options: CallOptions) -> None:
        self.tuner = tuner
        self.options = options
        self.model_name = tuner.model_name

    async def __call__(self, messages, tools=None, tool_choice=None, structured_model=None, **kwargs):
        if structured_model is not None:
            raise NotImplementedError("structured_model is not supported; use tools instead")
        options = dataclasses.replace(self.options, tool_choice=tool_choice)
        return to_chat_response(await self.tuner.complete(messages, tools, options))

    async def chat(self, messages: list[dict], tools: list[dict] | None = None) -> dict:
        return assistant_message(await self.tuner.complete(messages, tools, self.options))

    def get_openai_client(self, sync: bool = False):
        return self.tuner.require_gateway().client(self.tuner.api_key_for(self.options), sync=sync)

    @property
    def base_url(self) -> str:
        return self.tuner.require_gateway().base_url()

    def get_anthropic_client(self):
        return self.tuner.require_gateway().anthropic_client(self.tuner.api_key_for(self.options))

    @property
    def api_key(self) -> str:
        return self.tuner.api_key_for(self.options)

    def require_gateway(self):
        return self.tuner.require_gateway()

    def agentscope_model(self, stream: bool = False):
        """This agent's model as an AgentScope 2.x `OpenAIChatModel` (frontends/agentscope2.py)."""
        return agentscope2.agentscope_model(self, stream)
