"""The OpenAI Responses front end: `POST /v1/responses` beside Chat Completions, on the same app and keys.

It is the OpenAI Agents SDK's default model (`OpenAIResponsesModel`, what `Agent(model="name")` uses) and what
Codex-style harnesses speak. A request is converted to the OpenAI chat messages every other front end uses and
goes through the same `ModelTuner.complete`, so it is recorded with exact ids and extends earlier calls
token-exactly like any other. Conversions:
  instructions                                -> a system message first
  input: a string                             -> one user message
  message items (user, system, developer, assistant; a string or input_text / output_text parts)
                                              -> messages of that role (developer -> system)
  reasoning, assistant message, function_call items of one model turn (in that order, as this endpoint
  answers them)                               -> one assistant message: reasoning_content, content, tool_calls
  function_call_output items                  -> tool messages (tool_call_id = call_id)
  fc1, out1, fc2, out2 (each call followed by its output, as some harnesses list parallel calls)
                                              -> one assistant message with both calls, then both outputs, when
                                                 this episode's record shows fc1 and fc2 came from one answer;
                                                 else two assistant turns (the model saw out1 before fc2)
  tools [{type: "function", name, description, parameters}] -> OpenAI function schemas; other tool types: 400
  tool_choice auto | none | required | {type: "function", name} -> the same checks as Chat Completions (checked,
                                              not constrained: see chat_format.read_tool_choice)
  max_output_tokens, temperature              -> the same limits the Chat Completions route honours
The answer's `output`: a `reasoning` item (when the family's reasoning parser split some out; its text in
`content` as reasoning_text, as vLLM serves open models), a `message` item (when there is text, or no call),
then one `function_call` item per parsed call. `status` is "incomplete" (reason max_output_tokens) when the
turn hit its token limit. With `stream: true` the answer comes as the API's server-sent events (response.created
... response.completed). Nothing is stored server-side: `store` is accepted and answered as false, and
`previous_response_id`, `conversation` and stored `prompt`s are refused (send the whole conversation in `input`,
as the Agents SDK does by default). `parallel_tool_calls`, `reasoning`, `metadata`, `include` and `truncation`
are accepted and echoed or ignored; unknown fields are ignored, as on the Chat Completions route. A malformed
body is refused with a 400 naming the field (request_checks.RequestError) before anything is rendered or
recorded. The route itself is in gateway.py, with the Chat Completions route's keys, errors and delivery checks.
"""

from __future__ import annotations

import itertools
import json
import re
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from astuner.model_tuner.chat_format import normalize_tools, read_tool_choice
from astuner.model_tuner.request_checks import (
    RequestError,
    boolean,
    dict_or_none,
    integer,
    number,
    tool_arguments,
    tool_schema,
)
from astuner.model_tuner.turn import CallOptions, assistant_message

# --- the request ------------------------------------------------------------------------------------------

_ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}
_TEXT_PARTS = ("input_text", "output_text")
# The order of a model turn's items in this endpoint's answers: an item ranked lower than (or equal to, but for
# function calls) the one before it starts a new assistant turn.
_TURN_RANK = {"reasoning": 0, "message": 1, "function_call": 2}
_STATEFUL = {
    "previous_response_id": "this endpoint stores no responses: send the whole conversation in 'input' "
                            "(earlier output items included) instead of previous_response_id",
    "conversation": "this endpoint stores no conversations: send the whole conversation in 'input'",
    "prompt": "this endpoint stores no prompt templates: send the instructions and input themselves",
    "background": "background responses are not supported: this endpoint answers each request in the request",
}


@dataclass(frozen=True)
class ResponsesRequest:
    """A checked request: what the tuner needs, and what the answer echoes back."""

    messages: list[dict]  # OpenAI chat messages
    tools: list[dict] | None  # OpenAI chat tool schemas
    options: CallOptions  # temperature, max_output_tokens, tool_choice (Chat Completions' shape)
    stream: bool = False
    echo: dict = field(default_factory=dict)  # Response fields that repeat the request
    ignored: dict = field(default_factory=dict)  # top_p / top_k: the run's filters apply (warned once)


def _need(ok: bool, message: str, param: str) -> None:
    if not ok:
        raise RequestError(message, param)


def _string(item: dict, key: str, where: str) -> str:
    value = item.get(key)
    _need(isinstance(value, str) and value != "", f"'{where}.{key}' must be a non-empty string, got {value!r}",
          "input")
    return value


