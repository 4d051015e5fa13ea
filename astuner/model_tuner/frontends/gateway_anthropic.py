"""The gateway's Anthropic routes (anthropic_api.py): `POST /v1/messages` and `POST /v1/messages/count_tokens`.
Each takes the gateway first (gateway.build_app binds it) and answers in the Messages API's error shape."""

from __future__ import annotations

from astuner.model_tuner.frontends import anthropic_api
from astuner.model_tuner.frontends.gateway_calls import Delivery, failure
from astuner.model_tuner.frontends.gateway_http import (HttpError, anthropic_error, anthropic_failure, authorized,
                                                        body_of, generate, refused_key, too_large)
from astuner.model_tuner.request_checks import read_json_object


async def messages(gateway, request):
    """Anthropic's Messages API (anthropic_api.py); its own error shape."""
    from starlette.responses import JSONResponse, StreamingResponse

    entry = authorized(gateway, request)
    if entry is None:
        return refused_key(gateway, request, anthropic=True)
    try:
        call = anthropic_api.read_messages_request(read_json_object(await body_of(request)), entry.options)
    except HttpError as exc:
        return too_large(exc, anthropic=True)
    except ValueError as exc:
        return anthropic_error(400, str(exc), "invalid_request_error")
    turn, response = await generate(gateway, request, entry, call.chat, call.tools, call.options, anthropic_failure)
    if response is not None:
        return response
    model, tokenizer, stops = entry.tuner.model_name, entry.tuner.tokenizer, call.options.stop
    if call.stream:
        return Delivery(entry, turn, StreamingResponse(
            anthropic_api.message_events(turn, model, tokenizer, stops), media_type="text/event-stream"))
    return Delivery(entry, turn, JSONResponse(anthropic_api.message_response(turn, model, tokenizer, stops)))


async def count_tokens(gateway, request):
    """`/v1/messages/count_tokens`: the prompt a call with this body would get, rendered, and counted."""
    from starlette.responses import JSONResponse

    entry = authorized(gateway, request)
    if entry is None:
        return refused_key(gateway, request, anthropic=True)
    try:
        call = anthropic_api.read_messages_request(read_json_object(await body_of(request)), entry.options,
                                                   count_only=True)
        count = entry.tuner.prompt_length(call.chat, call.tools, call.options)
    except HttpError as exc:
        return too_large(exc, anthropic=True)
    except ValueError as exc:
        return anthropic_error(400, str(exc), "invalid_request_error")
    except Exception as exc:  # noqa: BLE001 - a template that refuses the messages, as for a call
        status, message, _, kind = failure(exc)
        return anthropic_error(status, message, "invalid_request_error" if status == 400 else "api_error")
    return JSONResponse({"input_tokens": count})
