"""Episodes run by remote agents: the board they take episodes from, and the workflow that posts them.

With `rollout.agentscope_workflow: astuner.serve.remote_board->RemoteAgents`, `astuner serve` runs the YAML's
training loop and every episode becomes an offer on the board. A client (`astuner.remote`, anywhere) takes one,
runs its agent against the server's OpenAI or Anthropic endpoint (`<server>/v1`) under the episode's own key,
and posts the outcome (a reward, or data for the YAML's judge). Everything else is the loop's as for a local
workflow: the episode's calls are recorded with their exact token ids, its deadline (`rollout.episode_timeout`)
holds whoever runs it, and an episode whose client disappears times out, is flagged and never trained. A result
posted after the deadline is refused (410). Several clients on several machines may serve one run.

An episode's deadline starts when a client takes it: with more offers than client slots, the later ones wait
their turn without losing time. Waiting for a taker has its own, longer bound (`astuner serve --take-timeout`,
4 x rollout.episode_timeout by default), named in the episode's error when it runs out. A take carries the client's
token: a take sent again after a dropped connection gets the episode the first one took, so none is orphaned.
"""

from __future__ import annotations

import asyncio
import itertools
import math
import secrets
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable

from astuner.http_body import HttpError
from astuner.workflow import Workflow, WorkflowOutput, WorkflowTask


class BoardError(HttpError):
    """A result the board cannot take: `status` is the HTTP status it answers (409, 410, 400)."""


TAKES_REMEMBERED = 4096


@dataclass
class Offer:
    episode_id: str
    payload: dict
    take_by: float  # time.monotonic() by which a client must take it
    episode_timeout: float  # seconds it runs for, from its take
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop
    on_take: Callable[[str, float], None] | None = None  # (client, deadline): the episode's deadline starts
    on_end: Callable[[], None] | None = None  # its result or error was accepted: the episode's calls end now
    taken_by: str | None = None
    deadline: float | None = None  # time.monotonic(), from the take


