"""One model call of a ModelTuner, step by step (`ModelTuner.complete` runs `complete`).

The prompt (conversations.py) gets its new tokens from the episode's budget (budget.py) and goes to the engine;
the response is cut at the request's stop strings, decoded, split into reasoning and content, parsed for tool
calls and checked (astuner/madness.py); then the call is recorded with exactly the ids the engine saw and
produced, and the turn handed back is remembered for later calls to extend. The steps read and update the
tuner's own state (its budget, record and conversations), which stays on the tuner.
"""

from __future__ import annotations

import time
from typing import NamedTuple

from astuner import cuts
from astuner.alarms import missing_arguments
from astuner.madness import CallView, run_checks
from astuner.model_tuner.chat_format import (
    _tool_calls_of,
    flatten_content,
    normalize_tools,
    read_tool_choice,
    tool_choice_violation,
    tool_names_of,
)
from astuner.model_tuner.context import (
    SUMMARIZING,
    Compaction,
    delegable,
    delegated,
    drop_tool_outputs,
    shown_through,
    summarized_view,
    summary_cut,
    summary_options,
    summary_request,
    subagent_request,
)
from astuner.model_tuner.conversations import Prompt
from astuner.model_tuner.tool_parser import ParsedOutput, without_markers
from astuner.model_tuner.turn import CallOptions, Turn, assistant_message
from astuner.types import LLMCall, SamplingParams
from astuner.watchdog import close_item, open_item, watch


class Sample(NamedTuple):
    """What the engine generated, cut at the request's stop strings."""

    ids: list[int]
    logprobs: list[float]
    finish: str


class Reading(NamedTuple):
    """A response read: its text, reasoning split, parsed tool calls, and the madness checks that fired."""

    text: str
    split: object  # the reasoning parser's split: .reasoning, .content
    parsed: ParsedOutput
    fired: dict


async def complete(tuner, messages: list[dict], tools: list[dict] | None, options: CallOptions) -> Turn:
    """Render, reserve, generate, read and record one call of the tuner's episode."""
    tuner.check_deadline()
    tools, required_call = read_tool_choice(normalize_tools(tools), options.tool_choice)
    messages, seen, compacted = await _in_context(tuner, messages, tools, options)
    # With a prefill the turn is already begun: the model continues the prefill's own tokens.
    prompt = tuner.prompt(messages, tools, options.prefill)
    context = _segment(tuner, prompt, options.agent, compacted, seen is not None)
    # The context it was prompted in: its compaction's segment, else its agent's latest.
    segment = seen.segment if seen is not None else tuner.context.segments.get(options.agent, 0)
    # A summary or a sub-agent's report is capped by summary_max_tokens, not by the per-turn cap.
    own_cap = tuner.context.summary_max_tokens if SUMMARIZING.get() else None
    max_tokens, limit = await tuner.budget.reserve(len(prompt.ids), tuner.started == 0, options.max_tokens,
                                                    tuner.check_deadline, own_cap)
    index = tuner.started  # read after the reservation, which may wait for parallel calls
    own_temperature, own_top_p, own_top_k = tuner.roster.sampling_of(options.agent)  # its model's (astuner.models)
    requested = options.temperature if options.temperature and options.temperature > 0 else own_temperature
    temperature = call_temperature(tuner.temperature, requested)
    tuner.started += 1
    sampling = SamplingParams(
        temperature=temperature,
        max_tokens=max_tokens,
        stop_token_ids=tuner.stop_token_ids,
        # Distinct per call so repeated prompts within an episode are not sampled identically.
        seed=None if tuner.seed is None else tuner.seed + index,
        top_p=tuner.top_p if own_top_p is None else own_top_p,
        top_k=tuner.top_k if own_top_k is None else own_top_k,
    )
    started = time.perf_counter()
    result = await _generate(tuner, prompt.ids, sampling, index, max_tokens, options.agent)
    tuner.check_deadline()  # a call that outlived the deadline is not handed back to the agent
    seconds = time.perf_counter() - started
    sample = cut_at_stop(tuner.tokenizer, result, options.stop)
    tuner.budget.generated_tokens += len(sample.ids)
    reading = _read(tuner, sample.ids, tools, required_call, options.stop, index)
    call = _record(tuner, messages, prompt, options, tools, temperature, sample, reading)
    call.cut = cuts.call_cut(sample.finish, len(sample.ids), max_tokens, limit)
    call.segment, call.context = segment, context
    if SUMMARIZING.get() and call.cut in (cuts.REQUEST, cuts.TURN_CAP):
        call.cut = cuts.SUMMARY_CAP  # the run's summary_max_tokens, not an agent's own max_tokens
    return _answer(tuner, call, prompt, options, sample, reading, seconds)


