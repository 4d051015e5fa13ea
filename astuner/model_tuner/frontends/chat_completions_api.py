"""The Chat Completions wire format the gateway answers in: a `chat.completion` object, or with `stream=true` the
server-sent `chat.completion.chunk` events (gateway_openai.py serves them on `POST /v1/chat/completions`)."""

from __future__ import annotations

import json
import time

from astuner.model_tuner.turn import assistant_message


def _message(turn) -> dict:
    message = assistant_message(turn)
    if turn.tool_calls and not message["content"]:
        message["content"] = None  # as the OpenAI API returns it
    return message


def _usage(turn) -> dict:
    p, c = len(turn.call.prompt_ids), len(turn.call.response_ids)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def completion(turn, completion_id: str, model: str) -> dict:
    """The answer of a call without `stream`: one `chat.completion` object."""
    return {
        "id": completion_id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "message": _message(turn), "finish_reason": turn.finish_reason, "logprobs": None}],
        "usage": _usage(turn),
    }


async def stream_chunks(turn, completion_id: str, model: str, usage_chunk: bool):
    """Server-sent events in OpenAI's chunk format. The text is cut at word boundaries; the recorded call keeps
    the engine's exact token ids whatever the chunking."""
    created = int(time.time())

    def chunk(delta: dict, finish: str | None = None, usage: dict | None = None, choices: bool = True) -> str:
        payload = {"id": completion_id, "object": "chat.completion.chunk", "created": created, "model": model,
                   "choices": [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}]
                   if choices else []}
        if usage is not None:
            payload["usage"] = usage
        return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"

    yield chunk({"role": "assistant", "content": ""})
    if turn.reasoning:
        yield chunk({"reasoning_content": turn.reasoning})
    for piece in _pieces(turn.content):
        yield chunk({"content": piece})
    message = _message(turn)
    for i, call in enumerate(message.get("tool_calls") or []):
        yield chunk({"tool_calls": [{"index": i, "id": call["id"], "type": "function",
                                     "function": {"name": call["function"]["name"],
                                                  "arguments": call["function"]["arguments"]}}]})
    yield chunk({}, finish=turn.finish_reason)
    if usage_chunk:
        yield chunk({}, usage=_usage(turn), choices=False)
    yield "data: [DONE]\n\n"


def _pieces(text: str, size: int = 24) -> list[str]:
    out, current = [], ""
    for word in text.split(" "):
        candidate = word if not current else current + " " + word
        if len(candidate) > size and current:
            out.append(current + " ")
            current = word
        else:
            current = candidate
    if current:
        out.append(current)
    return out
