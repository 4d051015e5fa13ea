"""The gateway's OpenAI routes: `POST /v1/chat/completions` (chat_completions_api.py), `POST /v1/responses`
(responses_api.py) and `GET /v1/models`. Each takes the gateway first (gateway.build_app binds it), answers in
OpenAI's error shape, and hands a generated call to `Delivery`, which un-records it if nobody receives it."""

from __future__ import annotations

import uuid

from astuner.model_tuner.frontends import chat_completions_api, responses_api
from astuner.model_tuner.chat_format import normalize_tools, read_tool_choice
from astuner.model_tuner.frontends.gateway_calls import Delivery
from astuner.model_tuner.frontends.gateway_http import (HttpError, authorized, body_of, generate, openai_error,
                                                        openai_failure, refused_key, too_large)
from astuner.model_tuner.request_checks import read_chat_request, read_json_object


async def models(gateway, request):
    """`GET /v1/models`: the episode's one model."""
    from starlette.responses import JSONResponse

    entry = authorized(gateway, request)
    if entry is None:
        return refused_key(gateway, request)
    return JSONResponse({"object": "list", "data": [{"id": entry.tuner.model_name, "object": "model",
                                                     "created": 0, "owned_by": "astuner"}]})


async def chat_completions(gateway, request):
    """`POST /v1/chat/completions`, streamed (`stream=true`) or not."""
    from starlette.responses import JSONResponse, StreamingResponse

    entry = authorized(gateway, request)
    if entry is None:
        return refused_key(gateway, request)
    try:
        chat = read_chat_request(read_json_object(await body_of(request)), entry.options)
        read_tool_choice(normalize_tools(chat.tools), chat.options.tool_choice)  # naming no offered tool
    except HttpError as exc:
        return too_large(exc)
    except ValueError as exc:  # RequestError, and read_tool_choice's
        return openai_error(400, str(exc), "invalid_request", param=getattr(exc, "param", None))
    turn, response = await generate(gateway, request, entry, chat.messages, chat.tools, chat.options,
                                    openai_failure, chat.ignored)
    if response is not None:
        return response
    completion_id = f"chatcmpl-{uuid.uuid4().hex[:24]}"
    model = entry.tuner.model_name
    if chat.stream:
        chunks = chat_completions_api.stream_chunks(turn, completion_id, model, chat.usage_chunk)
        return Delivery(entry, turn, StreamingResponse(chunks, media_type="text/event-stream"))
    return Delivery(entry, turn, JSONResponse(chat_completions_api.completion(turn, completion_id, model)))


async def responses(gateway, request):
    """OpenAI's Responses API (responses_api.py): the chat route's keys, checks, errors and delivery."""
    entry = authorized(gateway, request)
    if entry is None:
        return refused_key(gateway, request)
    try:
        call = responses_api.read_responses_request(read_json_object(await body_of(request)), entry.options,
                                                    call_origins(entry.tuner))
    except HttpError as exc:
        return too_large(exc)
    except ValueError as exc:  # RequestError, and read_tool_choice's
        return openai_error(400, str(exc), "invalid_request", param=getattr(exc, "param", None))
    turn, response = await generate(gateway, request, entry, call.messages, call.tools, call.options,
                                    openai_failure, call.ignored)
    if response is not None:
        return response
    return Delivery(entry, turn, responses_api.answer(turn, entry.tuner.model_name, call))


def call_origins(tuner) -> dict[str, int]:
    """Call id -> the index of the recorded call whose answer issued it. The record is the episode's (every key
    of an episode serves one tuner), and ids are unique in it (`call_<index>_<j>`)."""
    return {tool_call["id"]: index for index, call in enumerate(list(tuner.calls))
            for tool_call in (call.reply or {}).get("tool_calls") or []}

