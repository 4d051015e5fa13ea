"""The Tinker API's training routes (`app.py` binds them): creating training clients, forward / forward_backward,
optim_step, saving and loading states. Every request that carries a seq_id goes through the training queue
(`futures.TrainingQueue`): run in its client's order, bounded while it waits. Each takes the app first
(`app.TinkerApp`: its service, queue and limits)."""

from __future__ import annotations

import asyncio

from astuner.http_body import HttpError
from astuner.serve.call import Call
from astuner.serve.tinker_service import check_optimizer
from astuner.serve.wire_proto import peek_sequence, read_forward_backward


async def create_model(app, call: Call) -> dict:
    data = call.json()
    model_id = app.service.new_model_id(data.get("session_id"), call.field("model_seq_id", int), call.tenant)
    app.service.check_creation(data.get("base_model"), data.get("lora_config"), data.get("optimizer_config"))
    app.queue.open(model_id, call.tenant)
    rid = app.queue.run_now(call.tenant, lambda: app.service.create_model(
        model_id, data.get("base_model"), data.get("lora_config"), call.tenant, data.get("optimizer_config")))
    return {"request_id": rid, "model_id": model_id}


async def get_info(app, call: Call) -> dict:
    return app.service.info(call.field("model_id"), call.tenant)


def admit(app, call: Call, prefix: bytes) -> None:
    """A forward_backward's place in its client's order, read from its first bytes: one too far ahead, or one
    the client's waiting bytes cannot take (its Content-Length), is a 429 before its upload is read."""
    place = peek_sequence(prefix)
    size = call.request.headers.get("content-length", "0")
    if place is not None and size.isdigit() and place[0] in app.service.models:
        app.service.model(place[0], call.tenant)
        app.queue.check_room(place[0], place[1], int(size))


async def forward_backward(app, call: Call) -> dict:
    # a large body is parsed off the event loop: every other request (polls, heartbeats) goes on meanwhile
    fb = read_forward_backward(call.body) if len(call.body) < 1 << 20 else \
        await asyncio.to_thread(read_forward_backward, call.body)
    app.service.model(fb.model_id, call.tenant)
    return sequenced(app, call, fb.model_id, fb.seq_id, lambda: app.service.forward_backward(fb, call.tenant))


def sequenced(app, call: Call, model_id: str, seq_id: int, job) -> dict:
    return {"request_id": app.queue.submit(model_id, seq_id, job, len(call.body)), "model_id": model_id}


def training(app, call: Call) -> tuple[dict, str, int]:
    model_id, seq_id = call.field("model_id"), call.field("seq_id", int)
    app.service.model(model_id, call.tenant)
    return call.json(), model_id, seq_id


async def optim_step(app, call: Call) -> dict:
    data, model_id, seq_id = training(app, call)
    if "adam_params" not in data:
        kind = (data.get("optimizer_params") or {}).get("type") if isinstance(data.get("optimizer_params"),
                                                                              dict) else None
        raise HttpError(400, f"optim_step: astuner serve steps AdamW only (adam_params); "
                             f"{f'{kind} is' if kind else 'other optimizers are'} refused")
    return sequenced(app, call, model_id, seq_id,
                           lambda: app.service.optim_step(model_id, data["adam_params"], call.tenant))


async def save_weights(app, call: Call) -> dict:
    data, model_id, seq_id = training(app, call)
    name = call.field("path")
    return sequenced(app, call, model_id, seq_id, lambda: app.service.save_state(model_id, name, call.tenant))


async def save_weights_for_sampler(app, call: Call) -> dict:
    data, model_id, seq_id = training(app, call)
    name, sampler_id = data.get("path"), None
    if name is None:  # save_weights_and_get_sampling_client: an ephemeral sampler of these weights
        session = model_id.split(":")[0]
        sampler_id = f"{session}:sample:{call.field('sampling_session_seq_id', int)}"
    return sequenced(app, call, model_id, seq_id,
                           lambda: app.service.save_for_sampler(model_id, name, sampler_id, call.tenant))


async def load_weights(app, call: Call) -> dict:
    data = call.json()
    path, optimizer = call.field("path"), bool(data.get("optimizer", False))
    if data.get("session_id") is not None and data.get("seq_id") is None:  # from a state: a creation
        model_id = app.service.new_model_id(data["session_id"], call.field("model_seq_id", int), call.tenant)
        check_optimizer(data.get("optimizer_config"))
        app.service.saved.file_of(path, "weights", call.tenant)  # 404 now for a path not the tenant's
        app.queue.open(model_id, call.tenant)
        rid = app.queue.run_now(call.tenant, lambda: app.service.load_state(model_id, path, optimizer,
                                                                              call.tenant, create=True))
        return {"request_id": rid, "model_id": model_id}
    data, model_id, seq_id = training(app, call)
    app.service.saved.file_of(path, "weights", call.tenant)
    return sequenced(app, call, model_id, seq_id,
                           lambda: app.service.load_state(model_id, path, optimizer, call.tenant))
