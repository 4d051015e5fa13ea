"""The OpenAI front ends of ModelTuner: an OpenAI-compatible ASGI app, in-process clients and a loopback server.

One Starlette (ASGI) app serves `POST /v1/chat/completions` (with and without `stream=true`) and `GET /v1/models`. Every
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
offered tool gets 400). A call cut by the episode's deadline gets 408 (`episode_timeout`). `n` must be 1.
Sampling filters are the run's (`rollout.top_p` / `rollout.top_k`, applied by the engine and by the trainer
alike); a request's own `top_p` / `top_k` is ignored with a warning, since the trainer must score every call with
the filter it was sampled with. The clients do not retry (`max_retries=0`): a retried call would be a second
sampled call in the record.
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

from astuner.model_tuner import anthropic_api
from astuner.model_tuner.chat_format import normalize_tools, read_tool_choice
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
    from starlette.responses import JSONResponse, StreamingResponse
    from starlette.routing import Route

    def error(status: int, message: str, code: str, kind: str = "invalid_request_error"):
        return JSONResponse({"error": {"message": message, "type": kind, "code": code, "param": None}}, status)

    def authorized(request) -> _Entry | None:
        header = request.headers.get("authorization", "")
        key = header[7:].strip() if header.lower().startswith("bearer ") else None
        return gateway.lookup(key)

    async def models(request):
        entry = authorized(request)
        if entry is None:
            return error(401, "invalid or revoked API key", "invalid_api_key", "authentication_error")
        return JSONResponse({"object": "list", "data": [{"id": entry.tuner.model_name, "object": "model",
                                                         "created": 0, "owned_by": "astuner"}]})

    async def chat_completions(request):
        entry = authorized(request)
        if entry is None:
            return error(401, "invalid or revoked API key", "invalid_api_key", "authentication_error")
        try:
            body = await request.json()
        except json.JSONDecodeError as exc:
            return error(400, f"request body is not JSON: {exc}", "invalid_json")
        try:
            messages, tools, options, stream, usage_chunk = _read_request(body, entry, gateway)
        except ValueError as exc:
            return error(400, str(exc), "invalid_request")
        turn, failure = await _complete(entry, messages, tools, options)
        if failure is not None:
            status, message, code, kind = failure
            return error(status, message, code, kind)
        completion_id = f"chatcmpl-{uuid.uuid4().hex[:24]}"
        model = entry.tuner.model_name
        if stream:
            chunks = _stream_chunks(turn, completion_id, model, usage_chunk)
            return StreamingResponse(chunks, media_type="text/event-stream")
        return JSONResponse(_completion(turn, completion_id, model))

    async def messages(request):
        """Anthropic's Messages API (anthropic_api.py); its own error shape."""
        def refuse(status: int, message: str, kind: str):
            return JSONResponse({"type": "error", "error": {"type": kind, "message": message}}, status)

        entry = gateway.lookup(request.headers.get("x-api-key")) or authorized(request)
        if entry is None:
            return refuse(401, "invalid or revoked API key", "authentication_error")
        try:
            body = await request.json()
            if not isinstance(body, dict):
                raise anthropic_api.MessagesRequestError("request body must be a JSON object")
            chat = anthropic_api.to_openai_messages(body)
            tools, choice = anthropic_api.to_openai_tools(body)
            read_tool_choice(normalize_tools(tools), choice)
        except (ValueError, AttributeError) as exc:  # JSONDecodeError is a ValueError
            return refuse(400, str(exc), "invalid_request_error")
        stops = tuple(str(s) for s in body.get("stop_sequences") or ())
        temperature, max_tokens = body.get("temperature"), body.get("max_tokens")
        options = CallOptions(
            agent=entry.options.agent, trainable=entry.options.trainable,
            temperature=float(temperature) if isinstance(temperature, (int, float)) else None,
            max_tokens=int(max_tokens) if isinstance(max_tokens, int) and max_tokens > 0 else None,
            stop=stops, tool_choice=choice)
        turn, failure = await _complete(entry, chat, tools, options)
        if failure is not None:
            status, message, _, kind = failure
            kinds = {"invalid_request_error": "invalid_request_error", "timeout": "timeout_error"}
            return refuse(status, message, kinds.get(kind, "api_error"))
        model, tokenizer = entry.tuner.model_name, entry.tuner.tokenizer
        if body.get("stream"):
            return StreamingResponse(anthropic_api.message_events(turn, model, tokenizer, stops),
                                     media_type="text/event-stream")
        return JSONResponse(anthropic_api.message_response(turn, model, tokenizer, stops))

    return Starlette(routes=[
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/messages", messages, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
    ])


