"""The Tinker API's sampling routes (`app.py` binds them): sampling sessions and `asample`, whose sequences are
bounded per key (pending, and in the engine at once: `tinker_sampling.EngineShares`) and recorded for the
provenance check (`provenance.py`). Each takes the app first (`app.TinkerApp`)."""

from __future__ import annotations

import logging

import numpy as np

from astuner.serve.futures import Busy, Outcome, RequestError
from astuner.serve.call import Call
from astuner.serve.tinker_sampling import check_request, sample

log = logging.getLogger(__name__)


async def create_sampling_session(app, call: Call) -> dict:
    session = app.service.sessions.get(call.json().get("session_id"), call.tenant)
    sampler_id = f"{session.session_id}:sample:{call.field('sampling_session_seq_id', int)}"
    data = call.json()
    return app.service.create_sampler(sampler_id, data.get("model_path"), data.get("base_model"), call.tenant)


async def sampler(app, call: Call) -> dict:
    sampler_id = call.request.path_params["sampler_id"]
    return app.service.sampler(sampler_id, call.tenant)[1].info(sampler_id)


async def asample(app, call: Call) -> dict:
    data = call.json()
    check_request(data)
    sampler_id = call.field("sampling_session_id")
    app.service.sampler(sampler_id, call.tenant)[1].snapshot_of(sampler_id)
    n = data.get("num_samples", 1)
    held = app.pending.get(call.tenant, 0)
    if held + n > app.limits.pending_samples:
        raise Busy(f"{held} sequences of this key are waiting or being sampled; the limit is "
                   f"{app.limits.pending_samples} (astuner serve --max-pending-samples): send it again later")
    app.pending[call.tenant] = held + n
    rid = app.futures.new(call.tenant)
    ids = [f"{rid}-{i}" for i in range(n)]

    async def run() -> None:
        try:
            async with app.shares.hold(call.tenant, n):
                outcome, prompt, results = await sample(app.service, data, call.tenant)
            record(app, call.tenant, ids, prompt, results)
        except RequestError as exc:
            outcome = Outcome(error=str(exc))
        except Exception as exc:  # noqa: BLE001 - the client gets it, the log the traceback
            log.exception("astuner serve: sample %s failed", rid)
            outcome = Outcome(error=f"{type(exc).__name__}: {exc}", category="server")
        finally:
            app.pending[call.tenant] -= n
        app.futures.resolve(rid, outcome)

    app.spawn(run())
    return {"request_id": rid, "sample_sequence_ids": ids}


def record(app, tenant: str, ids: list[str], prompt: list[int], results) -> None:
    """What was sampled, for the provenance check of the data trained on it later (`provenance.py`)."""
    prompt_ids = np.asarray(prompt, np.int32)
    for sequence_id, result in zip(ids, results):
        app.service.records.add(tenant, sequence_id, prompt_ids, result.token_ids, result.logprobs)
