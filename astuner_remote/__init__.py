"""Run an agent anywhere for a run that `astuner serve` trains: take an episode, call the model, post the outcome.

Installable alone, without astuner or torch (`pip install ./clients/remote`: httpx and openai), so it runs on a
laptop, in a service, in a CI job; inside a full astuner install it is also `astuner.remote`:

    from astuner_remote import RemoteClient

    async def agent(episode):                      # episode.task: the dataset row, with task_id and query
        client = episode.openai_client()           # the server's OpenAI endpoint, under this episode's key
        reply = await client.chat.completions.create(model=episode.model, messages=[
            {"role": "user", "content": episode.task["query"]}])
        return {"metadata": {"final_answer": reply.choices[0].message.content}}   # the YAML's judge scores it

    RemoteClient("http://trainer:8000", api_key="tml-...").run(agent, concurrency=8)

A multi-agent system calls as each agent of the run's `astuner.agents` with `episode.openai_client(agent="critic")`
(or `episode.key_for("critic")` for another client): the call is that agent's, served and trained on its model.

The agent returns a number (the reward), a dict (`reward`, `is_success`, `metadata`, `metrics`, `agent_rewards`,
`response`; without `reward` the run's judge scores it) or None (the judge scores it). An exception is posted as
the episode's failure (flagged, never trained). An episode has a deadline (`deadline_s` when taken); a result
posted after it is refused and `post_result` returns False. A server that restarts is waited for
(`reconnect_s`), so clients reconnect on their own.

`run` never drops an episode it took: whatever one episode raises (the agent, a result that is not JSON, a post
that fails) becomes that episode's error post and the others go on; a client stopped (Ctrl-C, its task
cancelled) posts errors for the episodes it still runs. A take sent again after a dropped connection carries the
same token, so the server hands back the episode it already gave.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import os
import socket
import time
import traceback
import uuid
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

import httpx

RESULT_FIELDS = ("reward", "is_success", "metadata", "metrics", "agent_rewards", "response")
STOP_POST_S = 10.0  # a stopping client's error posts for what it still runs: at most this long
TAKE_GRACE_S = 2.0  # a stopping client's take in flight: its answer, if the server already gave an episode
log = logging.getLogger("astuner_remote")


@functools.cache
def _tls_context():
    """One TLS context for every request of the process: httpx builds one per client by reading the whole CA bundle
    (~20 ms of CPU), and each request opens a client of its own (the blocking methods each run an event loop)."""
    return httpx.create_ssl_context()


class RemoteError(RuntimeError):
    """The server refused a request (the message says why)."""


@dataclass
class RemoteEpisode:
    episode_id: str
    task: dict[str, Any]
    base_url: str  # the OpenAI endpoint (".../v1"); Anthropic clients take `anthropic_base_url`
    api_key: str  # this episode's key: revoked when the episode ends
    model: str
    deadline_s: float  # seconds left when it was taken
    is_validation: bool = False
    repeat_index: int = 0
    episode_uid: str = ""
    agent_keys: dict[str, str] = field(default_factory=dict)  # agent of astuner.agents -> its key this episode
    taken_at: float = field(default_factory=time.monotonic)

    @property
    def seconds_left(self) -> float:
        return self.deadline_s - (time.monotonic() - self.taken_at)

    @property
    def anthropic_base_url(self) -> str:
        return self.base_url.removesuffix("/v1")

    def key_for(self, agent: str | None = None) -> str:
        """The key of `agent`'s calls (an agent of the run's astuner.agents: served by its model, recorded as its
        calls); None: the episode's main key (`policy`)."""
        if agent is None:
            return self.api_key
        if agent not in self.agent_keys:
            listed = ", ".join(self.agent_keys) or "none"
            raise KeyError(f"agent {agent!r} is not in the served run's astuner.agents (listed: {listed}); add it "
                           f"there, or call without an agent (the policy)")
        return self.agent_keys[agent]

    def openai_client(self, sync: bool = False, agent: str | None = None):
        """An OpenAI client on this episode, as `agent` (see `key_for`); no retries: a retried call would be a
        second sampled call."""
        import openai

        cls, http = (openai.OpenAI, openai.DefaultHttpxClient) if sync else (openai.AsyncOpenAI,
                                                                             openai.DefaultAsyncHttpxClient)
        return cls(base_url=self.base_url, api_key=self.key_for(agent), max_retries=0,
                   timeout=max(1.0, self.seconds_left + 5), http_client=http(verify=_tls_context()))