async def _complete(entry: _Entry, messages: list[dict], tools, options):
    """(turn, None), or (None, (status, message, code, error type)) for a call that failed."""
    try:
        return await _run_on_episode_loop(entry, entry.tuner._complete(messages, tools, options)), None
    except asyncio.CancelledError:
        # The episode's deadline aborted the call in the engine: a timeout, not a server error. A request
        # whose own task is being cancelled (a client that hung up, the episode cancelled) stays cancelled.
        current = asyncio.current_task()
        if not entry.tuner.expired or (current is not None and getattr(current, "cancelling", lambda: 0)()):
            raise
        return None, (408, f"{entry.tuner.expired_reason}: the call was cut", "episode_timeout", "timeout")
    except Exception as exc:  # noqa: BLE001 - every failure becomes an API-shaped error
        if isinstance(exc, EpisodeOverflow):
            return None, (400, str(exc), "context_length_exceeded", "invalid_request_error")
        if isinstance(exc, EpisodeTimeout):
            return None, (408, str(exc), "episode_timeout", "timeout")
        log.exception("gateway: call failed")
        return None, (500, f"{type(exc).__name__}: {exc}", "internal_error", "server_error")


async def _run_on_episode_loop(entry: _Entry, coro):
    loop = entry.loop
    running = asyncio.get_running_loop()
    if loop is None or loop is running:
        return await coro
    if loop.is_closed():
        coro.close()
        raise RuntimeError("the episode this key belongs to has ended")
    return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, loop))


def _read_request(body: Any, entry: _Entry, gateway: Gateway):
    if not isinstance(body, dict):
        raise ValueError("request body must be a JSON object")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
        raise ValueError("'messages' must be a non-empty list of message objects")
    if body.get("n", 1) != 1:
        raise ValueError("only n=1 is supported: each sampled call is one recorded training sample")
    tools = body.get("tools") or None
    read_tool_choice(normalize_tools(tools), body.get("tool_choice"))  # a choice naming no offered tool: 400
    for name in ("top_p", "top_k"):
        value = body.get(name)
        if value is not None and not (name == "top_p" and value == 1):
            gateway.warn_once(name, f"gateway: the request's {name}={value} is ignored: every call samples with "
                                    f"the run's astuner.rollout.{name}, which the trainer also applies")
    fmt = body.get("response_format")
    if isinstance(fmt, dict) and fmt.get("type") not in (None, "text"):
        raise ValueError(f"response_format {fmt.get('type')!r} is not supported (no constrained decoding); "
                         "ask for JSON in the prompt or use tools")
    stop = body.get("stop") or ()
    stop = (stop,) if isinstance(stop, str) else tuple(str(s) for s in stop)
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    temperature = body.get("temperature")
    base = entry.options
    options = CallOptions(
        agent=base.agent,
        trainable=base.trainable,
        temperature=float(temperature) if isinstance(temperature, (int, float)) else None,
        max_tokens=int(max_tokens) if isinstance(max_tokens, int) and max_tokens > 0 else None,
        stop=stop,
        tool_choice=body.get("tool_choice"),
    )
    stream = bool(body.get("stream"))
    usage_chunk = bool((body.get("stream_options") or {}).get("include_usage"))
    return messages, tools, options, stream, usage_chunk


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
