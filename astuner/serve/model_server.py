"""`astuner serve-model`: a checkpoint served over the OpenAI (Chat Completions, Responses) and Anthropic (Messages)
APIs exactly as its training rollouts saw it, so another harness evaluates it and gets the number `astuner eval`
gets.

    astuner serve-model --conf run.yaml --model launcher_record/run/global_step_20 --port 8000
    # any client: base_url http://127.0.0.1:8000/v1 (Anthropic: http://127.0.0.1:8000), model "policy"

Each request is an episode of one call, served by the rollout's own code: a fresh ModelTuner on the loopback
gateway (model_tuner/frontends/gateway.py) with the run's chat template, tool-call and reasoning parsers, stop
tokens, limits (`rollout.max_model_len`, `max_response_length_in_one_turn`) and sampling filters (`rollout.top_p`,
`top_k`). So a prompt is rendered, a reply parsed into tool calls, and a temperature chosen by the code that made
the training and validation episodes, not by a second copy of it that could drift.

Temperature: a request's `temperature: 0` is greedy (what validation and `astuner eval` run); a positive one is
used; none takes `rollout.temperature`. Requests are checked as the gateway checks an agent's (a malformed body is
a 400 in the API's own shape); `n` must be 1.

Keys: with `--key-env VAR`, a request must carry that variable's value (`Authorization: Bearer` or `x-api-key`),
else it is answered 401; without it any key is taken, and the server listens on 127.0.0.1 only.
"""

from __future__ import annotations

import json
import logging
import secrets
import time

from astuner.model_tuner.frontends.gateway_http import MAX_BODY_BYTES, anthropic_error, openai_error

log = logging.getLogger(__name__)

# A request's deadline (as an episode's): generation past it is aborted and answered 408.
REQUEST_TIMEOUT_S = 600.0


def requested_temperature(body: bytes) -> float | None:
    """The request's `temperature` when it is a number, else None (a malformed body is the gateway's to refuse)."""
    try:
        value = json.loads(body or b"{}").get("temperature")
    except (ValueError, AttributeError):
        return None
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def episode_temperature(requested: float | None, run_temperature: float) -> float:
    """The one-call episode's temperature: 0 (greedy: the gateway then ignores the request's) for a request of 0,
    else the run's (the gateway takes a request's positive temperature over it, model_tuner/completion.py)."""
    return 0.0 if requested is not None and requested <= 0 else run_temperature


class ServedModel:
    """The ASGI app: checks the key, opens a one-call episode per request, hands the request to the gateway's app
    under that episode's key, and closes the episode when the answer (a stream too) has been sent."""

    def __init__(self, runner, run_temperature: float, key: str | None = None) -> None:
        self.runner = runner  # a RolloutRunner: its renderer, parsers, engine, limits and gateway
        self.run_temperature = run_temperature
        self.key = key
        self.served = 0
        # What /v1/models lists and the answers name (any name is taken in a request).
        self.model_name = runner.new_tuner("serve:name", 0.0, 0, 1.0).model_name

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return
        headers = dict(scope.get("headers") or [])
        # bytes: compare_digest refuses a str that is not ASCII, which a client may send
        if self.key is not None and not secrets.compare_digest(_presented(headers).encode(), self.key.encode()):
            anthropic = scope["path"].startswith("/v1/messages")
            response = (anthropic_error(401, "invalid API key", "authentication_error") if anthropic else
                        openai_error(401, "invalid API key", "invalid_api_key", "authentication_error"))
            await response(scope, receive, send)
            return
        body = await _read_body(receive)
        self.served += 1
        tuner = self.runner.new_tuner(f"serve:{self.served}", episode_temperature(
            requested_temperature(body), self.run_temperature), self.served, REQUEST_TIMEOUT_S)
        inner = dict(scope)
        inner["headers"] = [(k, v) for k, v in scope.get("headers") or [] if k not in (b"authorization", b"x-api-key")]
        inner["headers"].append((b"authorization", f"Bearer {tuner.api_key}".encode()))
        sent = False

        async def replay():
            nonlocal sent
            if not sent:
                sent = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # the client's disconnect, which a stream watches for

        try:
            await self.runner.gateway.app(inner, replay, send)
        finally:
            tuner.close()


def _presented(headers: dict) -> str:
    auth = headers.get(b"authorization", b"").decode("latin-1")
    if auth.lower().startswith("bearer "):
        return auth[7:].strip()
    return headers.get(b"x-api-key", b"").decode("latin-1").strip()


async def _read_body(receive) -> bytes:
    """The request's body, read no further than one byte past the gateway's limit (which then answers 413)."""
    chunks, size = [], 0
    while size <= MAX_BODY_BYTES:
        message = await receive()
        if message["type"] == "http.disconnect":
            break
        chunks.append(message.get("body", b""))
        size += len(chunks[-1])
        if not message.get("more_body"):
            break
    return b"".join(chunks)


def build(loaded, spec: str | None):
    """The served model of `loaded`'s config (or the checkpoint `spec`): its engine and the rollout's parts, as
    `astuner eval` builds them for the same model. Returns (ServedModel, path, the engine to shut down)."""
    from astuner.evaluation.runner import load_model
    from astuner.rollout import RolloutRunner, RolloutSettings
    from astuner.runtime import stop_token_ids

    typed = loaded.typed
    path, max_len, tokenizer, engine = load_model(typed, spec, "serve-model")
    runner = RolloutRunner(RolloutSettings.from_config(typed, max_len), engine, tokenizer, None, None,
                           stop_token_ids(path, tokenizer), config=loaded.cfg)
    return ServedModel(runner, typed.astuner.rollout.temperature), path, engine


def serve(app: ServedModel, host: str, port: int, on_ready=None) -> None:
    """Serve `app` with uvicorn until interrupted; `on_ready(base_url)` once it listens."""
    import socket
    import threading

    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="off", access_log=False))
    if on_ready is not None:
        def announce() -> None:
            deadline = time.monotonic() + 30
            while not server.started and time.monotonic() < deadline:
                time.sleep(0.02)
            if server.started:
                on_ready(f"http://{host}:{sock.getsockname()[1]}/v1")
        threading.Thread(target=announce, daemon=True).start()
    server.run(sockets=[sock])
