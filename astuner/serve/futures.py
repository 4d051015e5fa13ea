"""Futures as the Tinker API has them: a request answers at once with an id, its result is fetched by long poll.

Training requests of one model run in their `seq_id` order, one at a time, on the one training thread: the SDK
numbers them 1, 2, 3... per training client and may send a later one first (the chunks of a large
`forward_backward` go out in parallel, the first chunk last). A request sent twice (a retry) gets the id of the
first. Sampling requests are not ordered; they run on the event loop.
"""

from __future__ import annotations

import asyncio
import itertools
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable


RETRIES_REMEMBERED = 4096


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
    """request_id -> the outcome, awaited by `retrieve` (on the server's event loop)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, keep: int = 4096):
        self.loop = loop
        self._ids = itertools.count(1)
        self._futures: dict[str, asyncio.Future] = {}
        self._keep = keep  # finished outcomes kept for late or repeated polls, oldest dropped first

    def new(self) -> str:
        """A pending request's id (called on the event loop)."""
        request_id = f"req-{next(self._ids)}"
        self._futures[request_id] = self.loop.create_future()
        if len(self._futures) > self._keep:
            for old in [k for k, f in self._futures.items() if f.done()][: len(self._futures) - self._keep]:
                del self._futures[old]
        return request_id

    def resolve(self, request_id: str, outcome: Outcome) -> None:
        """Set the outcome; from any thread."""
        def set_() -> None:
            future = self._futures.get(request_id)
            if future is not None and not future.done():
                future.set_result(outcome)

        self.loop.call_soon_threadsafe(set_)

    def known(self, request_id: str) -> bool:
        return request_id in self._futures

    async def retrieve(self, request_id: str, wait_s: float) -> Outcome | None:
        """The outcome, or None if it is not there within `wait_s` (the client polls again)."""
        future = self._futures[request_id]
        try:
            return await asyncio.wait_for(asyncio.shield(future), wait_s)
        except asyncio.TimeoutError:
            return None


class TrainingQueue:
    """Runs each model's requests in seq_id order on one thread (the trainers share the machine)."""

    def __init__(self, futures: Futures):
        self.futures = futures
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="astuner-serve-train")
        self._lock = threading.Lock()
        self._next: dict[str, int] = {}  # model_id -> the seq_id it runs next
        self._waiting: dict[str, dict[int, tuple[str, Callable[[], Outcome]]]] = {}
        self._seen: dict[tuple[str, int], str] = {}  # (model_id, seq_id) -> request_id, for repeated requests

    def open(self, model_id: str, first_seq: int = 1) -> None:
        """Start ordering a model's requests (a repeated creation keeps the order it has)."""
        with self._lock:
            if model_id not in self._next:
                self._next[model_id] = first_seq
                self._waiting[model_id] = {}

    def close(self, model_id: str) -> None:
        with self._lock:
            self._next.pop(model_id, None)
            for request_id, _ in self._waiting.pop(model_id, {}).values():  # never to run: their polls hear it
                self.futures.resolve(request_id, Outcome(error=f"training client {model_id} was closed"))
            for seen in [k for k in self._seen if k[0] == model_id]:
                del self._seen[seen]

    def submit(self, model_id: str, seq_id: int, job: Callable[[], Outcome]) -> str:
        """The request's id; the job runs once every earlier seq_id of the model has run."""
        with self._lock:
            if (model_id, seq_id) in self._seen:
                return self._seen[(model_id, seq_id)]
            if model_id not in self._next:
                raise RequestError(f"no training client {model_id!r} on this server (closed, or made by a server "
                                   f"that has since restarted)")
            request_id = self.futures.new()
            self._seen[(model_id, seq_id)] = request_id
            if seq_id < self._next.get(model_id, 0):
                self.futures.resolve(request_id, Outcome(error=f"seq_id {seq_id} of {model_id} is older than the "
                                                         f"requests already run ({self._next[model_id]} next)"))
                return request_id
            self._waiting[model_id][seq_id] = (request_id, job)
            self._dispatch(model_id)
            if len(self._seen) > 2 * RETRIES_REMEMBERED:  # a retry comes within seconds: old ids can go
                for old in list(self._seen)[:RETRIES_REMEMBERED]:
                    del self._seen[old]
        return request_id

    def run_now(self, job: Callable[[], Outcome]) -> str:
        """A request outside any model's order (creating a model), on the training thread."""
        request_id = self.futures.new()
        self._pool.submit(self._run, request_id, job)
        return request_id

    def _dispatch(self, model_id: str) -> None:
        waiting = self._waiting[model_id]
        while self._next[model_id] in waiting:
            request_id, job = waiting.pop(self._next[model_id])
            self._next[model_id] += 1
            self._pool.submit(self._run, request_id, job)

    def _run(self, request_id: str, job: Callable[[], Outcome]) -> None:
        try:
            outcome = job()
        except RequestError as exc:
            outcome = Outcome(error=str(exc))
        except Exception as exc:  # noqa: BLE001 - the client gets it as a failed request, the log the traceback
            import logging

            logging.getLogger(__name__).exception("astuner serve: request %s failed", request_id)
            outcome = Outcome(error=f"{type(exc).__name__}: {exc}", category="server")
        self.futures.resolve(request_id, outcome)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


class RequestError(ValueError):
    """A request astuner cannot serve as sent: the client gets the message (category user, HTTP 400 if direct)."""
