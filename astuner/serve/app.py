"""The HTTP side of `astuner serve`: the Tinker API's endpoints (`/api/v1/...`) on Starlette.

Every request carries its key in `X-API-Key` (the SDK's header). With keys created (`astuner serve-key`), only
those are accepted (401 otherwise); without any, the server listens on loopback only and takes any key.
Direct failures answer `{"detail": message}` with a 4xx; a failed future answers the API's
`{"error": message, "category": "user" | "server"}` to its poll. Bodies over the limits get a 413.
"""

from __future__ import annotations

import asyncio
import logging

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from astuner.serve.futures import Futures, Outcome, RequestError, TrainingQueue
from astuner.serve.http_body import HttpError, read_body, read_json
from astuner.serve.tinker_sampling import check_request, sample
from astuner.serve.wire_proto import ProtoError, read_forward_backward

log = logging.getLogger(__name__)
MAX_JSON_BYTES = 8 << 20
MAX_PROTO_BYTES = 256 << 20  # a forward_backward chunk: the SDK sends at most ~5 MB each
POLL_WAIT_S = 20.0  # a poll is held this long before "try_again" (the SDK times out at 45 s)
PROTO = "application/x-protobuf"


class TinkerApp:
    def __init__(self, service, keys, poll_wait_s: float = POLL_WAIT_S):
        self.service, self.keys, self.poll_wait_s = service, keys, poll_wait_s
        self.futures: Futures | None = None
        self.queue: TrainingQueue | None = None
        self._tasks: set[asyncio.Task] = set()
        self._samples = 0
        routes = {
            "client/config": self.client_config, "client/dynamic_config": self.empty,
            "create_session": self.create_session, "session_heartbeat": self.heartbeat, "telemetry": self.telemetry,
            "create_model": self.create_model, "get_info": self.get_info, "forward_backward": self.forward_backward,
            "optim_step": self.optim_step, "save_weights": self.save_weights,
            "save_weights_for_sampler": self.save_weights_for_sampler, "load_weights": self.load_weights,
            "create_sampling_session": self.create_sampling_session, "asample": self.asample,
            "retrieve_future": self.retrieve_future,
        }
        self.app = Starlette(routes=[
            *(Route(f"/api/v1/{path}", self._endpoint(fn), methods=["POST"]) for path, fn in routes.items()),
            Route("/api/v1/get_server_capabilities", self._endpoint(self.capabilities), methods=["GET"]),
            Route("/api/v1/healthz", self._endpoint(self.empty), methods=["GET"]),
            Route("/api/v1/samplers/{sampler_id:path}", self._endpoint(self.sampler), methods=["GET"]),
            Route("/api/v1/sessions/{session_id}/finish", self._endpoint(self.finish), methods=["POST"]),
            Route("/{path:path}", self._endpoint(self.unknown), methods=["GET", "POST", "PUT", "DELETE"]),
        ])

    def close(self) -> None:
        """After the server stopped: the training thread finishes the request it runs, the rest are dropped."""
        if self.queue is not None:
            self.queue.shutdown()

    def _endpoint(self, fn):
        async def handle(request: Request) -> Response:
            if self.futures is None:  # on the server's event loop, at its first request
                self.futures = Futures(asyncio.get_running_loop())
                self.queue = TrainingQueue(self.futures)
            try:
                self._authorize(request)
                out = await fn(request)
            except HttpError as exc:
                return JSONResponse({"detail": str(exc)}, status_code=exc.status)
            except (RequestError, ProtoError) as exc:
                return JSONResponse({"detail": str(exc)}, status_code=400)
            if isinstance(out, Response):
                return out
            return JSONResponse(out)

        return handle

    def _authorize(self, request: Request) -> None:
        if self.keys.open_access():
            return  # loopback, no keys
        if self.keys.owner(request.headers.get("x-api-key")) is None:
            raise HttpError(401, "a valid astuner serve key is needed in X-API-Key (astuner serve-key create NAME)")

    async def _body(self, request: Request, limit: int = MAX_JSON_BYTES) -> bytes:
        return await read_body(request, limit)

    async def _json(self, request: Request) -> dict:
        return await read_json(request, MAX_JSON_BYTES)

    @staticmethod
    def _field(data: dict, key: str, kind: type = str):
        value = data.get(key)
        if not isinstance(value, kind) or isinstance(value, bool) and kind is int:
            raise HttpError(400, f"{key}: a {kind.__name__} is required")
        return value

    # --- session ------------------------------------------------------------------------------------------------

    async def client_config(self, request: Request) -> dict:
        await self._json(request)
        return {"pjwt_auth_enabled": False, "proto_compress_fwdbwd": False, "sample_use_retrieve_futures": False,
                "custom_loss_server_side": False}

    async def empty(self, request: Request) -> dict:
        return {}

    async def create_session(self, request: Request) -> dict:
        await self._json(request)
        return {"type": "create_session", "session_id": self.service.create_session()}

    async def heartbeat(self, request: Request) -> dict:
        await self._json(request)
        return {"type": "session_heartbeat"}

    async def telemetry(self, request: Request) -> dict:
        await self._body(request)
        return {"status": "accepted"}

    async def capabilities(self, request: Request) -> dict:
        return self.service.capabilities()

    async def finish(self, request: Request) -> dict:
        await self._json(request)
        for model_id in self.service.close_session(request.path_params["session_id"]):
            self.queue.close(model_id)
        return {}

    async def unknown(self, request: Request) -> dict:
        raise HttpError(404, f"astuner serve has no endpoint {request.method} {request.url.path}")

    # --- training -------------------------------------------------------------------------------------------------

    async def create_model(self, request: Request) -> dict:
        data = await self._json(request)
        model_id = f"{self._field(data, 'session_id')}:train:{self._field(data, 'model_seq_id', int)}"
        self.service.check_base_model(data.get("base_model"))
        self.queue.open(model_id)
        rid = self.queue.run_now(lambda: self.service.create_model(model_id, data.get("base_model"),
                                                                   data.get("lora_config")))
        return {"request_id": rid, "model_id": model_id}

    async def get_info(self, request: Request) -> dict:
        return self.service.info(self._field(await self._json(request), "model_id"))

    async def forward_backward(self, request: Request) -> dict:
        body = await self._body(request, MAX_PROTO_BYTES)
        if request.headers.get("content-encoding") == "zstd":
            raise HttpError(415, "zstd bodies are not read here (the server's client config does not ask for them)")
        fb = read_forward_backward(body)
        self.service.model(fb.model_id)
        return self._sequenced(fb.model_id, fb.seq_id, lambda: self.service.forward_backward(fb))

    def _sequenced(self, model_id: str, seq_id: int, job) -> dict:
        return {"request_id": self.queue.submit(model_id, seq_id, job), "model_id": model_id}

    async def _training(self, request: Request) -> tuple[dict, str, int]:
        data = await self._json(request)
        model_id, seq_id = self._field(data, "model_id"), self._field(data, "seq_id", int)
        self.service.model(model_id)
        return data, model_id, seq_id

    async def optim_step(self, request: Request) -> dict:
        data, model_id, seq_id = await self._training(request)
        if "adam_params" not in data:
            raise HttpError(400, "optim_step: astuner serve steps AdamW only (adam_params); other optimizers are "
                                 "refused")
        return self._sequenced(model_id, seq_id, lambda: self.service.optim_step(model_id, data["adam_params"]))

    async def save_weights(self, request: Request) -> dict:
        data, model_id, seq_id = await self._training(request)
        name = self._field(data, "path")
        return self._sequenced(model_id, seq_id, lambda: self.service.save_state(model_id, name))

    async def save_weights_for_sampler(self, request: Request) -> dict:
        data, model_id, seq_id = await self._training(request)
        name, sampler_id = data.get("path"), None
        if name is None:  # save_weights_and_get_sampling_client: an ephemeral sampler of these weights
            session = model_id.split(":")[0]
            sampler_id = f"{session}:sample:{self._field(data, 'sampling_session_seq_id', int)}"
        return self._sequenced(model_id, seq_id, lambda: self.service.save_for_sampler(model_id, name, sampler_id))

    async def load_weights(self, request: Request) -> dict:
        data = await self._json(request)
        path, optimizer = self._field(data, "path"), bool(data.get("optimizer", False))
        if "session_id" in data:  # create_training_client_from_state: the model's creation
            model_id = f"{self._field(data, 'session_id')}:train:{self._field(data, 'model_seq_id', int)}"
            self.queue.open(model_id)
            rid = self.queue.run_now(lambda: self.service.load_state(model_id, path, optimizer, create=True))
            return {"request_id": rid, "model_id": model_id}
        model_id, seq_id = self._field(data, "model_id"), self._field(data, "seq_id", int)
        self.service.model(model_id)
        return self._sequenced(model_id, seq_id, lambda: self.service.load_state(model_id, path, optimizer))

    # --- sampling -------------------------------------------------------------------------------------------------

    async def create_sampling_session(self, request: Request) -> dict:
        data = await self._json(request)
        sampler_id = f"{self._field(data, 'session_id')}:sample:{self._field(data, 'sampling_session_seq_id', int)}"
        return self.service.create_sampler(sampler_id, data.get("model_path"), data.get("base_model"))

    async def sampler(self, request: Request) -> dict:
        try:
            sampler_id = request.path_params["sampler_id"]
            return self.service.sampler(sampler_id)[1].info(sampler_id)
        except RequestError as exc:
            raise HttpError(404, str(exc)) from None

    async def asample(self, request: Request) -> dict:
        data = await self._json(request)
        check_request(data)
        sampler_id = self._field(data, "sampling_session_id")
        self.service.sampler(sampler_id)[1].snapshot_of(sampler_id)
        rid = self.futures.new()
        n = data.get("num_samples", 1)
        ids = [f"{rid}-{i}" for i in range(n)]

        async def run() -> None:
            try:
                outcome = await sample(self.service, data)
            except RequestError as exc:
                outcome = Outcome(error=str(exc))
            except Exception as exc:  # noqa: BLE001 - the client gets it, the log the traceback
                log.exception("astuner serve: sample %s failed", rid)
                outcome = Outcome(error=f"{type(exc).__name__}: {exc}", category="server")
            self.futures.resolve(rid, outcome)

        task = asyncio.create_task(run())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return {"request_id": rid, "sample_sequence_ids": ids}

    async def retrieve_future(self, request: Request) -> Response:
        rid = self._field(await self._json(request), "request_id")
        if not self.futures.known(rid):
            raise HttpError(404, f"no request {rid!r} on this server (results are kept for the last 4096 requests; a "
                            f"restarted server holds none of an earlier one's)")
        outcome = await self.futures.retrieve(rid, self.poll_wait_s)
        if outcome is None:
            return JSONResponse({"type": "try_again", "request_id": rid, "queue_state": "active"})
        body = outcome.body()
        if isinstance(body, bytes):
            return Response(body, media_type=PROTO)
        return JSONResponse(body)
