"""The OpenAI front ends of ModelTuner: an OpenAI-compatible ASGI app, in-process clients and a loopback server.

One Starlette (ASGI) app serves `POST /v1/chat/completions` (with and without `stream=true`), `POST /v1/responses`
(the Responses API: responses_api.py), `POST /v1/messages` and `/v1/messages/count_tokens` (Anthropic's:
anthropic_api.py) and `GET /v1/models`. Every
request carries an episode's key (`Authorization: Bearer <key>`): keys are issued per (episode, agent) and revoked
when the episode ends; an unknown key gets 401, the key of an episode that ended 408 (`episode_ended`), and nothing is
recorded. A request runs the episode's
`ModelTuner.complete` on the episode's event loop, so it is recorded exactly like an AgentScope call.

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
delivered (a client-side timeout it will retry, or a stream it closed before the last chunk was sent:
`gateway_calls.Delivery`) is un-recorded (`ModelTuner.discard`): it is never trained.

Where the parts live: this module holds the keys, the clients, the loopback server and the app's route table;
gateway_openai.py and gateway_anthropic.py the routes of each API, gateway_http.py what they share (error shapes,
the key check, the generate step), gateway_calls.py the call run on its episode and its delivery, and
chat_completions_api.py the Chat Completions wire format.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import secrets
import socket
import threading
import time
from collections import OrderedDict

from astuner.model_tuner.frontends import gateway_anthropic, gateway_http, gateway_openai
from astuner.model_tuner.frontends.gateway_calls import Entry

log = logging.getLogger(__name__)

LOCAL_BASE_URL = "http://astuner.local/v1"  # the in-process clients' base URL (never resolved: ASGI transport)
SERVER_START_TIMEOUT_S = 15.0
CLIENT_TIMEOUT_S = 3600.0  # the episode deadline ends a call long before this
ENDED_KEYS_REMEMBERED = 4096


class Gateway:
    """Keys -> episodes, the ASGI app, and the lazily started loopback server."""

    def __init__(self) -> None:
        self._entries: dict[str, Entry] = {}
        self._ended: OrderedDict[str, str] = OrderedDict()  # keys of ended episodes -> the episode, for the message
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
            self._entries[key] = Entry(tuner, options, loop)
        return key

    def revoke(self, key: str) -> None:
        with self._lock:
            entry = self._entries.pop(key, None)
            if entry is not None:
                self._ended[key] = getattr(entry.tuner, "episode_uid", "") or "its episode"
                while len(self._ended) > ENDED_KEYS_REMEMBERED:
                    self._ended.popitem(last=False)

    def ended(self, key: str | None) -> str | None:
        """The episode a revoked key belonged to (None for a key never issued, or long forgotten)."""
        with self._lock:
            return self._ended.get(key or "")

    def lookup(self, key: str | None) -> Entry | None:
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
    """The Starlette app (Starlette is the ASGI toolkit FastAPI is built on; two routes need nothing more). Each
    API's routes live in their own module (gateway_openai.py, gateway_anthropic.py) and get the gateway first."""
    from starlette.applications import Starlette
    from starlette.exceptions import HTTPException
    from starlette.routing import Route

    def route(path: str, handler, method: str = "POST") -> Route:
        return Route(path, functools.partial(handler, gateway), methods=[method])

    return Starlette(routes=[
        route("/v1/chat/completions", gateway_openai.chat_completions),
        route("/v1/messages", gateway_anthropic.messages),
        route("/v1/messages/count_tokens", gateway_anthropic.count_tokens),
        route("/v1/responses", gateway_openai.responses),
        route("/v1/models", gateway_openai.models, "GET"),
    ], exception_handlers={HTTPException: gateway_http.http_error, Exception: gateway_http.server_error})
