"""Futures as the Tinker API has them: a request answers at once with an id, its result is fetched by long poll.

Every future belongs to the tenant that made it (`tenants.py`); another tenant polling its id hears 404, as for an
id that never existed. Ids are random (`req-` and 16 random bytes), so none can be guessed from another.

Training requests of one model run in their `seq_id` order, one at a time, on the one training thread: the SDK
numbers them 1, 2, 3... per training client and may send a later one first (the chunks of a large
`forward_backward` go out in parallel, the first chunk last). A request sent twice (a retry) gets the id of the
first. The thread serves the tenants in turn, one request each (`FairWorker`): a tenant with many requests ready
does not hold the others' behind them. A request refused before it could run (a bad body, an optimizer not served, a revoked key) still takes its
turn (`refuse`): the SDK moves past a failed request, so its seq_id must not hold back the ones after it.

What one model may hold while it waits for an earlier seq_id is bounded: a request more than `seq_window` ahead of
the next to run, or one whose body would take the model's waiting bytes over `held_bytes`, is answered 429 (the
SDK retries it) and holds nothing; the next request to run is always taken. Sampling requests are not ordered;
they run on the event loop.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import threading
from collections import OrderedDict, deque
from dataclasses import dataclass
from typing import Callable

from astuner.heap import release_freed_memory

log = logging.getLogger(__name__)
RETRIES_REMEMBERED = 4096


class RequestError(ValueError):
    """A request astuner cannot serve as sent: the client gets the message (category user, HTTP 400 if direct)."""

    status = 400


class NotFound(RequestError):
    """Nothing of that id for this tenant: it never existed, it is gone, or another tenant owns it (HTTP 404)."""

    status = 404


class Busy(RequestError):
    """A bound is reached for now (HTTP 429): the SDK backs off and sends the request again."""

    status = 429


class Gone(RequestError):
    """The session ended (HTTP 410): the SDK's heartbeat stops on it."""

    status = 410


def new_id(prefix: str) -> str:
    return f"{prefix}{secrets.token_hex(16)}"


@dataclass
class Outcome:
    """A finished request: a JSON object, protobuf bytes, or a failure in the API's words."""

    json: dict | None = None
    proto: bytes | None = None
    error: str | None = None
    category: str = "user"  # user: the request is at fault; server: astuner is

    def body(self) -> dict | bytes:
        if self.error is not None:
            return {"error": self.error, "category": self.category}
        return self.proto if self.proto is not None else (self.json or {})


class Futures:
    """request_id -> the outcome, awaited by `retrieve` (on the server's event loop); each with its tenant."""

    def __init__(self, loop: asyncio.AbstractEventLoop, keep: int = 4096):
        self.loop = loop
        self._futures: dict[str, tuple[str, asyncio.Future]] = {}
        self._keep = keep  # finished outcomes kept for late or repeated polls, oldest dropped first

    def new(self, tenant: str) -> str:
        """A pending request's id (called on the event loop, or under the training queue's lock)."""
        request_id = new_id("req-")
        self._futures[request_id] = (tenant, self.loop.create_future())
        if len(self._futures) > self._keep:
            done = [k for k, (_, f) in self._futures.items() if f.done()]
            for old in done[: len(self._futures) - self._keep]:
                del self._futures[old]
        return request_id

    def resolve(self, request_id: str, outcome: Outcome) -> None:
        """Set the outcome; from any thread."""
        def set_() -> None:
            held = self._futures.get(request_id)
            if held is not None and not held[1].done():
                held[1].set_result(outcome)

        self.loop.call_soon_threadsafe(set_)

    def known(self, request_id: str, tenant: str) -> bool:
        held = self._futures.get(request_id)
        return held is not None and held[0] == tenant

    async def retrieve(self, request_id: str, wait_s: float) -> Outcome | None:
        """The outcome, or None if it is not there within `wait_s` (the client polls again)."""
        future = self._futures[request_id][1]
        try:
            return await asyncio.wait_for(asyncio.shield(future), wait_s)
        except asyncio.TimeoutError:
            return None


