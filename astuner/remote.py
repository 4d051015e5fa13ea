"""Run an agent anywhere for a run that `astuner serve` trains: take an episode, call the model, post the outcome.

Importable without torch (httpx and the standard library only), so it runs on a laptop, in a service, in a CI job:

    from astuner.remote import RemoteClient

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
"""

from __future__ import annotations

import asyncio
import os
import socket
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable

import httpx

RESULT_FIELDS = ("reward", "is_success", "metadata", "metrics", "agent_rewards", "response")


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

        cls = openai.OpenAI if sync else openai.AsyncOpenAI
        return cls(base_url=self.base_url, api_key=self.key_for(agent), max_retries=0,
                   timeout=max(1.0, self.seconds_left + 5))


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
        with httpx.Client(headers=self.headers, timeout=self.timeout_s) as http:
            return self._check(http.get(f"{self.url}/astuner/v1/status"))

    # --- a loop of episodes ---------------------------------------------------------------------------------

    def run(self, agent: Callable[[RemoteEpisode], Awaitable[Any]], concurrency: int = 1,
            episodes: int | None = None, idle_exit_s: float | None = None) -> int:
        """Run `agent` on episodes, `concurrency` at once, until the run is over, `episodes` are done, or none
        came for `idle_exit_s` (None: wait on). Returns the number of episodes posted."""
        return asyncio.run(self.run_async(agent, concurrency, episodes, idle_exit_s))

    async def run_async(self, agent, concurrency: int = 1, episodes: int | None = None,
                        idle_exit_s: float | None = None) -> int:
        state = {"claimed": 0, "posted": 0, "idle_since": time.monotonic()}

        async def worker() -> None:
            while (episodes is None or state["claimed"] < episodes) and not self.run_over:
                if idle_exit_s is not None and time.monotonic() - state["idle_since"] > idle_exit_s:
                    return
                episode = await self._next(min(20.0, idle_exit_s or 20.0))
                if episode is None:
                    continue
                state["claimed"] += 1
                state["idle_since"] = time.monotonic()
                try:
                    result = _as_result(await agent(episode))
                except Exception as exc:  # noqa: BLE001 - the run records it as the episode's failure
                    text = "".join(traceback.format_exception_only(type(exc), exc)).strip()
                    await self._post(f"/astuner/v1/episodes/{episode.episode_id}/error", {"error": text})
                else:
                    try:
                        await self._post_result(episode, result)
                    except RemoteError as exc:  # a result the run refused (400): this episode fails, not the rest
                        await self._post(f"/astuner/v1/episodes/{episode.episode_id}/error", {"error": str(exc)})
                state["posted"] += 1
                state["idle_since"] = time.monotonic()

        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return state["posted"]

    # --- HTTP -------------------------------------------------------------------------------------------------

    async def _next(self, wait_s: float) -> RemoteEpisode | None:
        body = await self._request("/astuner/v1/episodes/next", {"wait_s": wait_s}, timeout=wait_s + 30)
        data = body["episode"]
        if data is None:
            self.run_over = self.run_over or bool(body.get("run_over"))
            return None
        return RemoteEpisode(data["episode_id"], data["task"], data["base_url"], data["api_key"], data["model"],
                             data["deadline_s"], data.get("is_validation", False), data.get("repeat_index", 0),
                             data.get("episode_uid", ""), dict(data.get("agent_keys") or {}))

    async def _post_result(self, episode: RemoteEpisode, result: dict) -> bool:
        return await self._post(f"/astuner/v1/episodes/{episode.episode_id}/result", result)

    async def _post(self, path: str, body: dict) -> bool:
        try:
            await self._request(path, body)
            return True
        except _Gone:
            return False

    async def _request(self, path: str, body: dict, timeout: float | None = None) -> dict:
        deadline = time.monotonic() + self.reconnect_s
        delay = 0.5
        async with httpx.AsyncClient(headers=self.headers, timeout=timeout or self.timeout_s) as http:
            while True:
                try:
                    return self._check(await http.post(f"{self.url}{path}", json=body))
                except (httpx.ConnectError, httpx.RemoteProtocolError, httpx.ReadError) as exc:
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


class _Gone(Exception):
    pass
