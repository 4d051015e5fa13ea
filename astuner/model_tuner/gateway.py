"""The OpenAI front ends of ModelTuner: an OpenAI-compatible ASGI app, in-process clients and a loopback server.

One Starlette (ASGI) app serves `POST /v1/chat/completions` (with and without `stream=true`), `POST /v1/responses`
(the Responses API: responses_api.py), `POST /v1/messages` and `/v1/messages/count_tokens` (Anthropic's:
anthropic_api.py) and `GET /v1/models`. Every
request carries an episode's key (`Authorization: Bearer <key>`): keys are issued per (episode, agent) and revoked
when the episode ends; an unknown or revoked key gets 401 and nothing is recorded. A request runs the episode's
`ModelTuner._complete` on the episode's event loop, so it is recorded exactly like an AgentScope call.

Three ways in:
  `tuner.get_openai_client()`           `openai.AsyncOpenAI` whose HTTP goes straight into the app in-process
                                        (httpx's ASGI transport on the episode's loop: no socket, no thread)
  `tuner.get_openai_client(sync=True)`  `openai.OpenAI` for code running in a worker thread (asyncio.to_thread);
                                        its requests are handed to the episode's loop. Called on that loop it
                                        would block the loop it waits for, so it raises instead.
  `tuner.get_anthropic_client()`        an `anthropic.AsyncAnthropic` on `/v1/messages`, in-process
                                        (`tuner.anthropic_base_url` for any Anthropic client; anthropic_api.py)
  `tuner.base_url`, `tuner.api_key`     a real HTTP server (uvicorn) on 127.0.0.1, a free port, started on first
                                        use; for agents in other frameworks, other threads or subprocesses.

Request arguments are honoured within the rollout's limits: `temperature` > 0 is used for training rollouts
(validation stays greedy), `max_tokens` / `max_completion_tokens` up to `rollout.max_response_length_in_one_turn`
and the episode's budget, `stop` cuts the response after the token that completes a stop string (OpenAI
semantics: the stop text is not returned), `tool_choice: "none"` hides the tools, and `"required"` or a named
function is checked, not constrained (a call that breaks it is flagged `wrong_toolcall`; a choice naming no
offered tool gets 400). A call cut by the episode's deadline gets 408 (`episode_timeout`), as does one still
generating when its episode ends (`episode_ended`). `n` must be 1.
Sampling filters are the run's (`rollout.top_p` / `rollout.top_k`, applied by the engine and by the trainer
alike); a request's own `top_p` / `top_k` is ignored with a warning, since the trainer must score every call with
the filter it was sampled with. The clients do not retry (`max_retries=0`): a retried call would be a second
sampled call in the record.

Errors come in the API's own shape (OpenAI's `{"error": {...}}`; Anthropic's `{"type": "error", ...}` under
/v1/messages), unknown routes and wrong methods included. A request is type-checked before anything is rendered
(request_checks.py): a malformed body gets 400 and records nothing, as does one the chat template raises on.
Every 4xx carries `x-should-retry: false`, which the openai and anthropic SDKs obey, since the same request
would fail the same way. Either auth header
(`Authorization: Bearer` or `x-api-key`) works on every route. A call whose client hung up before its answer was
delivered (a client-side timeout it will retry, or a stream it closed before the last chunk was sent: `_Delivery`)
is un-recorded (`ModelTuner.discard`): it is never trained.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import socket
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any

from astuner.model_tuner import anthropic_api, responses_api
from astuner.model_tuner.chat_format import TemplateRefused, normalize_tools, read_tool_choice
from astuner.model_tuner.request_checks import read_chat_request, read_json_object
from astuner.model_tuner.turn import (
    CallOptions,
    EpisodeOverflow,
    EpisodeTimeout,
    assistant_message,
)

log = logging.getLogger(__name__)

LOCAL_BASE_URL = "http://astuner.local/v1"  # the in-process clients' base URL (never resolved: ASGI transport)
SERVER_START_TIMEOUT_S = 15.0
CLIENT_TIMEOUT_S = 3600.0  # the episode deadline ends a call long before this


@dataclass
class _Entry:
    tuner: Any  # ModelTuner
    options: CallOptions
    loop: asyncio.AbstractEventLoop | None


class Gateway:
    """Keys -> episodes, the ASGI app, and the lazily started loopback server."""

    def __init__(self) -> None:
        self._entries: dict[str, _Entry] = {}
        self._lock = threading.Lock()
        self._server = None
        self._thread: threading.Thread | None = None
        self._base_url: str | None = None
        self._warned: set[str] = set()
        self.app = build_app(self)

    # --- keys -----------------------------------------------------------------------------------------------
    def register(self, tuner, options) -> str:
        """A key for the tuner's episode. Its calls run on the loop the tuner was built on (the episode's), not
        on whichever thread asked first: a sync agent in a worker thread reads `api_key` where no loop runs."""
        loop = getattr(tuner, "loop", None)
        if loop is None:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:
                loop = None
        key = "ast-" + secrets.token_urlsafe(24)
        with self._lock:
            self._entries[key] = _Entry(tuner, options, loop)
        return key

    def revoke(self, key: str) -> None:
        with self._lock:
            self._entries.pop(key, None)

    def lookup(self, key: str | None) -> _Entry | None:
        with self._lock:
            return self._entries.get(key or "")

    def warn_once(self, what: str, message: str) -> None:
        if what not in self._warned:
            self._warned.add(what)
            log.warning(message)

    # --- clients --------------------------------------------------------------------------------------------
    def client(self, key: str, sync: bool = False):
        import httpx
        import openai

        if not sync:
            http = httpx.AsyncClient(transport=httpx.ASGITransport(app=self.app), base_url=LOCAL_BASE_URL,
                                     timeout=CLIENT_TIMEOUT_S)
            return openai.AsyncOpenAI(api_key=key, base_url=LOCAL_BASE_URL, http_client=http, max_retries=0,
                                      timeout=CLIENT_TIMEOUT_S)
        entry = self.lookup(key)
        http = httpx.Client(transport=_LoopTransport(self.app, entry.loop if entry else None),
                            base_url=LOCAL_BASE_URL, timeout=CLIENT_TIMEOUT_S)
        return openai.OpenAI(api_key=key, base_url=LOCAL_BASE_URL, http_client=http, max_retries=0,
                             timeout=CLIENT_TIMEOUT_S)

    def anthropic_client(self, key: str):
        """An `anthropic.AsyncAnthropic` on the app's Messages route, in-process."""
        import importlib

        import anthropic
        import anthropic._base_client

        # The SDK takes only clients of the HTTP package it is built on: httpx2 from its 2.x releases, else httpx.
        http_lib = importlib.import_module("httpx2" if hasattr(anthropic._base_client, "httpx2") else "httpx")

        root = LOCAL_BASE_URL.removesuffix("/v1")
        http = http_lib.AsyncClient(transport=http_lib.ASGITransport(app=self.app), base_url=root,
                                    timeout=CLIENT_TIMEOUT_S)
        return anthropic.AsyncAnthropic(api_key=key, base_url=root, http_client=http, max_retries=0,
                                        timeout=CLIENT_TIMEOUT_S)

    # --- loopback server ------------------------------------------------------------------------------------
    def base_url(self) -> str:
        with self._lock:
            if self._base_url is None:
                self._base_url = self._start_server()
            return self._base_url

    def _start_server(self) -> str:
        import uvicorn

        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
        config = uvicorn.Config(self.app, log_level="warning", lifespan="off", access_log=False)
        server = uvicorn.Server(config)
        thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="astuner-gateway",
                                  daemon=True)
        thread.start()
        deadline = time.monotonic() + SERVER_START_TIMEOUT_S
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the loopback OpenAI endpoint did not start on 127.0.0.1:{port} within "
                                   f"{SERVER_START_TIMEOUT_S:g}s; see the log above for uvicorn's error")
            time.sleep(0.01)
        self._server, self._thread = server, thread
        log.info("OpenAI-compatible endpoint for agents: http://127.0.0.1:%d/v1", port)
        return f"http://127.0.0.1:{port}/v1"

    def close(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
            self._thread.join(timeout=5)
            self._server = self._thread = None
            self._base_url = None


class _LoopTransport:
    """httpx sync transport that runs each request through the ASGI app on the episode's event loop."""

    def __init__(self, app, loop: asyncio.AbstractEventLoop | None) -> None:
        import httpx

        self._inner = httpx.ASGITransport(app=app)
        self._loop = loop

    def handle_request(self, request):
        import httpx

        loop = self._loop
        if loop is None or loop.is_closed():
            raise RuntimeError("the episode this client belongs to has ended")
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            raise RuntimeError(
                "get_openai_client(sync=True) was called on the episode's event loop, which it would block while "
                "waiting for it. Run the synchronous agent in a worker thread (await asyncio.to_thread(fn, ...)) "
                "or use the async client: get_openai_client()."
            )
        body = request.read()

        async def forward():
            inner = httpx.Request(request.method, request.url, headers=request.headers, content=body)
            response = await self._inner.handle_async_request(inner)
            content = await response.aread()
            return response.status_code, response.headers, content

        status, headers, content = asyncio.run_coroutine_threadsafe(forward(), loop).result()
        return httpx.Response(status, headers=headers, content=content, request=request)

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


# --- the app ----------------------------------------------------------------------------------------------


def build_app(gateway: Gateway):
    """The Starlette app (Starlette is the ASGI toolkit FastAPI is built on; two routes need nothing more)."""
    from starlette.applications import Starlette
    from starlette.exceptions import HTTPException
    from starlette.responses import JSONResponse, StreamingResponse
    from starlette.routing import Route

    def error(status: int, message: str, code: str | None, kind: str = "invalid_request_error",
              param: str | None = None, headers: dict | None = None):
        return JSONResponse({"error": {"message": message, "type": kind, "code": code, "param": param}}, status,
                            headers=_retry_headers(status, headers))

    def refuse(status: int, message: str, kind: str, headers: dict | None = None):
        """An error in the Messages API's shape."""
        return JSONResponse({"type": "error", "error": {"type": kind, "message": message}}, status,
                            headers=_retry_headers(status, headers))

    def authorized(request) -> _Entry | None:
        header = request.headers.get("authorization", "")
        key = header[7:].strip() if header.lower().startswith("bearer ") else None
        return gateway.lookup(key) or gateway.lookup(request.headers.get("x-api-key"))

    async def models(request):
        entry = authorized(request)
        if entry is None:
            return error(401, "invalid or revoked API key", "invalid_api_key", "authentication_error")
        return JSONResponse({"object": "list", "data": [{"id": entry.tuner.model_name, "object": "model",
                                                         "created": 0, "owned_by": "astuner"}]})

    def openai_failure(failure):
        status, message, code, kind = failure
        return error(status, message, code, kind)

    def anthropic_failure(failure):
        status, message, _, kind = failure
        kinds = {"invalid_request_error": "invalid_request_error", "timeout": "timeout_error"}
        return refuse(status, message, kinds.get(kind, "api_error"))

    async def generate(request, entry, messages, tools, options, failed, ignored=None):
        """Warn of the sampling filters the run overrides, generate, and check the client is still there:
        (turn, None), or (None, the response to send: `failed(failure)` or the hang-up's)."""
        for name, value in (ignored or {}).items():
            gateway.warn_once(name, f"gateway: the request's {name}={value} is ignored: every call samples with "
                                    f"the run's astuner.rollout.{name}, which the trainer also applies")
        turn, failure = await _complete(entry, messages, tools, options)
        if failure is not None:
            return None, failed(failure)
        if await request.is_disconnected():
            return None, _hung_up(entry, turn)
        return turn, None

    async def chat_completions(request):
        entry = authorized(request)
        if entry is None:
            return error(401, "invalid or revoked API key", "invalid_api_key", "authentication_error")
        try:
            chat = read_chat_request(read_json_object(await request.body()), entry.options)
            read_tool_choice(normalize_tools(chat.tools), chat.options.tool_choice)  # naming no offered tool
        except ValueError as exc:  # RequestError, and read_tool_choice's
            return error(400, str(exc), "invalid_request", param=getattr(exc, "param", None))
        turn, response = await generate(request, entry, chat.messages, chat.tools, chat.options, openai_failure,
                                        chat.ignored)
        if response is not None:
            return response
        completion_id = f"chatcmpl-{uuid.uuid4().hex[:24]}"
        model = entry.tuner.model_name
        if chat.stream:
            chunks = _stream_chunks(turn, completion_id, model, chat.usage_chunk)
            return _Delivery(entry, turn, StreamingResponse(chunks, media_type="text/event-stream"))
        return _Delivery(entry, turn, JSONResponse(_completion(turn, completion_id, model)))

    async def messages(request):
        """Anthropic's Messages API (anthropic_api.py); its own error shape."""
        entry = authorized(request)
        if entry is None:
            return refuse(401, "invalid or revoked API key", "authentication_error")
        try:
            call = anthropic_api.read_messages_request(read_json_object(await request.body()), entry.options)
        except ValueError as exc:
            return refuse(400, str(exc), "invalid_request_error")
        turn, response = await generate(request, entry, call.chat, call.tools, call.options, anthropic_failure)
        if response is not None:
            return response
        model, tokenizer, stops = entry.tuner.model_name, entry.tuner.tokenizer, call.options.stop
        if call.stream:
            return _Delivery(entry, turn, StreamingResponse(
                anthropic_api.message_events(turn, model, tokenizer, stops), media_type="text/event-stream"))
        return _Delivery(entry, turn, JSONResponse(anthropic_api.message_response(turn, model, tokenizer, stops)))

    async def count_tokens(request):
        """`/v1/messages/count_tokens`: the prompt a call with this body would get, rendered, and counted."""
        entry = authorized(request)
        if entry is None:
            return refuse(401, "invalid or revoked API key", "authentication_error")
        try:
            call = anthropic_api.read_messages_request(read_json_object(await request.body()), entry.options,
                                                       count_only=True)
            count = entry.tuner.prompt_length(call.chat, call.tools, call.options)
        except ValueError as exc:
            return refuse(400, str(exc), "invalid_request_error")
        except Exception as exc:  # noqa: BLE001 - a template that refuses the messages, as for a call
            status, message, _, kind = _failure(exc)
            return refuse(status, message, "invalid_request_error" if status == 400 else "api_error")
        return JSONResponse({"input_tokens": count})

    async def http_error(request, exc: HTTPException):
        """Unknown routes and wrong methods, in the API's own error shape (Starlette's are plain text)."""
        what = f"{request.method} {request.url.path}"
        message = {404: f"no such route: {what}", 405: f"method not allowed: {what}"}.get(exc.status_code,
                                                                                           str(exc.detail))
        if exc.status_code == 405:
            message += f"; use {exc.headers.get('Allow', '')}"
        if request.url.path.startswith("/v1/messages"):
            kind = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
            return refuse(exc.status_code, message, kind, headers=exc.headers)
        return error(exc.status_code, message, {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code),
                     headers=exc.headers)

    async def server_error(request, exc: Exception):
        """A bug of ours, still in the API's shape (Starlette logs the traceback)."""
        message = f"internal error: {type(exc).__name__}: {exc}"
        if request.url.path.startswith("/v1/messages"):
            return refuse(500, message, "api_error")
        return error(500, message, "internal_error", "server_error")

    async def responses(request):
        """OpenAI's Responses API (responses_api.py): the chat route's keys, checks, errors and delivery."""
        entry = authorized(request)
        if entry is None:
            return error(401, "invalid or revoked API key", "invalid_api_key", "authentication_error")
        try:
            call = responses_api.read_responses_request(read_json_object(await request.body()), entry.options,
                                                        _call_origins(entry.tuner))
        except ValueError as exc:  # RequestError, and read_tool_choice's
            return error(400, str(exc), "invalid_request", param=getattr(exc, "param", None))
        turn, response = await generate(request, entry, call.messages, call.tools, call.options, openai_failure,
                                        call.ignored)
        if response is not None:
            return response
        return _Delivery(entry, turn, responses_api.answer(turn, entry.tuner.model_name, call))

    return Starlette(routes=[
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/messages", messages, methods=["POST"]),
        Route("/v1/messages/count_tokens", count_tokens, methods=["POST"]),
        Route("/v1/responses", responses, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
    ], exception_handlers={HTTPException: http_error, Exception: server_error})


async def _complete(entry: _Entry, messages: list[dict], tools, options):
    """(turn, None), or (None, (status, message, code, error type)) for a call that failed."""
    try:
        return await _run_on_episode_loop(entry, entry.tuner._complete(messages, tools, options)), None
    except asyncio.CancelledError:
        # A request whose own task is being cancelled (a client that hung up, an in-process agent cancelled
        # with its episode) stays cancelled. Otherwise the call was cut on the episode's side: the deadline
        # aborted it in the engine, or the episode ended and cancelled what it left running. Either is an
        # answer the client can read, not a server error, and a retry would meet an ended episode.
        current = asyncio.current_task()
        if current is not None and getattr(current, "cancelling", lambda: 0)():
            raise
        if entry.tuner.expired:
            return None, (408, f"{entry.tuner.expired_reason}: the call was cut", "episode_timeout", "timeout")
        return None, (408, "the episode ended while this call was generating (its workflow returned or was "
                           "cancelled): nothing was recorded, and a retry would find the episode over",
                      "episode_ended", "timeout")
    except Exception as exc:  # noqa: BLE001 - every failure becomes an API-shaped error
        return None, _failure(exc)


def _failure(exc: Exception) -> tuple[int, str, str, str]:
    """(status, message, code, error type) for a call that raised."""
    if isinstance(exc, EpisodeOverflow):
        return 400, str(exc), "context_length_exceeded", "invalid_request_error"
    if isinstance(exc, EpisodeTimeout):
        return 408, str(exc), "episode_timeout", "timeout"
    if isinstance(exc, TemplateRefused):  # e.g. a template that requires alternating roles, or a string id
        return 400, str(exc), "invalid_request", "invalid_request_error"
    log.exception("gateway: call failed")
    return 500, f"{type(exc).__name__}: {exc}", "internal_error", "server_error"


def _call_origins(tuner) -> dict[str, int]:
    """Call id -> the index of the recorded call whose answer issued it. The record is the episode's (every key
    of an episode serves one tuner), and ids are unique in it (`call_<index>_<j>`)."""
    return {tool_call["id"]: index for index, call in enumerate(list(tuner.calls))
            for tool_call in (call.reply or {}).get("tool_calls") or []}


def _retry_headers(status: int, headers: dict | None) -> dict:
    """A 4xx would fail the same way again (a bad body, a revoked key, an expired episode): `x-should-retry:
    false` stops the openai and anthropic SDKs from retrying it (they retry 408 and 429 by default)."""
    out = dict(headers or {})
    if 400 <= status < 500:
        out["x-should-retry"] = "false"
    return out


def _discard_on_episode_loop(entry: _Entry, call) -> None:
    loop = entry.loop
    try:
        running = asyncio.get_running_loop()
    except RuntimeError:
        running = None
    if loop is None or loop is running or loop.is_closed():
        entry.tuner.discard(call)
    else:
        loop.call_soon_threadsafe(entry.tuner.discard, call)  # the tuner's state belongs to its loop


def _hung_up(entry: _Entry, turn):
    """The client left while the call generated: nobody will read the answer (a retry may come)."""
    from starlette.responses import Response

    _discard_on_episode_loop(entry, turn.call)
    return Response(status_code=499)  # nginx's "client closed request"; no client is left to read it


class _Delivery:
    """An ASGI response that un-records its call unless its last byte was handed to the server before the client
    was seen to leave. A send that fails says so, but uvicorn drops sends to a client that left without an error
    and tells of it only as `http.disconnect` on receive: a watcher listens for it while the answer goes out, and
    each chunk yields to the loop so the watcher runs between chunks (else a stream is written in one go, blind).
    A disconnect seen after the last chunk was sent is a client closing a delivered answer: the call stays."""

    def __init__(self, entry: _Entry, turn, response) -> None:
        self.entry, self.turn, self.response = entry, turn, response

    async def __call__(self, scope, receive, send) -> None:
        from starlette.requests import ClientDisconnect

        left = asyncio.Event()
        delivered = False

        async def watch() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass  # the body was read by the route: nothing else is expected but the disconnect
            left.set()

        async def tracked(message) -> None:
            nonlocal delivered
            if left.is_set():
                raise ClientDisconnect()  # stop streaming to nobody
            await send(message)
            if message["type"] != "http.response.body":
                return
            if not message.get("more_body", False):
                delivered = True
            else:
                await asyncio.sleep(0)  # the watcher's turn: a departure is seen before the next chunk

        watcher = asyncio.ensure_future(watch())
        try:
            await self.response(scope, receive, tracked)
        except (ClientDisconnect, OSError):
            pass  # the client is gone: there is nobody to answer, and nothing went wrong here
        finally:
            watcher.cancel()
            if not delivered:
                _discard_on_episode_loop(self.entry, self.turn.call)


async def _run_on_episode_loop(entry: _Entry, coro):
    loop = entry.loop
    running = asyncio.get_running_loop()
    if loop is None or loop is running:
        return await coro
    if loop.is_closed():
        coro.close()
        raise RuntimeError("the episode this key belongs to has ended")
    return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, loop))


def _message(turn) -> dict:
    message = assistant_message(turn)
    if turn.tool_calls and not message["content"]:
        message["content"] = None  # as the OpenAI API returns it
    return message


def _usage(turn) -> dict:
    p, c = len(turn.call.prompt_ids), len(turn.call.response_ids)
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}


def _completion(turn, completion_id: str, model: str) -> dict:
    return {
        "id": completion_id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "message": _message(turn), "finish_reason": turn.finish_reason, "logprobs": None}],
        "usage": _usage(turn),
    }


async def _stream_chunks(turn, completion_id: str, model: str, usage_chunk: bool):
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
