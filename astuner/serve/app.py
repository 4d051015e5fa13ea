"""The HTTP side of `astuner serve`: the Tinker API's endpoints (`/api/v1/...`) on Starlette.

Every request carries its key in `X-API-Key` (the SDK's header) and acts as that key's tenant (`sessions.py`): with
keys created (`astuner serve-key`), only those are accepted (401 otherwise, also once every key is revoked); without
any, the server listens on loopback only and takes any key as its one tenant. Direct failures answer
`{"detail": message}` with a 4xx (404 for what is not the tenant's, 429 for a bound reached for now, 413 for a body
over its limit); a failed future answers the API's `{"error": message, "category": "user" | "server"}` to its poll.

A training request that carries a `seq_id` and is refused here (a body that cannot be read, an optimizer not
served, a revoked key) still takes its turn in its client's order (`TrainingQueue.refuse`), since the SDK moves on
past a failed request. A silent session expires (`sessions.py`): checked every few seconds on the server's loop.
"""

from __future__ import annotations

import asyncio
import logging
from functools import partial
from typing import Callable

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from astuner.heap import release_freed_memory
from astuner.http_body import HttpError, read_body
from astuner.serve import app_sampling, app_training
from astuner.serve.call import Call, json_sequence
from astuner.serve.futures import Futures, Outcome, RequestError, TrainingQueue
from astuner.serve.sessions import LOCAL, Session, tenant_label, tenant_of_key
from astuner.serve.tinker_sampling import EngineShares
from astuner.serve.wire_proto import ProtoError, peek_sequence

log = logging.getLogger(__name__)
POLL_WAIT_S = 20.0  # a poll is held this long before "try_again" (the SDK times out at 45 s)
PROTO = "application/x-protobuf"


def _proto_sequence(call: Call) -> tuple[str, int] | None:
    return peek_sequence(call.body)