def _text(content: Any, where: str, allowed: tuple[str, ...] = _TEXT_PARTS) -> str:
    """A content string, or text parts joined with newlines; any other part is refused by its type. `where`
    names the content in messages (e.g. "input[2].content")."""
    if isinstance(content, str):
        return content
    _need(isinstance(content, list), f"'{where}' must be a string or a list of content parts", "input")
    texts = []
    for j, part in enumerate(content):
        _need(isinstance(part, dict), f"'{where}[{j}]' must be a content part object", "input")
        kind = part.get("type")
        if kind == "refusal" and "refusal" in allowed:
            text = part.get("refusal")
        else:
            _need(kind in allowed, f"'{where}[{j}]' has type {kind!r}; this endpoint takes text only "
                                   f"({', '.join(allowed)}): the policy is trained on text tokens", "input")
            text = part.get("text")
        _need(isinstance(text, str), f"'{where}[{j}]' has no text string", "input")
        texts.append(text)
    return "\n".join(texts)


def _reasoning_text(item: dict, where: str) -> str:
    """The reasoning item's text: its `content` (reasoning_text parts) or else its `summary` (summary_text)."""
    texts: list[str] = []
    for key in ("content", "summary"):
        parts = item.get(key)
        _need(parts is None or isinstance(parts, list), f"'{where}.{key}' must be a list", "input")
        for j, part in enumerate(parts or []):
            _need(isinstance(part, dict) and isinstance(part.get("text"), str),
                  f"'{where}.{key}[{j}]' must be an object with a text string", "input")
        if parts:
            texts = [part["text"] for part in parts]
            break
    return "\n".join(texts)


def to_chat_messages(input_: Any, instructions: Any = None, origins: Mapping[str, int] | None = None) -> list[dict]:
    """The request's instructions and input items as OpenAI chat messages. `origins`: call id -> the recorded
    call whose answer issued it (this episode's), which tells parallel calls listed with their outputs between
    them from calls of successive turns."""
    _need(instructions is None or isinstance(instructions, str), "'instructions' must be a string",
          "instructions")
    out: list[dict] = [{"role": "system", "content": instructions}] if instructions else []
    if isinstance(input_, str):
        input_ = [{"role": "user", "content": input_}]
    _need(isinstance(input_, list) and bool(input_), "'input' must be a string or a non-empty list of items",
          "input")
    turn: dict | None = None  # the assistant message the next reasoning/message/function_call item may join
    rank = -1
    answered: dict | None = None  # the last assistant message, while only its calls' outputs follow it
    for i, item in enumerate(input_):
        where = f"input[{i}]"
        _need(isinstance(item, dict), f"'{where}' must be an item object, got {type(item).__name__}", "input")
        kind, role = item.get("type", "message"), item.get("role")
        _need(isinstance(kind, str), f"'{where}.type' must be a string, got {kind!r}", "input")
        if kind == "message":
            _need(isinstance(role, str) and role in _ROLES,
                  f"'{where}.role' must be one of {', '.join(_ROLES)}, got {role!r}", "input")
        if kind == "message" and role != "assistant":
            out.append({"role": _ROLES[role], "content": _text(item.get("content"), where + ".content")})
            turn = answered = None
            continue
        if kind == "function_call_output":
            call_id = _string(item, "call_id", where)
            out.append({"role": "tool", "tool_call_id": call_id,
                        "content": _text(item.get("output"), where + ".output", ("input_text",))})
            answered, turn = turn or answered, None
            continue
        _need(kind in _TURN_RANK, f"'{where}' has type {kind!r}; this endpoint takes message, function_call, "
                                  "function_call_output and reasoning items", "input")
        item_rank = _TURN_RANK[kind]
        if turn is None and kind == "function_call" and _same_answer(answered, item.get("call_id"), origins):
            turn = answered  # a parallel call listed after its sibling's output: the outputs stay after both
        elif turn is None or item_rank < rank or (item_rank == rank and kind != "function_call"):
            turn = {"role": "assistant", "content": ""}
            out.append(turn)
        rank = item_rank
        if kind == "reasoning":
            turn["reasoning_content"] = _reasoning_text(item, where)
        elif kind == "message":
            turn["content"] = _text(item.get("content"), where + ".content", _TEXT_PARTS + ("refusal",))
        else:
            arguments = item.get("arguments")
            _need(isinstance(arguments, str), f"'{where}.arguments' must be a string (JSON), got {arguments!r}",
                  "input")
            tool_arguments(arguments, f"{where}.arguments", "input")
            turn.setdefault("tool_calls", []).append({
                "id": _string(item, "call_id", where), "type": "function",
                "function": {"name": _string(item, "name", where), "arguments": arguments}})
    return out


def _same_answer(message: dict | None, call_id: Any, origins: Mapping[str, int] | None) -> bool:
    """Whether `call_id` was issued by the same recorded answer as the calls of `message`. Decided by the record,
    not the shape: the Agents SDK lists a turn's calls then their outputs, but a harness that lists each call
    with its output sends the same shape for one answer's parallel calls as for a call per turn. A call id the
    record does not know (not issued in this episode) starts a new turn, as the items say."""
    if not message or not origins or not message.get("tool_calls"):
        return False
    origin = origins.get(call_id) if isinstance(call_id, str) else None
    return origin is not None and all(origins.get(c["id"]) == origin for c in message["tool_calls"])