async def _in_context(tuner, messages: list[dict], tools: list[dict] | None,
                      options: CallOptions) -> tuple[list[dict], Compaction | None, bool]:
    """What the model is shown of the agent's messages (context.py), the compaction it is shown through (None:
    as they are), and whether this call made it: the agent's compaction applied, and, when a whole turn does not
    fit, the context policy's new one (a summary is a call of this episode). An agent's calls decide one at a
    time: a call that arrives while another of the same agent is being summarized waits, then sees that summary."""
    state, agent = tuner.context, options.agent
    if SUMMARIZING.get() or state.policy == "none":  # the summary call itself, or no policy
        seen = state.match(agent, messages, tuner.reasoning_parser)
        return shown_through(seen, messages), seen, False
    async with state.lock(agent):  # matched inside: a summary this call waited for is seen
        return await _compact_if_needed(tuner, messages, tools, options)


async def _compact_if_needed(tuner, messages: list[dict], tools: list[dict] | None,
                             options: CallOptions) -> tuple[list[dict], Compaction | None, bool]:
    state, parser, agent = tuner.context, tuner.reasoning_parser, options.agent
    seen = state.match(agent, messages, parser)
    view = shown_through(seen, messages)
    lim = tuner.limits
    turn = min(lim.max_tokens_per_turn, options.max_tokens or lim.max_tokens_per_turn)

    def fits(request: list[dict], request_tools=tools, room=turn, prefill=options.prefill) -> bool:
        return len(tuner.prompt(request, request_tools, prefill).ids) + room <= lim.max_model_len

    if fits(view):
        return view, seen, False
    side_fits = lambda m: fits(m, None, state.summary_max_tokens, "")  # noqa: E731 - a side call: no tools
    if state.policy == "drop_tool_outputs":
        shown, upto = drop_tool_outputs(view, fits)
    elif state.policy == "subagent":
        shown, upto = await _delegate(tuner, view, options, fits, side_fits)
    else:
        cut = summary_cut(view)
        request = None if cut is None else summary_request(view, cut, side_fits)
        summary = None if request is None else await _side_call(tuner, request, options, "summary")
        if summary is None:  # nothing to summarize, or nothing to show in its place: the call goes on as it was
            return view, seen, False
        shown, n_shown = summarized_view(view, cut, summary)
        return shown, state.compact(agent, messages, seen, shown[:n_shown], cut, parser), True
    if not upto:
        return view, seen, False
    upto = max(upto, len(seen.shown) if seen is not None else 0)  # the new compaction covers the one seen
    return shown, state.compact(agent, messages, seen, shown[:upto], upto, parser), True


async def _side_call(tuner, request: list[dict], options: CallOptions, context: str) -> str | None:
    """A call of this episode the context policy makes (a summary, a sub-agent's report), recorded and trained as
    any other and labelled `context`; its text, None when it came back empty."""
    token = SUMMARIZING.set(True)
    try:
        answer = await complete(tuner, request, None, summary_options(options, tuner.context.summary_max_tokens))
    finally:
        SUMMARIZING.reset(token)
    answer.call.context = context
    return answer.content if answer.content.strip() else None


async def _delegate(tuner, view: list[dict], options: CallOptions, fits, side_fits) -> tuple[list[dict], int]:
    """The view with its oldest tool results, one at a time, each replaced by the report of a sub-agent that read
    it in a fresh context (context.py), until `fits`; and the index just past the last one replaced (0: none)."""
    shown, upto = list(view), 0
    for i in delegable(view):
        request = subagent_request(shown, i, side_fits)
        report = None if request is None else await _side_call(tuner, request, options, "subagent")
        if report is not None:
            shown[i], upto = delegated(shown[i], report), i + 1
            if fits(shown):
                break
    return shown, upto


def _segment(tuner, prompt: Prompt, agent: str, compacted: bool, in_compaction: bool) -> str:
    """The call's context label; a call of an agent that made calls before, sees none of its compactions and
    does not extend any earlier call starts a new segment ("reset": a framework that compacted its own history,
    or another conversation of the same agent, such as a parallel one)."""
    state = tuner.context
    if compacted:
        return "compacted"
    if SUMMARIZING.get() or in_compaction or prompt.extends or not any(c.agent == agent for c in tuner.calls):
        return ""
    state.segments[agent] = state.segments.get(agent, 0) + 1
    return "reset"


def call_temperature(temperature: float, requested: float | None) -> float:
    """The run's temperature, or the request's for a training rollout: validation stays greedy whatever the
    agent asks."""
    if requested is not None and requested > 0 and temperature > 0:
        return float(requested)
    return temperature


async def _generate(tuner, prompt_ids: list[int], sampling: SamplingParams, index: int, max_tokens: int,
                    agent: str = ""):
    """The engine's result. Until it comes the call can be aborted (`ModelTuner.expire`); then its reservation
    goes back to the budget, however the call ended."""
    request_id = f"{tuner.episode_uid}/{index}/{id(tuner):x}"
    engine = tuner.engine_for(agent)
    tuner.in_flight[request_id] = engine
    close_item(tuner.tool_item)  # the agent is back: its tools have answered
    try:
        with watch("model call", f"{index} of {tuner.episode_uid}", parent=tuner.watch_parent):
            return await engine.generate(list(prompt_ids), sampling, request_id=request_id)
    finally:
        tuner.in_flight.pop(request_id, None)
        tuner.budget.release(max_tokens)


