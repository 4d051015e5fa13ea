"""What the endpoints accept: request bodies read and type-checked before anything is rendered or sampled.

A malformed request gets a 4xx in its API's own error shape and records nothing; it must never reach the tuner,
where a wrong type becomes a plain-text 500 or, worse, a silently different call (`stop: "END"` read as the
stops E, N, D; `max_tokens: true` as 1, since bool is an int in Python). Pure functions: each takes the decoded
JSON and returns typed values or raises `RequestError` naming the field and what to send instead.

`read_chat_request` reads OpenAI's `POST /v1/chat/completions`; frontends/anthropic_api.py (the Messages API) and
frontends/responses_api.py (the Responses API) read theirs with the same helpers, tool calls and schemas included.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

from astuner.model_tuner.turn import CallOptions


class RequestError(ValueError):
    """A request the API refuses with 400 (invalid_request_error); `param` names the field at fault."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


def read_json_object(raw: bytes) -> dict:
    """The body as a JSON object: UTF-8 JSON (RFC 8259), no NaN or Infinity."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise RequestError(f"request body is not UTF-8 ({exc.reason} at byte {exc.start}); send UTF-8 JSON") from None

    def constant(name: str):
        raise RequestError(f"request body holds {name}, which JSON does not allow; send a finite number")

    try:
        body = json.loads(text, parse_constant=constant)
    except json.JSONDecodeError as exc:
        raise RequestError(f"request body is not JSON: {exc}") from None
    except RecursionError:
        raise RequestError("request body is nested too deeply to read") from None
    if not isinstance(body, dict):
        raise RequestError(f"request body must be a JSON object, got {_kind(body)}")
    return body


def _kind(value: Any) -> str:
    names = {bool: "a boolean", int: "an integer", float: "a number", str: "a string", list: "a list",
             dict: "an object", type(None): "null"}
    return names.get(type(value), type(value).__name__)


def integer(body: dict, name: str, minimum: int = 1) -> int | None:
    """An optional integer field >= minimum. Booleans are refused: JSON `true` is not a count."""
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise RequestError(f"'{name}' must be an integer >= {minimum}, got {_kind(value)}", name)
    if value < minimum:
        raise RequestError(f"'{name}' must be an integer >= {minimum}, got {value}", name)
    return value


def number(body: dict, name: str, low: float, high: float) -> float | None:
    """An optional finite number field within [low, high]."""
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise RequestError(f"'{name}' must be a number, got {_kind(value)}", name)
    if not (math.isfinite(value) and low <= value <= high):
        raise RequestError(f"'{name}' must be between {low:g} and {high:g}, got {value}", name)
    return float(value)


def boolean(body: dict, name: str) -> bool:
    value = body.get(name)
    if value is not None and not isinstance(value, bool):
        raise RequestError(f"'{name}' must be true or false, got {_kind(value)}", name)
    return bool(value)


def string_list(value: Any, name: str, allow_string: bool) -> tuple[str, ...]:
    """A list of strings; a single string too where the API allows one (OpenAI's `stop`)."""
    if value is None:
        return ()
    if isinstance(value, str) and allow_string:
        return (value,)
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        shape = "a string or a list of strings" if allow_string else "a list of strings"
        raise RequestError(f"'{name}' must be {shape}, got {_kind(value)}", name)
    return tuple(value)


def dict_or_none(body: dict, name: str) -> dict | None:
    value = body.get(name)
    if value is not None and not isinstance(value, dict):
        raise RequestError(f"'{name}' must be an object, got {_kind(value)}", name)
    return value


# --- tool calls and tool schemas, shared by the three readers ----------------------------------------------
# Chat templates index these fields as they come (Qwen3.5 iterates `arguments` as a mapping, Gemma 4 adds call
# ids to strings and reads `properties` with `.items()`, Mistral measures ids with len): a wrong type there
# would fail inside the template. Checked here, they are refused naming the field.


def call_id(value: Any, where: str, param: str) -> str:
    """A tool call's id (or the id a tool result answers): a string, as every API defines it."""
    if not isinstance(value, str):
        raise RequestError(f"'{where}' must be the tool call's id, a string; got {_kind(value)}", param)
    return value


def tool_arguments(value: Any, where: str, param: str) -> None:
    """A tool call's arguments: a JSON object, as a string ("" for none) or already decoded."""
    if isinstance(value, dict):
        return
    if not isinstance(value, str):
        raise RequestError(f"'{where}' must be a JSON object as a string, got {_kind(value)}", param)
    try:
        decoded = json.loads(value) if value.strip() else {}
    except (json.JSONDecodeError, RecursionError):
        decoded = None
    if not isinstance(decoded, dict):
        raise RequestError(f"'{where}' must be a JSON object as a string (e.g. '{{\"code\": \"1+1\"}}'), got "
                           f"{value[:60]!r}", param)


def tool_schema(schema: Any, where: str, param: str) -> None:
    """A tool's parameters: a JSON schema object whose `properties` (at any depth) are objects and whose
    `required` lists are lists of strings."""
    if not isinstance(schema, dict):
        raise RequestError(f"'{where}' must be a JSON schema object, got {_kind(schema)}", param)
    pending = [(where, schema)]
    while pending:  # a loop, not recursion: a schema may be nested as deep as the JSON reader allows
        at, node = pending.pop()
        properties, required = node.get("properties"), node.get("required")
        if properties is not None and not isinstance(properties, dict):
            raise RequestError(f"'{at}.properties' must be an object of property schemas, got "
                               f"{_kind(properties)}", param)
        if required is not None and not (isinstance(required, list) and all(isinstance(r, str) for r in required)):
            raise RequestError(f"'{at}.required' must be a list of property names, got {_kind(required)}", param)
        pending += [(f"{at}.properties.{name}", sub) for name, sub in (properties or {}).items()
                    if isinstance(sub, dict)]
        if isinstance(node.get("items"), dict):
            pending.append((f"{at}.items", node["items"]))


# --- OpenAI chat completions ------------------------------------------------------------------------------

_ROLES = ("system", "developer", "user", "assistant", "tool", "function")


@dataclass
class ChatRequest:
    messages: list[dict]
    tools: list[dict] | None
    options: CallOptions
    stream: bool
    usage_chunk: bool  # stream_options.include_usage: a final chunk with the usage
    ignored: dict[str, Any]  # sampling filters the run overrides (top_p, top_k), for a warning


def _check_message(i: int, message: Any) -> None:
    where = f"messages[{i}]"
    if not isinstance(message, dict):
        raise RequestError(f"'{where}' must be a message object, got {_kind(message)}", "messages")
    role = message.get("role")
    if role not in _ROLES:
        raise RequestError(f"'{where}.role' must be one of {', '.join(_ROLES)}, got {role!r}", "messages")
    content = message.get("content")
    if isinstance(content, list):
        for j, part in enumerate(content):
            if not isinstance(part, dict) or not isinstance(part.get("type", "text"), str):
                raise RequestError(f"'{where}.content[{j}]' must be a content part object", "messages")
            kind = part.get("type", "text")
            if kind == "text" and not isinstance(part.get("text"), str):
                raise RequestError(f"'{where}.content[{j}].text' must be a string", "messages")
            if kind not in ("text", "refusal"):
                # Dropping it would train the model on a prompt the agent never sent (the image gone silently).
                raise RequestError(f"'{where}.content[{j}]' is a {kind!r} part: this model reads text only; send "
                                   "text parts, or describe the content in text", "messages")
    elif content is not None and not isinstance(content, str):
        raise RequestError(f"'{where}.content' must be a string, a list of content parts or null, got "
                           f"{_kind(content)}", "messages")
    if role == "tool":  # the API requires it, and templates print it
        call_id(message.get("tool_call_id"), f"{where}.tool_call_id", "messages")
    calls = message.get("tool_calls")
    if calls is None:
        return
    if role != "assistant" or not isinstance(calls, list):
        raise RequestError(f"'{where}.tool_calls' must be a list, on an assistant message", "messages")
    for j, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise RequestError(f"'{where}.tool_calls[{j}]' must be {{\"id\", \"type\": \"function\", \"function\": "
                               "{\"name\": str, \"arguments\": str}}", "messages")
        call_id(call.get("id"), f"{where}.tool_calls[{j}].id", "messages")
        tool_arguments(function.get("arguments", ""), f"{where}.tool_calls[{j}].function.arguments", "messages")


def _check_tools(tools: Any) -> list[dict] | None:
    if tools is None or tools == []:
        return None
    if not isinstance(tools, list):
        raise RequestError(f"'tools' must be a list of tool objects, got {_kind(tools)}", "tools")
    for i, tool in enumerate(tools):
        function = tool.get("function", tool) if isinstance(tool, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) or not function["name"]:
            raise RequestError(f"'tools[{i}]' must be {{\"type\": \"function\", \"function\": {{\"name\": str, "
                               "\"parameters\": {...}}}}", "tools")
        tool_schema(function.get("parameters", {}), f"tools[{i}].function.parameters", "tools")
    return tools


def _check_tool_choice(choice: Any) -> None:
    if choice is None or isinstance(choice, str):
        return  # a name the tools do not offer is refused by chat_format.read_tool_choice
    function = choice.get("function") if isinstance(choice, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise RequestError("'tool_choice' must be 'auto', 'none', 'required' or {\"type\": \"function\", "
                           "\"function\": {\"name\": str}}", "tool_choice")


def read_chat_request(body: dict, base: CallOptions) -> ChatRequest:
    """A `POST /v1/chat/completions` body, checked; `base`: the key's agent and trainability."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError("'messages' must be a non-empty list of message objects", "messages")
    for i, message in enumerate(messages):
        _check_message(i, message)
    n = integer(body, "n")
    if n not in (None, 1):
        raise RequestError("only n=1 is supported: each sampled call is one recorded training sample", "n")
    tools = _check_tools(body.get("tools"))
    _check_tool_choice(body.get("tool_choice"))
    fmt = dict_or_none(body, "response_format")
    if fmt is not None and fmt.get("type") not in (None, "text"):
        raise RequestError(f"response_format {fmt.get('type')!r} is not supported (no constrained decoding); "
                           "ask for JSON in the prompt or use tools", "response_format")
    stream_options = dict_or_none(body, "stream_options") or {}
    stream = boolean(body, "stream")
    number(body, "top_p", 0.0, 1.0)
    integer(body, "top_k", minimum=-1)
    max_tokens = integer(body, "max_completion_tokens")
    max_tokens = integer(body, "max_tokens") if max_tokens is None else max_tokens
    options = CallOptions(
        agent=base.agent,
        trainable=base.trainable,
        temperature=number(body, "temperature", 0.0, 2.0),
        max_tokens=max_tokens,
        stop=string_list(body.get("stop"), "stop", allow_string=True),
        tool_choice=body.get("tool_choice"),
    )
    ignored = {name: body[name] for name in ("top_p", "top_k")
               if body.get(name) is not None and not (name == "top_p" and body[name] == 1)}
    return ChatRequest(messages, tools, options, stream, boolean(stream_options, "include_usage"), ignored)