@dataclass
class _Waiting:
    request_id: str
    job: Callable[[], Outcome]
    size: int  # bytes of the request's body, held until it has run


LARGE_REQUEST = 8 << 20  # after a request this large, the heap it freed goes back to the system


class FairWorker:
    """One thread that runs jobs, taking the tenants in turn (round robin), each tenant's jobs in their order."""

    def __init__(self, name: str = "astuner-serve-train"):
        self._ready: OrderedDict[str, deque] = OrderedDict()  # tenant -> its jobs; the next tenant first
        self._cond = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._work, name=name, daemon=True)
        self._thread.start()

    def submit(self, tenant: str, fn: Callable, *args) -> None:
        with self._cond:
            if self._closed:
                return
            self._ready.setdefault(tenant, deque()).append((fn, args))
            self._cond.notify()

    def _work(self) -> None:
        while True:
            with self._cond:
                while not self._ready and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                tenant, jobs = next(iter(self._ready.items()))
                fn, args = jobs.popleft()
                del self._ready[tenant]
                if jobs:  # the tenant's next job waits for every other tenant's turn
                    self._ready[tenant] = jobs
            fn(*args)

    def shutdown(self) -> None:
        """Finish the job running; drop the rest."""
        with self._cond:
            self._closed = True
            self._ready.clear()
            self._cond.notify_all()
        self._thread.join(timeout=600)


