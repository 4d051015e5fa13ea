"""What every route of the gateway shares: the two APIs' error shapes, the key check, the one step that
generates a call for a request, and the app's handlers for unknown routes and for our own bugs."""

from __future__ import annotations

from typing import TYPE_CHECKING

from astuner.model_tuner.frontends.gateway_calls import Entry, complete, hung_up
from astuner.http_body import HttpError, read_body

MAX_BODY_BYTES = 16 << 20  # far over any chat request of a model's context; a network client may send anything

if TYPE_CHECKING:
    from starlette.exceptions import HTTPException


def openai_error(status: int, message: str, code: str | None, kind: str = "invalid_request_error",
                 param: str | None = None, headers: dict | None = None):
    """An error in OpenAI's shape (`{"error": {...}}`)."""
    from starlette.responses import JSONResponse

    return JSONResponse({"error": {"message": message, "type": kind, "code": code, "param": param}}, status,
                        headers=retry_headers(status, headers))


def anthropic_error(status: int, message: str, kind: str, headers: dict | None = None):
    """An error in the Messages API's shape."""
    from starlette.responses import JSONResponse

    return JSONResponse({"type": "error", "error": {"type": kind, "message": message}}, status,
                        headers=retry_headers(status, headers))


def retry_headers(status: int, headers: dict | None) -> dict:
    """A 4xx would fail the same way again (a bad body, a revoked key, an expired episode): `x-should-retry:
    false` stops the openai and anthropic SDKs from retrying it (they retry 408 and 429 by default)."""
    out = dict(headers or {})
    if 400 <= status < 500:
        out["x-should-retry"] = "false"
    return out


def openai_failure(failure):
    """A failed call (gateway_calls.failure's tuple) as an OpenAI error."""
    status, message, code, kind = failure
    return openai_error(status, message, code, kind)


def anthropic_failure(failure):
    """A failed call (gateway_calls.failure's tuple) as a Messages API error."""
    status, message, _, kind = failure
    kinds = {"invalid_request_error": "invalid_request_error", "timeout": "timeout_error"}
    return anthropic_error(status, message, kinds.get(kind, "api_error"))


def _keys(request) -> tuple[str | None, str | None]:
    header = request.headers.get("authorization", "")
    return header[7:].strip() if header.lower().startswith("bearer ") else None, request.headers.get("x-api-key")


def authorized(gateway, request) -> Entry | None:
    """The entry of the request's key, from either auth header (`Authorization: Bearer` or `x-api-key`)."""
    bearer, api_key = _keys(request)
    return gateway.lookup(bearer) or gateway.lookup(api_key)


def refused_key(gateway, request, anthropic: bool = False):
    """The answer to a request without a live key: 408 `episode_ended` for the key of an episode that ended (its
    calls are over, not its credentials wrong), 401 otherwise."""
    episode = next(filter(None, map(gateway.ended, _keys(request))), None)
    if episode is not None:
        message = f"episode {episode} has ended: its key takes no more calls (nothing is recorded)"
        return anthropic_error(408, message, "timeout_error") if anthropic else \
            openai_error(408, message, "episode_ended", "timeout")
    if anthropic:
        return anthropic_error(401, "invalid API key", "authentication_error")
    return openai_error(401, "invalid API key", "invalid_api_key", "authentication_error")


async def body_of(request) -> bytes:
    """The request's body within MAX_BODY_BYTES (a 413 `HttpError` as soon as it is over)."""
    return await read_body(request, MAX_BODY_BYTES)


def too_large(exc: HttpError, anthropic: bool = False):
    """A body over the limit, in the API's shape."""
    if anthropic:
        return anthropic_error(413, str(exc), "request_too_large")
    return openai_error(413, str(exc), "request_too_large")


async def generate(gateway, request, entry, messages, tools, options, failed, ignored=None):
    """Warn of the sampling filters the run overrides, generate, and check the client is still there:
    (turn, None), or (None, the response to send: `failed(failure)` or the hang-up's)."""
    for name, value in (ignored or {}).items():
        gateway.warn_once(name, f"gateway: the request's {name}={value} is ignored: every call samples with "
                                f"the run's astuner.rollout.{name}, which the trainer also applies")
    turn, failure = await complete(entry, messages, tools, options)
    if failure is not None:
        return None, failed(failure)
    if await request.is_disconnected():
        return None, hung_up(entry, turn)
    return turn, None


def speaks_anthropic(request) -> bool:
    """A request of the Messages API: its route, or Anthropic's own header (which every Anthropic client sends)."""
    return request.url.path.startswith("/v1/messages") or "anthropic-version" in request.headers


async def http_error(request, exc: HTTPException):
    """Unknown routes and wrong methods, in the API's own error shape (Starlette's are plain text)."""
    what = f"{request.method} {request.url.path}"
    message = {404: f"no such route: {what}", 405: f"method not allowed: {what}"}.get(exc.status_code,
                                                                                       str(exc.detail))
    if exc.status_code == 405:
        message += f"; use {exc.headers.get('Allow', '')}"
    if speaks_anthropic(request):
        kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return anthropic_error(exc.status_code, message, kind, headers=exc.headers)
    return openai_error(exc.status_code, message, {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code),
                        headers=exc.headers)


async def server_error(request, exc: Exception):
    """A bug of ours, still in the API's shape (Starlette logs the traceback)."""
    message = f"internal error: {type(exc).__name__}: {exc}"
    if speaks_anthropic(request):
        return anthropic_error(500, message, "api_error")
    return openai_error(500, message, "internal_error", "server_error")
