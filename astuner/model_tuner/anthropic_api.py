"""The Anthropic Messages front end: `POST /v1/messages` beside the OpenAI route, on the same app and keys.

Coding-agent harnesses speak this API. A request is converted to the OpenAI-shaped messages every other front
end uses and goes through the same `ModelTuner._complete`, so it is recorded with exact ids and extends earlier
calls token-exactly like any other. Conversions:
  system (text or text blocks)           -> a system message
  user text blocks                       -> a user message; `tool_result` blocks -> tool messages (in order)
  assistant text / `thinking` / `tool_use` -> content / reasoning_content / tool_calls
  tools [{name, description, input_schema}] -> OpenAI function schemas
  tool_choice auto | any | tool | none   -> "auto" | "required" | a named function | "none" (checked, not
                                            constrained: see chat_format.read_tool_choice)
  max_tokens, temperature, stop_sequences -> the same limits the OpenAI route honours
The answer: `thinking` (when the family's reasoning parser split some out), `text`, then one `tool_use` block per
parsed call; stop_reason tool_use | max_tokens | stop_sequence | end_turn. With `stream: true` the answer comes as
the Messages API's server-sent events (message_start, content_block_start/delta/stop, message_delta,
message_stop). Authentication: `x-api-key` (what the `anthropic` SDK sends) or `Authorization: Bearer`.
"""

from __future__ import annotations

import json
import uuid
from typing import Any


class MessagesRequestError(ValueError):
    """A request the Messages API would refuse (400, invalid_request_error)."""


def _text_of(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    parts = []
    for block in content:
        if isinstance(block, dict) and block.get("type") == "text":
            parts.append(str(block.get("text", "")))
    return "\n".join(parts)


def to_openai_messages(body: dict) -> list[dict]:
    """The request's system prompt and messages as OpenAI chat messages."""
    out: list[dict] = []
    system = _text_of(body.get("system"))
    if system:
        out.append({"role": "system", "content": system})
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise MessagesRequestError("'messages' must be a non-empty list")
    for message in messages:
        role, content = message.get("role"), message.get("content")
        if role not in ("user", "assistant"):
            raise MessagesRequestError(f"message role must be 'user' or 'assistant', got {role!r}")
        blocks = [{"type": "text", "text": content}] if isinstance(content, str) else list(content or [])
        if role == "user":
            texts = []
            for block in blocks:
                if block.get("type") == "tool_result":
                    result = _text_of(block.get("content"))
                    if block.get("is_error"):
                        result = f"Error: {result}"
                    out.append({"role": "tool", "tool_call_id": block.get("tool_use_id"), "content": result})
                elif block.get("type") == "text":
                    texts.append(str(block.get("text", "")))
            if texts:
                out.append({"role": "user", "content": "\n".join(texts)})
            continue
        reply: dict[str, Any] = {"role": "assistant", "content": "\n".join(
            str(b.get("text", "")) for b in blocks if b.get("type") == "text")}
        thinking = [str(b.get("thinking", "")) for b in blocks if b.get("type") == "thinking"]
        if thinking:
            reply["reasoning_content"] = "\n".join(thinking)
        calls = [{"id": b.get("id"), "type": "function",
                  "function": {"name": b.get("name"), "arguments": json.dumps(b.get("input") or {})}}
                 for b in blocks if b.get("type") == "tool_use"]
        if calls:
            reply["tool_calls"] = calls
        out.append(reply)
    return out


def to_openai_tools(body: dict) -> tuple[list[dict] | None, Any]:
    """(OpenAI tool schemas, OpenAI tool_choice) for the request's tools and tool_choice."""
    tools = [{"type": "function", "function": {"name": t.get("name"), "description": t.get("description", ""),
                                               "parameters": t.get("input_schema") or {"type": "object"}}}
             for t in body.get("tools") or []]
    choice = body.get("tool_choice")
    kind = choice.get("type") if isinstance(choice, dict) else choice
    mapped = {None: None, "auto": "auto", "any": "required", "none": "none"}
    if kind == "tool":
        return tools or None, {"type": "function", "function": {"name": choice.get("name")}}
    if kind not in mapped:
        raise MessagesRequestError(f"tool_choice type {kind!r} is not auto, any, tool or none")
    return tools or None, mapped[kind]


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
