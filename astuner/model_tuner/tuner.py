"""ModelTuner: the trainable model as one episode's agent sees it.

Every call renders the messages to token ids, generates through the inference engine, parses tool calls and
records an `LLMCall` holding exactly the ids the engine saw and produced (they are never rebuilt from text: a
decode/encode round trip is not the identity, and training on ids the policy did not sample biases the loss).

Front ends, all over the same `_complete`:
  `await tuner(messages, tools=..., tool_choice=...)`   an AgentScope `ChatResponse` (ReActAgent(model=tuner))
  `await tuner.chat(messages, tools)`                  an OpenAI-shaped message dict
  `tuner.get_openai_client()`                          an `openai.AsyncOpenAI` served in-process (`sync=True`:
                                                       an `openai.OpenAI`, for code running in a worker thread)
  `tuner.get_anthropic_client()`                       an `anthropic.AsyncAnthropic` (the Messages API), likewise
  `tuner.base_url`, `tuner.api_key`                    a loopback OpenAI-compatible HTTP endpoint (gateway.py)
  `tuner.for_agent(name, trainable)`                   the same, for one named agent of a multi-agent workflow

Token-exact multi-turn: when a request's messages extend an earlier call's messages plus the assistant message
that call returned, the prompt reuses that call's exact prompt and response ids and only the new messages are
rendered (`ChatRenderer.render_extension`); the call is marked `extends_previous`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from dataclasses import dataclass
from typing import Any

from astuner.alarms import missing_arguments
from astuner.engine.base import InferenceEngine
from astuner.madness import CallView, run_checks, validate_checklist
from astuner.model_tuner import agentscope2
from astuner.model_tuner.agentscope_adapter import to_chat_response
from astuner.model_tuner.chat_format import (
    ChatRenderer,
    _tool_calls_of,
    canonical_messages,
    flatten_content,
    normalize_tools,
    read_tool_choice,
    tool_choice_violation,
    tool_names_of,
)
from astuner.model_tuner.decoding import ResponseDecoder
from astuner.model_tuner.formats import NoReasoningParser
from astuner.model_tuner.tool_parser import TOOL_PARSERS, ParsedOutput, ToolParser, without_markers
from astuner.model_tuner.turn import CallOptions, EpisodeOverflow, EpisodeTimeout, Turn, assistant_message
from astuner.types import LLMCall, SamplingParams
from astuner.watchdog import close_item, current_item, open_item, watch


@dataclass
class TunerLimits:
    max_model_len: int  # prompt + response of one call (rollout.max_model_len)
    max_tokens_per_turn: int  # new tokens of one call (rollout.max_response_length_in_one_turn)
    max_response_tokens: int  # new tokens over the whole episode (data.max_response_length)
    max_prompt_length: int  # tokens of the episode's first prompt (data.max_prompt_length)


@dataclass
class _Conversation:
    """What a later call needs to extend an earlier one token-exactly."""

    canonical: list  # canonical_messages(request) + the canonical assistant message handed back
    tools_key: str
    prompt_ids: list[int]
    response_ids: list[int]
    call: LLMCall | None = None  # the call that produced it (`discard` forgets both)
    prefill: str = ""  # the text its prompt ended with, in the assistant turn already begun (a prefill)


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
        top_p: float = 1.0,
        top_k: int = 0,
    ) -> None:
        self.engine = engine
        self.top_p, self.top_k = float(top_p), int(top_k)
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
        self.reasoning_parser = reasoning_parser or NoReasoningParser()
        self.gateway = gateway  # the OpenAI front ends (gateway.Gateway); None: not offered
        # The episode's loop (the rollout builds the tuner inside the episode): the gateway runs every call of
        # this episode there, whichever thread first asked for a key (a sync agent reading `api_key` in a
        # worker thread), so the budget and its waiters live on one loop.
        self.loop: asyncio.AbstractEventLoop | None = _running_loop()
        self.auxiliary_models: dict[str, Any] = {}  # frozen models by name (astuner.auxiliary_models)
        self._keys: dict[tuple[str, bool], str] = {}  # (agent, trainable) -> this episode's API key
        self._conversations: list[_Conversation] = []
        self._stop_texts = tuple(
            tokenizer.decode([i], skip_special_tokens=False) for i in stop_token_ids
        ) + ((getattr(tokenizer, "eos_token", None) or ""),)
        self.expired_reason: str | None = None
        self._in_flight: set[str] = set()  # engine request ids of calls awaiting the engine
        name = str(getattr(tokenizer, "name_or_path", "") or "model").rstrip("/").rsplit("/", 1)[-1]
        self.model_name = f"astuner/{name}"

        self.calls: list[LLMCall] = []
        # (index in self.calls, flag, reason) for every madness check that fired: the "why" behind call.flags.
        self.flag_reasons: list[tuple[int, str, str]] = []
        self.overflowed = False
        self.overflow_reason: str | None = None
        self._budget_overflow = False  # overflowed only because the episode's token budget was spent
        self.generated_tokens = 0
        # New tokens promised to calls still generating: parallel calls reserve their share of the episode's
        # budget before generating, so together they never exceed it (`_reserve`).
        self._reserved = 0
        self._budget_freed: asyncio.Event | None = None
        # Response text keeps the parsers' markers even where they are special tokens (decoding.py).
        self._decoder = ResponseDecoder(tokenizer, (*getattr(tool_parser, "markers", ()),
                                                     *getattr(self.reasoning_parser, "markers", ())))
        self._stop_ids = set(self.stop_token_ids)
        self._parser_name = next((name for name, cls in TOOL_PARSERS.items() if isinstance(tool_parser, cls)),
                                 type(tool_parser).__name__)
        self._started = 0  # calls begun (concurrent calls may finish out of order)
        # The watchdog's view (astuner/watchdog.py): this episode's item, and the tools the agent runs between
        # a response that called them and its next model call.
        self._watch_parent = current_item()
        self._tool_item: int | None = None

    # --- OpenAI-shaped front end ---------------------------------------------------------------------------
    async def chat(self, messages: list[dict], tools: list[dict] | None = None) -> dict:
        """Generate one assistant message: {"role": "assistant", "content": str, "tool_calls": [...]}, the
        `tool_calls` key present only when the model called tools (arguments as JSON strings), and
        `reasoning_content` only when a reasoning parser split some out."""
        return assistant_message(await self._complete(messages, tools))

    def for_agent(self, name: str, trainable: bool = True) -> "AgentModel":
        """The model as one named agent of a multi-agent workflow sees it. Calls of an agent with
        trainable=False are served by the same engine and recorded, but never become training samples."""
        return AgentModel(self, CallOptions(agent=str(name), trainable=bool(trainable)))

    # --- OpenAI front ends ----------------------------------------------------------------------------------
    def get_openai_client(self, sync: bool = False):
        return self._gateway().client(self._key(CallOptions()), sync=sync)

    @property
    def base_url(self) -> str:
        """The loopback endpoint's base URL (".../v1"); the server starts on first use."""
        return self._gateway().base_url()

    def agentscope_model(self, stream: bool = False):
        """This episode's model as an AgentScope 2.x `OpenAIChatModel`, served in-process (agentscope2.py)."""
        return agentscope2.agentscope_model(self, stream)

    def get_anthropic_client(self):
        """An `anthropic.AsyncAnthropic` on the Messages API (`/v1/messages`), served in-process."""
        return self._gateway().anthropic_client(self._key(CallOptions()))

    @property
    def anthropic_base_url(self) -> str:
        """The loopback endpoint's root for Anthropic clients, which append "/v1/messages" themselves."""
        return self._gateway().base_url().removesuffix("/v1")

    @property
    def api_key(self) -> str:
        """This episode's key for `base_url`; revoked when the episode ends."""
        return self._key(CallOptions())

    def _gateway(self):
        if self.gateway is None:
            raise RuntimeError("this ModelTuner was built without the OpenAI gateway (astuner builds it with one)")
        return self.gateway

    def _key(self, options: CallOptions) -> str:
        slot = (options.agent, options.trainable)
        if slot not in self._keys:
            self._keys[slot] = self._gateway().register(self, options)
        return self._keys[slot]

    def close(self) -> None:
        """The episode is over: revoke its API keys (a late request gets 401 and records nothing)."""
        close_item(self._tool_item)
        if self.gateway is not None:
            for key in self._keys.values():
                self.gateway.revoke(key)

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
        return to_chat_response(await self._complete(messages, tools, CallOptions(tool_choice=tool_choice)))

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
    def _overflow(self, reason: str, budget: bool = False) -> EpisodeOverflow:
        self.overflowed = True
        self.overflow_reason = reason
        self._budget_overflow = budget  # `discard` may hand the budget back, and with it the episode
        return EpisodeOverflow(reason)

    def _max_tokens(self, prompt_len: int, first: bool) -> int:
        lim = self.limits
        if self.overflowed:
            raise EpisodeOverflow(self.overflow_reason or "episode already overflowed")
        if first and prompt_len > lim.max_prompt_length:
            raise self._overflow(f"first prompt has {prompt_len} tokens > max_prompt_length {lim.max_prompt_length}")
        budget_left = lim.max_response_tokens - self.generated_tokens
        if budget_left <= 0:
            raise self._overflow(f"episode generated {self.generated_tokens} tokens, budget {lim.max_response_tokens}",
                                 budget=True)
        room = lim.max_model_len - prompt_len
        if room <= 0:
            raise self._overflow(f"prompt has {prompt_len} tokens, max_model_len is {lim.max_model_len}")
        # 0: what is left is reserved by calls still generating; they may hand some back (`_reserve` waits).
        return max(0, min(lim.max_tokens_per_turn, room, budget_left - self._reserved))

    async def _reserve(self, prompt_len: int, first: bool, requested: int | None) -> int:
        """This call's new tokens, taken from the episode's budget before it generates. The check and the
        reservation run without an await between them, and every call of an episode runs on its loop, so
        parallel calls never promise more than the budget together."""
        while True:
            max_tokens = self._max_tokens(prompt_len, first)
            if max_tokens > 0:
                if requested is not None:
                    max_tokens = max(1, min(max_tokens, int(requested)))
                self._reserved += max_tokens
                return max_tokens
            self._budget_freed = self._budget_freed or asyncio.Event()
            await self._budget_freed.wait()
            self._check_deadline()

    def _release(self, reserved: int) -> None:
        self._reserved -= reserved
        if self._budget_freed is not None:
            self._budget_freed.set()  # waiting calls look again: what this call did not use is theirs
            self._budget_freed = None

    async def _complete(self, messages: list[dict], tools: list[dict] | None,
                        options: CallOptions | None = None) -> Turn:
        options = options or CallOptions()
        self._check_deadline()
        tools, required_call = read_tool_choice(normalize_tools(tools), options.tool_choice)
        # With a prefill the turn is already begun: the model continues the prefill's own tokens.
        prompt_ids, extends, canonical, tools_key, new_from = self._prompt_ids(messages, tools, options.prefill)
        max_tokens = await self._reserve(len(prompt_ids), self._started == 0, options.max_tokens)
        index = self._started  # read after the reservation, which may wait for parallel calls
        temperature = self.temperature
        if options.temperature is not None and options.temperature > 0 and self.temperature > 0:
            temperature = float(options.temperature)  # validation stays greedy whatever the agent asks
        self._started += 1
        sampling = SamplingParams(
            temperature=temperature,
            max_tokens=max_tokens,
            stop_token_ids=self.stop_token_ids,
            # Distinct per call so repeated prompts within an episode are not sampled identically.
            seed=None if self.seed is None else self.seed + index,
            top_p=self.top_p,
            top_k=self.top_k,
        )
        started = time.perf_counter()
        request_id = f"{self.episode_uid}/{index}/{id(self):x}"
        self._in_flight.add(request_id)
        close_item(self._tool_item)  # the agent is back: its tools have answered
        try:
            with watch("model call", f"{index} of {self.episode_uid}", parent=self._watch_parent):
                result = await self.engine.generate(list(prompt_ids), sampling, request_id=request_id)
        finally:
            self._in_flight.discard(request_id)
            self._release(max_tokens)
        self._check_deadline()  # a call that outlived the deadline is not handed back to the agent
        seconds = time.perf_counter() - started
        response_ids = [int(i) for i in result.token_ids]
        logprobs = [float(x) for x in result.logprobs]
        finish = result.finish_reason
        if options.stop:
            cut = _stop_string_cut(self.tokenizer, response_ids, options.stop)
            if cut is not None:
                response_ids, logprobs, finish = response_ids[:cut], logprobs[:cut], "stop"
        self.generated_tokens += len(response_ids)

        text_ids = response_ids[:-1] if response_ids and response_ids[-1] in self._stop_ids else response_ids
        text = self._decoder.decode(text_ids)
        if options.stop:
            text = _before_stop(text, options.stop)
        split = self.reasoning_parser.split(text)
        parsed = self._parse(split.content, tools, call_index=index)
        violation = tool_choice_violation(required_call, [c.name for c in parsed.tool_calls])
        if violation:
            parsed.errors.append(violation)

        view = CallView(response_ids, text, self._decoder.leak_ids, self._stop_ids, parsed.errors)
        fired = run_checks(self.madness_checks, view)
        call = LLMCall(
            prompt_ids=list(prompt_ids),
            response_ids=response_ids,
            response_logprobs=logprobs,
            finish_reason=finish,
            temperature=temperature,
            response_text=text,
            flags=list(fired),
            agent=options.agent,
            trainable=options.trainable,
            extends_previous=extends,
            tool_call_attempted=bool(parsed.tool_calls or parsed.errors),
            tool_call_parse_failed=bool(parsed.errors),
            tools_offered=bool(tools),
            tools=tools,
            tool_parser=self._parser_name,
            missing_tool_arguments=[f"{c.name}({', '.join(m)})" for c in parsed.tool_calls
                                    if (m := missing_arguments(c.name, c.arguments, tools))],
        )
        for flag, reason in fired.items():
            self.flag_reasons.append((len(self.calls), flag, reason))
        call.messages = [_brief(m) for m in messages[new_from:]]
        if options.prefill:
            call.messages.append({"role": "assistant", "content": options.prefill})
        self.calls.append(call)
        reasoning = None if split.reasoning is None else self._decoder.strip_markers(split.reasoning)
        turn = Turn(call=call, content=self._decoder.strip_markers(parsed.content), tool_calls=parsed.tool_calls,
                     seconds=seconds, reasoning=reasoning,
                     finish_reason="tool_calls" if parsed.tool_calls else ("length" if finish == "length" else "stop"))
        call.reply = assistant_message(turn)
        if parsed.tool_calls and self._watch_parent is not None:  # within a rollout's episode
            self._tool_item = open_item("tool", ", ".join(c.name for c in parsed.tool_calls), self._watch_parent)
        # Sent back, a prefilled turn is the prefill and its continuation in one assistant message.
        reply = {**assistant_message(turn), "content": options.prefill + turn.content}
        self._conversations.append(_Conversation(
            canonical + canonical_messages([reply], self.reasoning_parser),
            tools_key, list(prompt_ids), list(response_ids), call, options.prefill))
        return turn

    def prompt_length(self, messages: list[dict], tools: list[dict] | None, options: CallOptions) -> int:
        """Tokens of the prompt a call with these arguments would get now (`/v1/messages/count_tokens`)."""
        tools, _ = read_tool_choice(normalize_tools(tools), options.tool_choice)
        return len(self._prompt_ids(messages, tools, options.prefill)[0])

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
        self._conversations = [c for c in self._conversations if c.call is not call]
        self.generated_tokens -= len(call.response_ids)
        if self._budget_overflow and self.generated_tokens < self.limits.max_response_tokens:
            # A call refused while this one held the budget: the record no longer spends it, so neither the
            # episode (flagged overflowed) nor the retry that comes next is cut short.
            self.overflowed, self.overflow_reason, self._budget_overflow = False, None, False
        if last and call.tool_call_attempted:  # the agent will not run tools it never saw
            close_item(self._tool_item)
            self._tool_item = None

    def _prompt_ids(self, messages: list[dict], tools: list[dict] | None, prefill: str = ""):
        """(prompt ids, whether they extend an earlier call exactly, canonical messages, tools key, index of the
        first message that call had not seen). With a `prefill`, the ids end in the assistant turn begun with it
        (ChatRenderer.prompt_text)."""
        canonical = canonical_messages(messages, self.reasoning_parser)
        tools_key = json.dumps(tools, sort_keys=True, ensure_ascii=False)
        for conv in reversed(self._conversations):
            k = len(conv.canonical)
            if conv.tools_key == tools_key and len(canonical) > k and canonical[:k] == conv.canonical:
                ids = self.renderer.render_extension(messages, tools, k, conv.prompt_ids, conv.response_ids,
                                                     self._stop_texts, conv.prefill, prefill)
                if ids is not None:
                    return ids, True, canonical, tools_key, k
                break
        return self.renderer.render(messages, tools, prefill), False, canonical, tools_key, 0

    def _parse(self, text: str, tools: list[dict] | None, call_index: int) -> ParsedOutput:
        if not tools and not self.tool_parser.has_tool_call(text):
            return ParsedOutput(content=text)
        parsed = self.tool_parser.parse(text, tool_names_of(tools), id_prefix=f"call_{call_index}")
        if not tools:
            # A call nobody offered is flagged but not returned: the agent has nothing to run it with. Its text
            # stays, without the family's markers (a JSON answer is a call to Llama 3's parser, and an answer too).
            return ParsedOutput(content=without_markers(text, self.tool_parser.markers).strip(),
                                errors=parsed.errors)
        return parsed


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