def to_chat_tools(tools: Any) -> tuple[list[dict] | None, list[dict]]:
    """(OpenAI chat tool schemas, the tools as the Response echoes them) for Responses-style function tools."""
    if tools is None:
        return None, []
    _need(isinstance(tools, list) and all(isinstance(t, dict) for t in tools),
          "'tools' must be a list of function tool objects", "tools")
    other = sorted({str(t.get("type")) for t in tools if t.get("type") != "function"})
    _need(not other, f"tool type(s) {', '.join(other)} are not supported: only function tools "
                     "({\"type\": \"function\", \"name\", \"parameters\"}), which the agent runs itself", "tools")
    chat, echo = [], []
    for i, tool in enumerate(tools):
        name = tool.get("name")
        _need(isinstance(name, str) and name != "", f"'tools[{i}].name' must be a non-empty string", "tools")
        description, parameters = tool.get("description"), tool.get("parameters")
        _need(description is None or isinstance(description, str), f"'tools[{i}].description' must be a string",
              "tools")
        if parameters is not None:
            tool_schema(parameters, f"tools[{i}].parameters", "tools")
        parameters = parameters or {"type": "object", "properties": {}}
        chat.append({"type": "function",
                     "function": {"name": name, "description": description or "", "parameters": parameters}})
        strict = tool.get("strict")
        echo.append({"type": "function", "name": name, "description": description, "parameters": parameters,
                     "strict": strict if isinstance(strict, bool) else None})
    return chat or None, echo