@dataclass
class EpisodeBoard:
    """Offers in the order the loop made them; thread-safe (the loop and the HTTP server run apart)."""

    public_url: str = ""  # what clients are told to call: "<public_url>/v1" for the model
    episode_timeout_s: float = 600.0  # rollout.episode_timeout: an episode's time from its take
    take_timeout_s: float | None = None  # how long an offer waits for a taker (None: 4 x episode_timeout_s)
    gateway: Any = None  # the run's OpenAI gateway (model_tuner/frontends/gateway.py), once an episode ran
    _offers: dict[str, Offer] = field(default_factory=dict)
    _takes: OrderedDict = field(default_factory=OrderedDict)  # (client, take token) -> episode id
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _ids: Any = field(default_factory=lambda: itertools.count(1))
    # Ids differ between server starts, so a result held across a restart never lands on another episode.
    _start: str = field(default_factory=lambda: secrets.token_hex(4))
    taken: int = 0
    finished: int = 0
    expired: int = 0
    run_over: bool = False  # the run finished: clients waiting for an episode are told to stop
    # Client -> when it last asked for an episode, and the clients told the run is over: the server stays up until
    # every client that asked lately has heard it (`wait_told`).
    _asked: dict[str, float] = field(default_factory=dict)
    _told: set[str] = field(default_factory=set)

    @property
    def take_wait_s(self) -> float:
        return self.take_timeout_s if self.take_timeout_s is not None else 4 * self.episode_timeout_s

    def offer(self, payload: dict, on_take: Callable[[str, float], None] | None = None,
              on_end: Callable[[], None] | None = None) -> Offer:
        loop = asyncio.get_running_loop()
        with self._lock:
            episode_id = f"ep-{self._start}-{next(self._ids)}"
            offer = Offer(episode_id, {**payload, "episode_id": episode_id}, time.monotonic() + self.take_wait_s,
                          self.episode_timeout_s, loop.create_future(), loop, on_take, on_end)
            self._offers[episode_id] = offer
        return offer

    def withdraw(self, offer: Offer) -> None:
        """The episode ended (done, timed out, cancelled): a later result is refused."""
        with self._lock:
            if self._offers.pop(offer.episode_id, None) is not None and not offer.future.done():
                self.expired += 1

    def take(self, client: str, token: str | None = None) -> dict | None:
        """The oldest offer nobody took, its deadline starting now, with the seconds left to it. A take repeated
        with the same token (a retry) gets the episode the first one took, while it runs."""
        now = time.monotonic()
        with self._lock:
            if token is not None and (client, token) in self._takes:
                offer = self._offers.get(self._takes[(client, token)])
                if offer is None or offer.taken_by != client:
                    return None
                return {**offer.payload, "deadline_s": round(offer.deadline - now, 3)}
            for offer in self._offers.values():
                if offer.taken_by is None and offer.take_by > now:
                    offer.taken_by, offer.deadline = client, now + offer.episode_timeout
                    if offer.on_take is not None:
                        offer.on_take(client, offer.deadline)
                    self.taken += 1
                    if token is not None:
                        self._takes[(client, token)] = offer.episode_id
                        while len(self._takes) > TAKES_REMEMBERED:
                            self._takes.popitem(last=False)
                    return {**offer.payload, "deadline_s": round(offer.episode_timeout, 3)}
        return None

    async def wait_take(self, client: str, wait_s: float, token: str | None = None) -> dict | None:
        end = time.monotonic() + wait_s
        while True:
            self._asked[client] = time.monotonic()
            got = self.take(client, token)
            if got is None and self.run_over:
                self._told.add(client)
            if got is not None or self.run_over or time.monotonic() >= end:
                return got
            await asyncio.sleep(0.02)

    def wait_told(self, recent_s: float, deadline_s: float) -> None:
        """After `run_over`: wait until every client that asked for an episode within `recent_s` has been told the
        run is over (one between two takes when the run ended asks again shortly), at most `deadline_s`. A server
        that closed first would leave such a client retrying an address that no longer answers."""
        end = time.monotonic() + deadline_s
        while time.monotonic() < end:
            now = time.monotonic()
            if all(c in self._told for c, at in list(self._asked.items()) if now - at < recent_s):
                return
            time.sleep(0.05)

    def holder(self, episode_id: str) -> str | None:
        with self._lock:
            offer = self._offers.get(episode_id)
            return None if offer is None else offer.taken_by

    def finish(self, episode_id: str, client: str, output: WorkflowOutput | BaseException) -> None:
        with self._lock:
            offer = self._offers.get(episode_id)
            if offer is None:
                raise BoardError(410, f"episode {episode_id} is over (its deadline passed, it was finished, or the "
                                      "server restarted since): this result is not used and the episode is not trained")
            if offer.taken_by != client:
                raise BoardError(409, f"episode {episode_id} was taken by another client")
            del self._offers[episode_id]
            self.finished += 1
        if offer.on_end is not None:  # before the client hears its result was taken: no call of it lands after
            offer.on_end()

        def resolve() -> None:
            if not offer.future.done():
                if isinstance(output, BaseException):
                    offer.future.set_exception(output)
                else:
                    offer.future.set_result(output)

        offer.loop.call_soon_threadsafe(resolve)

    def counts(self) -> dict[str, int]:
        with self._lock:
            waiting = sum(1 for o in self._offers.values() if o.taken_by is None)
            running = len(self._offers) - waiting
        return {"waiting": waiting, "running": running, "taken": self.taken, "finished": self.finished,
                "expired": self.expired}


class RemoteAgentError(RuntimeError):
    """What a remote client reported as its agent's failure (the episode is flagged failed)."""