class TinkerApp:
    def __init__(self, service, keys, poll_wait_s: float = POLL_WAIT_S):
        self.service, self.keys, self.poll_wait_s = service, keys, poll_wait_s
        self.limits = service.limits
        self.futures: Futures | None = None
        self.queue: TrainingQueue | None = None
        self._tasks: set[asyncio.Task] = set()
        self.pending: dict[str, int] = {}  # tenant -> sequences it has waiting or being sampled
        self.shares = EngineShares(self.limits.engine_share)
        train, sampling = app_training, app_sampling
        post = {
            "client/config": self.client_config, "client/dynamic_config": self.empty,
            "create_session": self.create_session, "session_heartbeat": self.heartbeat, "telemetry": self.telemetry,
            "create_model": partial(train.create_model, self), "get_info": partial(train.get_info, self),
            "create_sampling_session": partial(sampling.create_sampling_session, self),
            "asample": partial(sampling.asample, self), "retrieve_future": self.retrieve_future,
        }
        sequenced = {name: partial(getattr(train, name), self)
                     for name in ("optim_step", "save_weights", "save_weights_for_sampler", "load_weights")}
        self.app = Starlette(routes=[
            *(Route(f"/api/v1/{path}", self._endpoint(fn), methods=["POST"]) for path, fn in post.items()),
            *(Route(f"/api/v1/{path}", self._endpoint(fn, json_sequence), methods=["POST"])
              for path, fn in sequenced.items()),
            Route("/api/v1/forward_backward", self._endpoint(partial(train.forward_backward, self), _proto_sequence,
                                                               self.limits.proto_body_bytes,
                                                               partial(train.admit, self)), methods=["POST"]),
            Route("/api/v1/get_server_capabilities", self._endpoint(self.capabilities), methods=["GET"]),
            Route("/api/v1/healthz", self._endpoint(self.empty), methods=["GET"]),
            Route("/api/v1/samplers/{sampler_id:path}", self._endpoint(partial(sampling.sampler, self)),
                  methods=["GET"]),
            Route("/api/v1/sessions/{session_id}/finish", self._endpoint(self.finish), methods=["POST"]),
            Route("/{path:path}", self._endpoint(self.unknown), methods=["GET", "POST", "PUT", "DELETE"]),
        ])

    def close(self) -> None:
        """After the server stopped: the training thread finishes the request it runs, the rest are dropped."""
        if self.queue is not None:
            self.queue.shutdown()

    def _start(self) -> None:
        """On the server's event loop, at its first request: the futures, the training queue, the expiry check."""
        if self.futures is None:
            self.futures = Futures(asyncio.get_running_loop())
            self.queue = TrainingQueue(self.futures, self.limits.seq_window, self.limits.held_mib << 20)
            self.spawn(self._expire_silent_sessions())

    def spawn(self, coro) -> None:
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _endpoint(self, fn, sequence: Callable[[Call], tuple[str, int] | None] | None = None,
                  limit: int | None = None, admit=None):
        """`admit(call, prefix)`: a check of the body's first bytes before the rest is read (a request that would
        wait too far ahead is refused before it costs its upload)."""
        limit = limit or self.limits.json_body_bytes

        async def handle(request: Request) -> Response:
            self._start()
            call = None
            try:
                call = Call(request, self._authorize(request), b"")
                if request.method == "POST":
                    call.body = await self._read(request, limit, admit and (lambda prefix: admit(call, prefix)))
                out = await fn(call)
            except (HttpError, RequestError, ProtoError) as exc:
                status = getattr(exc, "status", 400)
                if sequence is not None and status not in (413, 429):  # 429: the SDK sends it again
                    await self._take_turn(request, call, sequence, limit, str(exc))
                return JSONResponse({"detail": str(exc)}, status_code=status)
            if isinstance(out, Response):
                return out
            return JSONResponse(out)

        return handle

    async def _read(self, request: Request, limit: int, admit=None) -> bytes:
        compressed = request.headers.get("content-encoding", "identity") != "identity"
        body = await read_body(request, limit, None if compressed else admit)
        if not compressed:
            return body
        if request.headers.get("content-encoding") != "zstd":
            raise HttpError(415, f"content-encoding {request.headers.get('content-encoding')!r}: send the body "
                                 f"uncompressed or as zstd")
        try:
            import zstandard
        except ImportError:
            raise HttpError(415, "a zstd body needs the zstandard package on the server (pip install "
                                 "zstandard); or send it uncompressed") from None
        try:
            with zstandard.ZstdDecompressor().stream_reader(body) as reader:
                out = reader.read(limit + 1)
        except zstandard.ZstdError as exc:
            raise HttpError(400, f"the zstd body does not decompress ({exc})") from None
        if len(out) > limit:
            raise HttpError(413, f"the decompressed body is over the limit of {limit} bytes")
        return out

    async def _take_turn(self, request: Request, call: Call | None, sequence, limit: int, message: str) -> None:
        """A refused request that names its place in a training client's order takes it, as a failed request; a
        revoked key's too (the server knew it), so its client's later requests are not held back by it."""
        if call is None:  # refused at the key: only a key this server accepted before may move its client on
            name = self.keys.revoked(request.headers.get("x-api-key"))
            if name is None:
                return
            try:
                call = Call(request, tenant_of_key(name), await self._read(request, limit))
            except HttpError:
                return
        elif not call.body and request.method == "POST":
            return
        place = sequence(call)
        if place is not None:
            self.queue.refuse(place[0], place[1], message, call.tenant)

    def _authorize(self, request: Request) -> str:
        """The request's tenant."""
        if self.keys.open_access():
            return LOCAL  # loopback, no keys
        key = request.headers.get("x-api-key")
        name = self.keys.owner(key)
        if name is not None:
            return tenant_of_key(name)
        revoked = self.keys.revoked(key)
        if revoked is not None:
            raise HttpError(401, f"the key {revoked!r} was revoked; ask for a new one (astuner serve-key create NAME)")
        if not self.keys.any():
            raise HttpError(401, "this server takes no key: every key was revoked (astuner serve-key create NAME "
                                 "makes one)")
        raise HttpError(401, "a valid astuner serve key is needed in X-API-Key (astuner serve-key create NAME)")

    # --- session ------------------------------------------------------------------------------------------------

    async def client_config(self, call: Call) -> dict:
        return {"pjwt_auth_enabled": False, "proto_compress_fwdbwd": False, "sample_use_retrieve_futures": False,
                "custom_loss_server_side": False}

    async def empty(self, call: Call) -> dict:
        return {}

    async def create_session(self, call: Call) -> dict:
        call.json()
        return {"type": "create_session", "session_id": self.service.create_session(call.tenant)}

    async def heartbeat(self, call: Call) -> dict:
        self.service.sessions.get(call.json().get("session_id"), call.tenant)
        return {"type": "session_heartbeat"}

    async def telemetry(self, call: Call) -> dict:
        return {"status": "accepted"}

    async def capabilities(self, call: Call) -> dict:
        return self.service.capabilities()

    async def finish(self, call: Call) -> dict:
        session = self.service.sessions.get(call.request.path_params["session_id"], call.tenant, touch=False)
        for model_id in self.service.close_session(session.session_id):
            self.queue.close(model_id)
        release_freed_memory()  # its trainers' memory leaves with them
        return {}

    async def unknown(self, call: Call) -> dict:
        raise HttpError(404, f"astuner serve has no endpoint {call.request.method} {call.request.url.path}")

    async def _expire_silent_sessions(self) -> None:
        period = min(10.0, max(0.2, self.limits.session_timeout_s / 4))
        while True:
            await asyncio.sleep(period)
            for session in self.service.sessions.silent():
                self.expire(session)

    def expire(self, session: Session) -> None:
        """A silent session: it ends now (its requests hear 410); its training clients are saved as at shutdown,
        after the requests already running, then freed."""
        timeout = self.limits.session_timeout_s
        models = self.service.session_models(session.session_id)
        why = f"expired after {timeout:g} s without a heartbeat"
        self.service.sessions.end(session.session_id, f"{why}; its training clients are being saved")
        for model_id in models:
            self.queue.close(model_id, f"was closed: its session {why}")

        def save_and_free() -> Outcome:
            paths = self.service.save_clients("at_expiry", models)
            self.service.close_session(session.session_id, why + (f"; saved {', '.join(paths)} (load them with "
                                       f"create_training_client_from_state_with_optimizer)" if paths else ""))
            log.warning("astuner serve: session %s of %s %s; %s", session.session_id, tenant_label(session.tenant),
                        why, f"saved {', '.join(paths)}" if paths else "it held no training client")
            release_freed_memory()
            return Outcome(json={})

        self.queue.run_now(session.tenant, save_and_free)


    async def retrieve_future(self, call: Call) -> Response:
        rid = call.field("request_id")
        if not self.futures.known(rid, call.tenant):
            raise HttpError(404, f"no request {rid!r} on this server (results are kept for the last 4096 requests; a "
                            f"restarted server holds none of an earlier one's)")
        outcome = await self.futures.retrieve(rid, self.poll_wait_s)
        if outcome is None:
            return JSONResponse({"type": "try_again", "request_id": rid, "queue_state": "active"})
        body = outcome.body()
        if isinstance(body, bytes):
            return Response(body, media_type=PROTO)
        return JSONResponse(body)