def _brief(message: dict) -> dict:
    """A message as the log viewer shows it: role, text, tool calls, tool name (no images, no extra fields)."""
    out = {"role": message.get("role"), "content": flatten_content(message.get("content"))}
    if message.get("tool_calls"):
        out["tool_calls"] = [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
                             for c in _tool_calls_of(message)]
    if message.get("name"):
        out["name"] = message["name"]
    return out


def _stop_string_cut(tokenizer, response_ids: list[int], stops: tuple[str, ...]) -> int | None:
    """Number of tokens up to and including the one that completes the first stop string, or None."""
    full = tokenizer.decode(response_ids, skip_special_tokens=True)
    if not any(s and s in full for s in stops):
        return None  # the common case: one decode, no scan
    for n in range(1, len(response_ids) + 1):
        text = tokenizer.decode(response_ids[:n], skip_special_tokens=True)
        if any(s and s in text for s in stops):
            return n
    return None


def _before_stop(text: str, stops: tuple[str, ...]) -> str:
    """OpenAI semantics: the returned text ends before the first stop string."""
    cuts = [text.find(s) for s in stops if s and s in text]
    return text[: min(cuts)] if cuts else text


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
        return to_chat_response(await self.tuner._complete(messages, tools, options))

    async def chat(self, messages: list[dict], tools: list[dict] | None = None) -> dict:
        return assistant_message(await self.tuner._complete(messages, tools, self.options))

    def get_openai_client(self, sync: bool = False):
        return self.tuner._gateway().client(self.tuner._key(self.options), sync=sync)

    @property
    def base_url(self) -> str:
        return self.tuner._gateway().base_url()

    def get_anthropic_client(self):
        return self.tuner._gateway().anthropic_client(self.tuner._key(self.options))

    @property
    def api_key(self) -> str:
        return self.tuner._key(self.options)
