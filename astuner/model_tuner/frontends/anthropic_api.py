"""The Anthropic Messages front end: `POST /v1/messages` beside the OpenAI route, on the same app and keys.

Coding-agent harnesses speak this API. A request is converted to the OpenAI-shaped messages every other front
end uses and goes through the same `ModelTuner.complete`, so it is recorded with exact ids and extends earlier
calls token-exactly like any other. Conversions:
  system (text or text blocks)           -> a system message
  user text blocks                       -> a user message; `tool_result` blocks -> tool messages (in order)
  assistant text / `thinking` / `tool_use` -> content / reasoning_content / tool_calls
  tools [{name, description, input_schema}] -> OpenAI function schemas
  tool_choice auto | any | tool | none   -> "auto" | "required" | a named function | "none" (checked, not
                                            constrained: see chat_format.read_tool_choice)
  max_tokens, temperature, stop_sequences -> the same limits the OpenAI route honours (max_tokens required,
                                            stop_sequences a list of strings, as the API defines them)
  a final assistant message (a prefill)  -> the start of the answer: the prompt is the conversation with that
                                            message, cut right after its text (no end of turn; transformers'
                                            continue_final_message), the model continues it, and the answer's
                                            content is only the continuation
Image and document blocks are refused with 400 naming the block (the model reads text only), as is any field of
the wrong type (request_checks.py). `POST /v1/messages/count_tokens` renders a request as a call would and
answers `{"input_tokens": N}`.
The answer: `thinking` (when the family's reasoning parser split some out), `text`, then one `tool_use` block per
parsed call; stop_reason tool_use | max_tokens | stop_sequence | end_turn. With `stream: true` the answer comes as
the Messages API's server-sent events (message_start, content_block_start/delta/stop, message_delta,
message_stop). Authentication: `x-api-key` (what the `anthropic` SDK sends) or `Authorization: Bearer`.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from astuner.model_tuner.chat_format import normalize_tools, read_tool_choice
from astuner.model_tuner.request_checks import (
    RequestError,
    boolean,
    call_id,
    integer,
    number,
    string_list,
    tool_schema,
)
from astuner.model_tuner.turn import CallOptions

# Block types by role. Images and documents are refused by name rather than dropped: the model is text-only,
# and a message of only such blocks would vanish from the prompt without a word.
_USER_BLOCKS = ("text", "tool_result")
_ASSISTANT_BLOCKS = ("text", "thinking", "tool_use")
_UNREADABLE = ("image", "document")


@dataclass
class MessagesRequest:
    chat: list[dict]  # OpenAI-shaped messages; a final assistant message (the prefill) is in options.prefill
    tools: list[dict] | None
    options: CallOptions
    stream: bool


def _block_list(content: Any, where: str) -> list[dict]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise RequestError(f"'{where}' must be a string or a list of content blocks", "messages")
    for j, block in enumerate(content):
        if not isinstance(block, dict) or not isinstance(block.get("type"), str):
            raise RequestError(f"'{where}[{j}]' must be a content block with a 'type'", "messages")
    return content


def _refuse_block(block: dict, where: str, allowed: tuple[str, ...]) -> None:
    kind = block["type"]
    if kind in _UNREADABLE:
        raise RequestError(f"'{where}': {kind!r} blocks are refused, since this model reads text only; send the "
                           f"{kind}'s content as text", "messages")
    if kind not in allowed:
        raise RequestError(f"'{where}' is a {kind!r} block, which this endpoint does not take here (it takes "
                           f"{', '.join(allowed)})", "messages")


def _text(block: dict, field: str, where: str) -> str:
    value = block.get(field)
    if not isinstance(value, str):
        raise RequestError(f"'{where}.{field}' must be a string", "messages")
    return value


def _text_of(content: Any, where: str) -> str:
    """Text, or a list of text blocks, as one string (system prompts and tool results)."""
    if content is None:
        return ""
    blocks = _block_list(content, where)
    for j, block in enumerate(blocks):
        _refuse_block(block, f"{where}[{j}]", ("text",))
    return "\n".join(_text(b, "text", f"{where}[{j}]") for j, b in enumerate(blocks))


def _user_messages(blocks: list[dict], where: str) -> list[dict]:
    out, texts = [], []
    for j, block in enumerate(blocks):
        at = f"{where}.content[{j}]"
        _refuse_block(block, at, _USER_BLOCKS)
        if block["type"] == "text":
            texts.append(_text(block, "text", at))
            continue
        call_id(block.get("tool_use_id"), f"{at}.tool_use_id", "messages")
        result = _text_of(block.get("content"), f"{at}.content")
        if block.get("is_error"):
            result = f"Error: {result}"
        out.append({"role": "tool", "tool_call_id": block["tool_use_id"], "content": result})
    if texts:
        out.append({"role": "user", "content": "\n".join(texts)})
    return out


def _assistant_message(blocks: list[dict], where: str) -> dict:
    texts, thinking, calls = [], [], []
    for j, block in enumerate(blocks):
        at = f"{where}.content[{j}]"
        _refuse_block(block, at, _ASSISTANT_BLOCKS)
        if block["type"] == "text":
            texts.append(_text(block, "text", at))
        elif block["type"] == "thinking":
            thinking.append(_text(block, "thinking", at))
        else:
            if not isinstance(block.get("name"), str) or not isinstance(block.get("input", {}), dict):
                raise RequestError(f"'{at}' must be a tool_use block with a 'name' string and an 'input' object",
                                   "messages")
            call_id(block.get("id"), f"{at}.id", "messages")
            calls.append({"id": block["id"], "type": "function",
                          "function": {"name": block["name"], "arguments": json.dumps(block.get("input") or {})}})
    reply: dict[str, Any] = {"role": "assistant", "content": "\n".join(texts)}
    if thinking:
        reply["reasoning_content"] = "\n".join(thinking)
    if calls:
        reply["tool_calls"] = calls
    return reply


def _prefill(message: dict, where: str) -> str:
    """The text of a final assistant message, which the answer continues (the Messages API's prefill)."""
    if message.get("tool_calls") or message.get("reasoning_content"):
        raise RequestError(f"'{where}' ends the conversation as the turn to continue (a prefill), which may hold "
                           "text only; send tool_use and thinking blocks in earlier turns", "messages")
    text = message["content"]
    if text != text.rstrip():
        raise RequestError("final assistant content cannot end with trailing whitespace", "messages")
    return text


def to_openai_messages(body: dict) -> tuple[list[dict], str]:
    """(the request's system prompt and messages as OpenAI chat messages, the prefill: the text of a final
    assistant message, which the answer continues; "" when the conversation ends with the user)."""
    out: list[dict] = []
    system = _text_of(body.get("system"), "system")
    if system:
        out.append({"role": "system", "content": system})
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError("'messages' must be a non-empty list of message objects", "messages")
    prefill = ""
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(message, dict) or message.get("role") not in ("user", "assistant"):
            raise RequestError(f"'{where}' must be a message with role 'user' or 'assistant'", "messages")
        blocks = _block_list(message.get("content"), f"{where}.content")
        if message["role"] == "user":
            out.extend(_user_messages(blocks, where))
        elif i == len(messages) - 1:
            prefill = _prefill(_assistant_message(blocks, where), where)
        else:
            out.append(_assistant_message(blocks, where))
    return out, prefill


def to_openai_tools(body: dict) -> tuple[list[dict] | None, Any]:
    """(OpenAI tool schemas, OpenAI tool_choice) for the request's tools and tool_choice."""
    tools = body.get("tools") or []
    if not isinstance(tools, list):
        raise RequestError("'tools' must be a list of tool objects", "tools")
    for i, tool in enumerate(tools):
        if not (isinstance(tool, dict) and isinstance(tool.get("name"), str) and tool["name"]
                and isinstance(tool.get("input_schema", {}), dict)
                and isinstance(tool.get("description", ""), str)):
            raise RequestError(f"'tools[{i}]' must be {{\"name\": str, \"description\": str, \"input_schema\": "
                               "{...}}", "tools")
        tool_schema(tool.get("input_schema", {}), f"tools[{i}].input_schema", "tools")
    schemas = [{"type": "function", "function": {"name": t["name"], "description": t.get("description", ""),
                                                 "parameters": t.get("input_schema") or {"type": "object"}}}
               for t in tools]
    choice = body.get("tool_choice")
    kind = choice.get("type") if isinstance(choice, dict) else choice
    mapped = {None: None, "auto": "auto", "any": "required", "none": "none"}
    if kind == "tool":
        return schemas or None, {"type": "function", "function": {"name": choice.get("name")}}
    if not isinstance(kind, (str, type(None))) or kind not in mapped:
        raise RequestError(f"tool_choice type {kind!r} is not auto, any, tool or none", "tool_choice")
    return schemas or None, mapped[kind]


def read_messages_request(body: dict, base: CallOptions, count_only: bool = False) -> MessagesRequest:
    """A `POST /v1/messages` body, checked (for `/v1/messages/count_tokens`, `count_only`: no max_tokens)."""
    chat, prefill = to_openai_messages(body)
    tools, choice = to_openai_tools(body)
    read_tool_choice(normalize_tools(tools), choice)  # a choice naming no offered tool: 400
    max_tokens = integer(body, "max_tokens")
    if max_tokens is None and not count_only:
        raise RequestError("'max_tokens' is required: an integer >= 1", "max_tokens")
    options = CallOptions(agent=base.agent, trainable=base.trainable,
                          temperature=number(body, "temperature", 0.0, 1.0), max_tokens=max_tokens,
                          stop=string_list(body.get("stop_sequences"), "stop_sequences", allow_string=False),
                          tool_choice=choice, prefill=prefill)
    number(body, "top_p", 0.0, 1.0)
    integer(body, "top_k", minimum=0)
    return MessagesRequest(chat, tools, options, boolean(body, "stream"))


def _blocks(turn) -> list[dict]:
    blocks: list[dict] = []
    if turn.reasoning:
        blocks.append({"type": "thinking", "thinking": turn.reasoning, "signature": ""})
    if turn.content or not turn.tool_calls:
        blocks.append({"type": "text", "text": turn.content})
    for call in turn.tool_calls:
        blocks.append({"type": "tool_use", "id": call.id, "name": call.name, "input": call.arguments})
    return blocks


def _stop(turn, tokenizer, stop_sequences: tuple[str, ...]) -> tuple[str, str | None]:
    if turn.tool_calls:
        return "tool_use", None
    if turn.finish_reason == "length":
        return "max_tokens", None
    if stop_sequences:
        full = tokenizer.decode(turn.call.response_ids, skip_special_tokens=True)
        hits = [(full.find(s), s) for s in stop_sequences if s and s in full]
        if hits:
            return "stop_sequence", min(hits)[1]
    return "end_turn", None


def _usage(turn) -> dict:
    return {"input_tokens": len(turn.call.prompt_ids), "output_tokens": len(turn.call.response_ids)}


def message_response(turn, model: str, tokenizer, stop_sequences: tuple[str, ...]) -> dict:
    stop_reason, stop_sequence = _stop(turn, tokenizer, stop_sequences)
    return {"id": f"msg_{uuid.uuid4().hex[:24]}", "type": "message", "role": "assistant", "model": model,
            "content": _blocks(turn), "stop_reason": stop_reason, "stop_sequence": stop_sequence,
            "usage": _usage(turn)}


async def message_events(turn, model: str, tokenizer, stop_sequences: tuple[str, ...]):
    """The answer as the Messages API's server-sent events."""
    whole = message_response(turn, model, tokenizer, stop_sequences)

    def event(kind: str, data: dict) -> str:
        return f"event: {kind}\ndata: {json.dumps({'type': kind, **data}, ensure_ascii=False)}\n\n"

    start = {**whole, "content": [], "stop_reason": None, "stop_sequence": None,
             "usage": {"input_tokens": whole["usage"]["input_tokens"], "output_tokens": 0}}
    yield event("message_start", {"message": start})
    for index, block in enumerate(whole["content"]):
        kind = block["type"]
        if kind == "text":
            yield event("content_block_start", {"index": index, "content_block": {"type": "text", "text": ""}})
            if block["text"]:
                yield event("content_block_delta", {"index": index,
                                                    "delta": {"type": "text_delta", "text": block["text"]}})
        elif kind == "thinking":
            yield event("content_block_start", {"index": index,
                                                "content_block": {"type": "thinking", "thinking": "",
                                                                  "signature": ""}})
            yield event("content_block_delta", {"index": index,
                                                "delta": {"type": "thinking_delta", "thinking": block["thinking"]}})
        else:
            yield event("content_block_start", {"index": index, "content_block": {
                "type": "tool_use", "id": block["id"], "name": block["name"], "input": {}}})
            yield event("content_block_delta", {"index": index, "delta": {
                "type": "input_json_delta", "partial_json": json.dumps(block["input"], ensure_ascii=False)}})
        yield event("content_block_stop", {"index": index})
    yield event("message_delta", {"delta": {"stop_reason": whole["stop_reason"],
                                            "stop_sequence": whole["stop_sequence"]},
                                  "usage": {"output_tokens": whole["usage"]["output_tokens"]}})
    yield event("message_stop", {})