class RemoteAgents(Workflow):
    """The workflow of a run whose agents run elsewhere: each episode waits for a remote client's outcome. The
    config names this class; `astuner serve` runs `RemoteAgents.on(board)` in its place, bound to the board its
    HTTP server reads."""

    name = "remote_agents"
    error_source = "remote"  # a failed or expired episode points at the clients, not at this class
    board: EpisodeBoard | None = None

    @classmethod
    def on(cls, board: EpisodeBoard) -> type[RemoteAgents]:
        """This workflow with its episodes offered on `board`."""
        return type(cls.__name__, (cls,), {"board": board, "__module__": cls.__module__})

    async def execute(self, workflow_task: WorkflowTask, model_tuner) -> WorkflowOutput:
        board = self.board
        if board is None:
            raise RuntimeError("RemoteAgents episodes are run by remote clients: start this config with "
                               "`astuner serve --conf ...` (not `astuner --conf ...`)")
        gateway = model_tuner.require_gateway()
        board.gateway = gateway
        # Until a client takes it, the episode waits for one (its own bound); from the take it has its timeout.
        model_tuner.deadline = time.monotonic() + board.take_wait_s
        model_tuner.deadline_note = (f"no remote client took the episode within {board.take_wait_s:g}s (astuner "
                                     f"serve --take-timeout): start more clients, or give them more concurrency")

        def on_take(client: str, deadline: float) -> None:
            model_tuner.deadline = deadline
            model_tuner.deadline_note = (f"episode timed out after {board.episode_timeout_s:g}s, run by remote "
                                         f"client {client}")

        task = workflow_task.task
        payload = {
            "task": {**task.metadata, "task_id": task.task_id, "query": task.main_query,
                     "init_messages": task.init_messages},
            "episode_uid": workflow_task.episode_uid, "is_validation": workflow_task.is_validation,
            "repeat_index": workflow_task.repeat_index,
            "base_url": f"{board.public_url}/v1", "api_key": model_tuner.api_key, "model": "policy",
            # One key per agent of astuner.agents: a call under it is that agent's, served by its model.
            "agent_keys": {agent: model_tuner.for_agent(agent).api_key for agent in model_tuner.roster.agents},
        }
        offer = board.offer(payload, on_take, on_end=model_tuner.end_calls)
        try:
            return await offer.future
        finally:
            board.withdraw(offer)


def workflow_output(body: dict) -> WorkflowOutput:
    """A client's posted result as a WorkflowOutput (reward None: the YAML's judge scores it)."""
    if not isinstance(body, dict):
        raise BoardError(400, "the result must be a JSON object")
    known = {"reward", "is_success", "metadata", "metrics", "agent_rewards", "response"}
    extra = sorted(set(body) - known)
    if extra:
        raise BoardError(400, f"unknown result fields {extra}; a result has {', '.join(sorted(known))}")
    reward = body.get("reward")
    if reward is not None and (isinstance(reward, bool) or not isinstance(reward, (int, float))
                               or not math.isfinite(reward)):
        raise BoardError(400, f"reward must be a finite number or null, got {reward!r}")
    for key in ("metadata", "metrics", "agent_rewards"):
        if not isinstance(body.get(key, {}), dict):
            raise BoardError(400, f"{key} must be an object")
    for key in ("metrics", "agent_rewards"):
        bad = [k for k, v in body.get(key, {}).items()
               if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v)]
        if bad:
            raise BoardError(400, f"{key} values must be finite numbers ({', '.join(bad)} are not)")
    success = body.get("is_success")
    if success is not None and not isinstance(success, bool):
        raise BoardError(400, "is_success must be true, false or null")
    return WorkflowOutput(reward=None if reward is None else float(reward), is_success=success,
                          metadata=dict(body.get("metadata", {})), response=body.get("response"),
                          metrics={k: float(v) for k, v in body.get("metrics", {}).items()},
                          agent_rewards={k: float(v) for k, v in body.get("agent_rewards", {}).items()})