def to_chat_tool_choice(choice: Any) -> Any:
    """The Responses tool_choice as Chat Completions' (read_tool_choice checks it against the tools next)."""
    if choice is None or choice in ("auto", "none", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise RequestError(f"'tool_choice' {choice!r} is not 'auto', 'none', 'required' or "
                       "{\"type\": \"function\", \"name\": ...}", "tool_choice")


def read_responses_request(body: dict, base: CallOptions, origins: Mapping[str, int] | None = None
                           ) -> ResponsesRequest:
    """A `POST /v1/responses` body (a JSON object), checked; `base`: the key's agent and trainability; `origins`:
    as for to_chat_messages. Raises RequestError (or read_tool_choice's ValueError) saying what to send
    instead."""
    for key, why in _STATEFUL.items():
        _need(body.get(key) in (None, False), why, key)
    text, reasoning, metadata = dict_or_none(body, "text"), dict_or_none(body, "reasoning"), body.get("metadata")
    fmt = (text or {}).get("format")
    _need(fmt is None or (isinstance(fmt, dict) and fmt.get("type") == "text"),
          f"text.format {fmt!r} is not supported (no constrained decoding): ask for JSON in the prompt or use "
          "tools", "text")
    _need(metadata is None or (isinstance(metadata, dict) and all(isinstance(v, str) for v in metadata.values())),
          "'metadata' must be an object of strings", "metadata")
    for name in ("store", "parallel_tool_calls"):  # accepted, echoed or ignored: see the module's docstring
        boolean(body, name)
    stream, parallel = boolean(body, "stream"), body.get("parallel_tool_calls")
    number(body, "top_p", 0.0, 1.0)
    integer(body, "top_k", minimum=-1)
    temperature, max_output = number(body, "temperature", 0.0, 2.0), integer(body, "max_output_tokens")
    tools, tools_echo = to_chat_tools(body.get("tools"))
    choice = to_chat_tool_choice(body.get("tool_choice"))
    read_tool_choice(normalize_tools(tools), choice)  # a choice naming no offered tool: ValueError, 400
    echo = {"instructions": body.get("instructions"), "tools": tools_echo,
            "tool_choice": body.get("tool_choice") or "auto",
            "parallel_tool_calls": True if parallel is None else parallel, "temperature": temperature,
            "max_output_tokens": max_output, "metadata": metadata or {},
            "reasoning": {k: v for k, v in (reasoning or {}).items() if k in ("effort", "summary")
                          and isinstance(v, str)}}
    options = CallOptions(agent=base.agent, trainable=base.trainable, temperature=temperature,
                          max_tokens=max_output, tool_choice=choice)
    ignored = {name: body[name] for name in ("top_p", "top_k")
               if body.get(name) is not None and not (name == "top_p" and body[name] == 1)}
    return ResponsesRequest(to_chat_messages(body.get("input"), body.get("instructions"), origins), tools,
                            options, stream, echo, ignored)


# --- the answer -------------------------------------------------------------------------------------------


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def output_items(turn) -> list[dict]:
    """The turn as Responses output items: reasoning, message, function calls (in the order of the model's
    turn; to_chat_messages reads them back as one assistant message)."""
    items: list[dict] = []
    if turn.reasoning:
        items.append({"id": _new_id("rs"), "type": "reasoning", "summary": [], "status": "completed",
                      "content": [{"type": "reasoning_text", "text": turn.reasoning}]})
    if turn.content or not turn.tool_calls:
        items.append({"id": _new_id("msg"), "type": "message", "role": "assistant",
                      "status": "incomplete" if turn.finish_reason == "length" else "completed",
                      "content": [{"type": "output_text", "text": turn.content, "annotations": [], "logprobs": []}]})
    for call in assistant_message(turn).get("tool_calls") or []:
        items.append({"id": _new_id("fc"), "type": "function_call", "call_id": call["id"],
                      "name": call["function"]["name"], "arguments": call["function"]["arguments"],
                      "status": "completed"})
    return items


def response_object(turn, model: str, request: ResponsesRequest) -> dict:
    """The Response for a completed turn (the `openai` SDK parses it as openai.types.responses.Response)."""
    cut = turn.finish_reason == "length"
    prompt, completion = len(turn.call.prompt_ids), len(turn.call.response_ids)
    return {
        "id": _new_id("resp"), "object": "response", "created_at": int(time.time()), "model": model,
        "status": "incomplete" if cut else "completed",
        "incomplete_details": {"reason": "max_output_tokens"} if cut else None, "error": None,
        "output": output_items(turn), **request.echo, "top_p": None, "store": False, "previous_response_id": None,
        "text": {"format": {"type": "text"}}, "truncation": "disabled",
        "usage": {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
                  "output_tokens": completion, "output_tokens_details": {"reasoning_tokens": 0},
                  "total_tokens": prompt + completion},
    }


def _pieces(text: str) -> list[str]:
    """Text deltas of a few words each; the recorded call keeps the engine's exact ids whatever the cut."""
    words = re.findall(r"\S*\s*", text)
    return ["".join(words[i:i + 4]) for i in range(0, len(words), 4) if "".join(words[i:i + 4])]


async def response_events(whole: dict):
    """The Response as the API's server-sent events, each with its sequence_number."""
    sequence = itertools.count()

    def event(kind: str, **data) -> str:
        payload = {"type": kind, "sequence_number": next(sequence), **data}
        return f"event: {kind}\ndata: {json.dumps(payload, ensure_ascii=False)}\n\n"

    shell = {**whole, "status": "in_progress", "output": [], "usage": None, "incomplete_details": None}
    yield event("response.created", response=shell)
    yield event("response.in_progress", response=shell)
    for index, item in enumerate(whole["output"]):
        at = {"item_id": item["id"], "output_index": index}
        kind = item["type"]
        if kind == "message":
            part = item["content"][0]
            yield event("response.output_item.added", output_index=index,
                        item={**item, "status": "in_progress", "content": []})
            yield event("response.content_part.added", **at, content_index=0, part={**part, "text": ""})
            for piece in _pieces(part["text"]):
                yield event("response.output_text.delta", **at, content_index=0, delta=piece, logprobs=[])
            yield event("response.output_text.done", **at, content_index=0, text=part["text"], logprobs=[])
            yield event("response.content_part.done", **at, content_index=0, part=part)
        elif kind == "reasoning":
            part = item["content"][0]
            yield event("response.output_item.added", output_index=index,
                        item={**item, "status": "in_progress", "content": []})
            yield event("response.content_part.added", **at, content_index=0, part={**part, "text": ""})
            yield event("response.reasoning_text.delta", **at, content_index=0, delta=part["text"])
            yield event("response.reasoning_text.done", **at, content_index=0, text=part["text"])
            yield event("response.content_part.done", **at, content_index=0, part=part)
        else:
            yield event("response.output_item.added", output_index=index,
                        item={**item, "status": "in_progress", "arguments": ""})
            yield event("response.function_call_arguments.delta", **at, delta=item["arguments"])
            yield event("response.function_call_arguments.done", **at, name=item["name"],
                        arguments=item["arguments"])
        yield event("response.output_item.done", output_index=index, item=item)
    yield event("response.incomplete" if whole["status"] == "incomplete" else "response.completed", response=whole)


# --- the route's answer -----------------------------------------------------------------------------------


def answer(turn, model: str, request: ResponsesRequest):
    """The Starlette response for a completed turn: the Response as JSON, or its events when streaming."""
    from starlette.responses import JSONResponse, StreamingResponse

    whole = response_object(turn, model, request)
    if request.stream:
        return StreamingResponse(response_events(whole), media_type="text/event-stream")
    return JSONResponse(whole)