class TrainingQueue:
    """Runs each model's requests in seq_id order on one thread (the trainers share the machine), the tenants in
    turn."""

    def __init__(self, futures: Futures, seq_window: int = 64, held_bytes: int = 256 << 20):
        self.futures = futures
        self.seq_window, self.held_bytes = seq_window, held_bytes
        self._worker = FairWorker()
        self._lock = threading.Lock()
        self._next: dict[str, int] = {}  # model_id -> the seq_id it runs next
        self._owner: dict[str, str] = {}  # model_id -> its tenant (the futures of its requests are theirs)
        self._waiting: dict[str, dict[int, _Waiting]] = {}
        self._held: dict[str, int] = {}  # model_id -> bytes of its requests not yet run
        self._seen: dict[tuple[str, int], str] = {}  # (model_id, seq_id) -> request_id, for repeated requests

    def open(self, model_id: str, tenant: str, first_seq: int = 1) -> None:
        """Start ordering a model's requests (a repeated creation keeps the order it has)."""
        with self._lock:
            if model_id not in self._next:
                self._next[model_id], self._owner[model_id] = first_seq, tenant
                self._waiting[model_id], self._held[model_id] = {}, 0

    def close(self, model_id: str, why: str = "was closed") -> None:
        with self._lock:
            self._next.pop(model_id, None)
            self._owner.pop(model_id, None)
            self._held.pop(model_id, None)
            for waiting in self._waiting.pop(model_id, {}).values():  # never to run: their polls hear it
                self.futures.resolve(waiting.request_id, Outcome(error=f"training client {model_id} {why}"))
            for seen in [k for k in self._seen if k[0] == model_id]:
                del self._seen[seen]

    def held(self, model_id: str | None = None) -> int:
        """Bytes of requests waiting for their turn (one model's, or every model's)."""
        with self._lock:
            return self._held.get(model_id, 0) if model_id else sum(self._held.values())

    def submit(self, model_id: str, seq_id: int, job: Callable[[], Outcome], size: int = 0) -> str:
        """The request's id; the job runs once every earlier seq_id of the model has run."""
        with self._lock:
            if (model_id, seq_id) in self._seen:
                return self._seen[(model_id, seq_id)]
            if model_id not in self._next:
                raise NotFound(f"no training client {model_id!r} on this server (closed, or made by a server that "
                               f"has since restarted)")
            self._check_room(model_id, seq_id, size)
            nxt = self._next[model_id]
            request_id = self.futures.new(self._owner[model_id])
            self._remember(model_id, seq_id, request_id)
            if seq_id < nxt:
                self.futures.resolve(request_id, Outcome(error=f"seq_id {seq_id} of {model_id} is older than the "
                                                         f"requests already run ({nxt} next)"))
                return request_id
            self._waiting[model_id][seq_id] = _Waiting(request_id, job, size)
            self._held[model_id] += size
            self._dispatch(model_id)
        return request_id

    def check_room(self, model_id: str, seq_id: int, size: int) -> None:
        """A 429 (`Busy`) for a request that could not wait for its turn now; nothing for a repeat or the next."""
        with self._lock:
            if model_id in self._next and (model_id, seq_id) not in self._seen:
                self._check_room(model_id, seq_id, size)

    def _check_room(self, model_id: str, seq_id: int, size: int) -> None:
        nxt = self._next[model_id]
        if seq_id <= nxt:  # the next runs at once (or an old one fails at once): always taken
            return
        if seq_id - nxt > self.seq_window:
            raise Busy(f"seq_id {seq_id} is {seq_id - nxt} ahead of the request {model_id} runs next ({nxt}); this "
                       f"server holds at most {self.seq_window} ahead: send it again later")
        if self._held[model_id] + size > self.held_bytes:
            raise Busy(f"training client {model_id} already holds {self._held[model_id] >> 20} MiB of requests "
                       f"waiting for seq_id {nxt} (the limit is {self.held_bytes >> 20} MiB): send it again later")

    def refuse(self, model_id: str, seq_id: int, message: str, tenant: str) -> None:
        """A request of the tenant's own client refused before it could be queued takes its turn as a failed
        request (nobody polls it: the client had its answer), so the requests after it run."""
        def fail() -> Outcome:
            return Outcome(error=message)

        with self._lock:
            if self._owner.get(model_id) != tenant or (model_id, seq_id) in self._seen \
                    or seq_id < self._next[model_id] or seq_id - self._next[model_id] > self.seq_window:
                return
        try:
            self.submit(model_id, seq_id, fail)
        except RequestError:
            pass

    def run_now(self, tenant: str, job: Callable[[], Outcome]) -> str:
        """A request outside any model's order (creating a model), on the training thread in the tenant's turn."""
        request_id = self.futures.new(tenant)
        self._worker.submit(tenant, self._run, request_id, job)
        return request_id

    def _remember(self, model_id: str, seq_id: int, request_id: str) -> None:
        self._seen[(model_id, seq_id)] = request_id
        if len(self._seen) > 2 * RETRIES_REMEMBERED:  # a retry comes within seconds: old ids can go
            for old in list(self._seen)[:RETRIES_REMEMBERED]:
                del self._seen[old]

    def _dispatch(self, model_id: str) -> None:
        waiting = self._waiting[model_id]
        while self._next[model_id] in waiting:
            item = waiting.pop(self._next[model_id])
            self._next[model_id] += 1
            self._worker.submit(self._owner[model_id], self._run, item.request_id, item.job, model_id, item.size)

    def _run(self, request_id: str, job: Callable[[], Outcome], model_id: str | None = None, size: int = 0) -> None:
        try:
            outcome = job()
        except RequestError as exc:
            outcome = Outcome(error=str(exc))
        except Exception as exc:  # noqa: BLE001 - the client gets it as a failed request, the log the traceback
            log.exception("astuner serve: request %s failed", request_id)
            outcome = Outcome(error=f"{type(exc).__name__}: {exc}", category="server")
        finally:
            if size:
                with self._lock:
                    if model_id in self._held:
                        self._held[model_id] -= size
        self.futures.resolve(request_id, outcome)
        if size >= LARGE_REQUEST:
            release_freed_memory()

    def shutdown(self) -> None:
        self._worker.shutdown()