def _as_result(value) -> dict:
    if value is None:
        return {"reward": None}
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return {"reward": float(value)}
    if isinstance(value, dict):
        extra = sorted(set(value) - set(RESULT_FIELDS))
        if extra:
            raise TypeError(f"the agent returned unknown result fields {extra}; a result has "
                            f"{', '.join(RESULT_FIELDS)}")
        return value
    fields = {k: getattr(value, k) for k in RESULT_FIELDS if hasattr(value, k)}  # a WorkflowOutput
    if not fields:
        raise TypeError(f"the agent returned {type(value).__name__}; return a reward, a dict or None")
    fields.pop("response", None)  # not JSON in general; put what the judge needs in metadata
    return fields


class RemoteClient:
    def __init__(self, url: str, api_key: str | None = None, name: str | None = None, reconnect_s: float = 300.0,
                 timeout_s: float = 60.0):
        self.url = url.rstrip("/")
        key = api_key or os.environ.get("ASTUNER_API_KEY") or "tml-local"
        self.name = name or f"{socket.gethostname()}-{os.getpid()}"
        self.headers = {"X-API-Key": key, "X-Astuner-Client": self.name}
        self.reconnect_s, self.timeout_s = reconnect_s, timeout_s
        self.run_over = False  # the server said its run ended: `run` returns

    # --- the board, synchronously -------------------------------------------------------------------------

    def next_episode(self, wait_s: float = 20.0) -> RemoteEpisode | None:
        return asyncio.run(self._next(wait_s))

    def post_result(self, episode: RemoteEpisode, reward: float | None = None, **fields) -> bool:
        """True if the run took it; False if the episode was over (its deadline passed)."""
        return asyncio.run(self._post_result(episode, {"reward": reward, **fields}))

    def post_error(self, episode: RemoteEpisode, error: str) -> bool:
        return asyncio.run(self._post(f"/astuner/v1/episodes/{episode.episode_id}/error", {"error": error}))

    def status(self) -> dict:
        with httpx.Client(headers=self.headers, timeout=self.timeout_s, verify=_tls_context()) as http:
            return self._check(http.get(f"{self.url}/astuner/v1/status"))

    # --- a loop of episodes ---------------------------------------------------------------------------------

    def run(self, agent: Callable[[RemoteEpisode], Awaitable[Any]], concurrency: int = 1,
            episodes: int | None = None, idle_exit_s: float | None = None) -> int:
        """Run `agent` on episodes, `concurrency` at once, until the run is over, `episodes` are taken and done, or
        none came for `idle_exit_s` (None: wait on). Returns the number of episodes the run took a result or an
        error of (one whose deadline had passed is not counted)."""
        return asyncio.run(self.run_async(agent, concurrency, episodes, idle_exit_s))

    async def run_async(self, agent, concurrency: int = 1, episodes: int | None = None,
                        idle_exit_s: float | None = None) -> int:
        state = {"claims": 0, "posted": 0, "idle_since": time.monotonic()}
        running: dict[str, RemoteEpisode] = {}

        async def worker() -> None:
            while not self.run_over:
                if idle_exit_s is not None and time.monotonic() - state["idle_since"] > idle_exit_s:
                    return
                if episodes is not None and state["claims"] >= episodes:
                    return
                state["claims"] += 1  # reserved before asking: never more than `episodes` taken
                take = asyncio.ensure_future(self._next(min(20.0, idle_exit_s or 20.0)))
                try:
                    episode = await asyncio.shield(take)
                except asyncio.CancelledError:
                    # Stopped while asking: an episode the server handed out that moment (its answer in flight) is
                    # still this client's, reported below; a take still waiting for work is dropped.
                    done, _ = await asyncio.wait({take}, timeout=TAKE_GRACE_S)
                    if take in done and not take.cancelled() and take.exception() is None and take.result():
                        running[take.result().episode_id] = take.result()
                    take.cancel()
                    raise
                except (RemoteError, httpx.HTTPError, ValueError, KeyError) as exc:  # gone past reconnect_s, or
                    state["claims"] -= 1  # an answer this client cannot read: it stops, holding nothing
                    log.warning("astuner_remote: no episode taken: %s", exc)
                    return
                if episode is None:
                    state["claims"] -= 1
                    continue
                running[episode.episode_id] = episode  # a cancellation leaves it here: reported below
                state["idle_since"] = time.monotonic()
                state["posted"] += await self._run_one(agent, episode)
                del running[episode.episode_id]
                state["idle_since"] = time.monotonic()

        try:
            await asyncio.gather(*(worker() for _ in range(concurrency)))
        finally:  # stopped with episodes in hand (Ctrl-C, a cancelled task): they are reported, not dropped
            if running:
                await asyncio.wait([asyncio.ensure_future(self._report(e, "the remote client stopped while running "
                                                                          "this episode")) for e in running.values()],
                                   timeout=STOP_POST_S)
        return state["posted"]

    async def _run_one(self, agent, episode: RemoteEpisode) -> bool:
        """Runs one episode and posts what came of it; True if the run took the post. Raises nothing but a
        cancellation: every failure of this episode is this episode's error."""
        try:
            result = _jsonable(_as_result(await agent(episode)), "result")
        except Exception as exc:  # noqa: BLE001 - the agent's failure, or a result that is not JSON
            return await self._report(episode, "".join(traceback.format_exception_only(type(exc), exc)).strip())
        try:
            return await self._post_result(episode, result)
        except (RemoteError, httpx.HTTPError, ValueError) as exc:  # refused (400), or the post itself failed
            return await self._report(episode, str(exc))

    async def _report(self, episode: RemoteEpisode, error: str) -> bool:
        """The episode's error post; a failure to post it is logged (the server's deadline then flags it)."""
        try:
            return await self._post(f"/astuner/v1/episodes/{episode.episode_id}/error", {"error": error[:4000]})
        except (RemoteError, httpx.HTTPError, ValueError) as exc:
            log.warning("astuner_remote: could not report episode %s (%s): %s", episode.episode_id, error[:200], exc)
            return False

    # --- HTTP -------------------------------------------------------------------------------------------------

    async def _next(self, wait_s: float) -> RemoteEpisode | None:
        # One token per take, the same on every retry of it: a take whose answer was lost gets its episode again.
        body = await self._request("/astuner/v1/episodes/next", {"wait_s": wait_s, "take_token": uuid.uuid4().hex},
                                   timeout=wait_s + 30)
        data = body["episode"]
        if data is None:
            self.run_over = self.run_over or bool(body.get("run_over"))
            return None
        return RemoteEpisode(data["episode_id"], data["task"], data["base_url"], data["api_key"], data["model"],
                             data["deadline_s"], data.get("is_validation", False), data.get("repeat_index", 0),
                             data.get("episode_uid", ""), dict(data.get("agent_keys") or {}))

    async def _post_result(self, episode: RemoteEpisode, result: dict) -> bool:
        return await self._post(f"/astuner/v1/episodes/{episode.episode_id}/result", _jsonable(result, "result"))

    async def _post(self, path: str, body: dict) -> bool:
        try:
            await self._request(path, body)
            return True
        except _Gone:
            return False

    async def _request(self, path: str, body: dict, timeout: float | None = None) -> dict:
        """POST `body`; a connection that fails or drops is retried (the same body) until `reconnect_s`."""
        deadline = time.monotonic() + self.reconnect_s
        delay = 0.5
        async with httpx.AsyncClient(headers=self.headers, timeout=timeout or self.timeout_s,
                                     verify=_tls_context()) as http:
            while True:
                try:
                    return self._check(await http.post(f"{self.url}{path}", json=body))
                except httpx.TransportError as exc:  # refused, reset, timed out, dropped mid-answer
                    if time.monotonic() > deadline:
                        raise RemoteError(f"astuner serve at {self.url} unreachable for {self.reconnect_s:g}s "
                                          f"({type(exc).__name__})") from None
                    await asyncio.sleep(delay)  # a restarting server: wait for it
                    delay = min(delay * 2, 10.0)

    @staticmethod
    def _check(response: httpx.Response) -> dict:
        if response.status_code == 410:
            raise _Gone(response.json().get("detail", ""))
        if response.status_code >= 400:
            try:
                detail = response.json().get("detail", response.text)
            except ValueError:
                detail = response.text
            raise RemoteError(f"astuner serve answered {response.status_code}: {detail}")
        return response.json()


def _jsonable(value, where: str):
    """`value` as JSON data: numpy and torch scalars and arrays become numbers and lists (`item`, `tolist`); a
    value of any other kind is a TypeError that names where it is."""
    if value is None or isinstance(value, (str, bool, int)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else str(value)
    if isinstance(value, dict):
        return {str(k): _jsonable(v, f"{where}[{k!r}]") for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v, f"{where}[{i}]") for i, v in enumerate(value)]
    for convert in ("tolist", "item"):  # numpy / torch: arrays, then scalars
        if callable(getattr(value, convert, None)):
            try:
                return _jsonable(getattr(value, convert)(), where)
            except (TypeError, ValueError):
                break
    raise TypeError(f"{where} is a {type(value).__name__}, which is not JSON: return numbers, strings, lists and "
                    f"dicts")


class _Gone(Exception):
    pass