def cut_at_stop(tokenizer, result, stops: tuple[str, ...]) -> Sample:
    """The engine's ids, logprobs and finish reason, cut after the token that completes a stop string."""
    response_ids = [int(i) for i in result.token_ids]
    logprobs = [float(x) for x in result.logprobs]
    finish = result.finish_reason
    if stops:
        cut = _stop_string_cut(tokenizer, response_ids, stops)
        if cut is not None:
            response_ids, logprobs, finish = response_ids[:cut], logprobs[:cut], "stop"
    return Sample(response_ids, logprobs, finish)


def _read(tuner, response_ids: list[int], tools: list[dict] | None, required_call, stops: tuple[str, ...],
          index: int) -> Reading:
    """The response's text (without its stop token, ended before a stop string), its reasoning and tool calls,
    a tool choice it broke, and the madness checks that fired."""
    text_ids = response_ids[:-1] if response_ids and response_ids[-1] in tuner.stop_ids else response_ids
    text = tuner.decoder.decode(text_ids)
    if stops:
        text = _before_stop(text, stops)
    split = tuner.reasoning_parser.split(text)
    parsed = parse_tool_calls(tuner.tool_parser, split.content, tools, call_index=index)
    violation = tool_choice_violation(required_call, [c.name for c in parsed.tool_calls])
    if violation:
        parsed.errors.append(violation)

    view = CallView(response_ids, text, tuner.decoder.leak_ids, tuner.stop_ids, parsed.errors)
    return Reading(text, split, parsed, run_checks(tuner.madness_checks, view))


def _record(tuner, messages: list[dict], prompt: Prompt, options: CallOptions, tools: list[dict] | None,
            temperature: float, sample: Sample, reading: Reading) -> LLMCall:
    """The call, appended to the episode's record, with the reasons of the flags it raised."""
    parsed = reading.parsed
    call = LLMCall(
        prompt_ids=list(prompt.ids),
        response_ids=sample.ids,
        response_logprobs=sample.logprobs,
        finish_reason=sample.finish,
        temperature=temperature,
        response_text=reading.text,
        flags=list(reading.fired),
        agent=options.agent,
        trainable=options.trainable,
        model=tuner.roster.model_of(options.agent),
        extends_previous=prompt.extends,
        tool_call_attempted=bool(parsed.tool_calls or parsed.errors),
        tool_call_parse_failed=bool(parsed.errors),
        tools_offered=bool(tools),
        tools=tools,
        tool_parser=tuner.parser_name,
        missing_tool_arguments=[f"{c.name}({', '.join(m)})" for c in parsed.tool_calls
                                if (m := missing_arguments(c.name, c.arguments, tools))],
    )
    for flag, reason in reading.fired.items():
        tuner.flag_reasons.append((len(tuner.calls), flag, reason))
    call.messages = [_brief(m) for m in messages[prompt.new_from:]]
    if options.prefill:
        call.messages.append({"role": "assistant", "content": options.prefill})
    tuner.calls.append(call)
    return call


def _answer(tuner, call: LLMCall, prompt: Prompt, options: CallOptions, sample: Sample, reading: Reading,
            seconds: float) -> Turn:
    """The turn handed back to the agent, remembered for later calls to extend; tools it called are watched."""
    decoder, parsed, split = tuner.decoder, reading.parsed, reading.split
    reasoning = None if split.reasoning is None else decoder.strip_markers(split.reasoning)
    finish = "tool_calls" if parsed.tool_calls else ("length" if sample.finish == "length" else "stop")
    turn = Turn(call=call, content=decoder.strip_markers(parsed.content), tool_calls=parsed.tool_calls,
                seconds=seconds, reasoning=reasoning, finish_reason=finish)
    call.reply = assistant_message(turn)
    if parsed.tool_calls and tuner.watch_parent is not None:  # within a rollout's episode
        tuner.tool_item = open_item("tool", ", ".join(c.name for c in parsed.tool_calls), tuner.watch_parent)
    # Sent back, a prefilled turn is the prefill and its continuation in one assistant message.
    reply = {**assistant_message(turn), "content": options.prefill + turn.content}
    tuner.conversations.remember(prompt, reply, tuner.reasoning_parser, sample.ids, call, options.prefill)
    return turn


def parse_tool_calls(tool_parser, text: str, tools: list[dict] | None, call_index: int) -> ParsedOutput:
    """The response's content and tool calls (ids `call_<index>_<j>`); calls to tools nobody offered are errors."""
    if not tools and not tool_parser.has_tool_call(text):
        return ParsedOutput(content=text)
    parsed = tool_parser.parse(text, tool_names_of(tools), id_prefix=f"call_{call_index}", tools=tools)
    if not tools:
        # A call nobody offered is flagged but not returned: the agent has nothing to run it with. Its text
        # stays, without the family's markers (a JSON answer is a call to Llama 3's parser, and an answer too).
        return ParsedOutput(content=without_markers(text, tool_parser.markers).strip(), errors=parsed.errors)
    return parsed


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
