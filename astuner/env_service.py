"""A client for environment services: environments that live behind HTTP (a sandbox, a web app, a game server).

The protocol (JSON bodies; every request names the environment type):
  GET    {env_url}/tasks?env_type=T&split=S        -> {"tasks": [{"task_id": str, "query": str, ...}, ...]}
  POST   {env_url}/instances                       {"env_type": T, "task_id": str}
                                                   -> {"instance_id": str, "messages": [...], "tools": [...]}
  POST   {env_url}/instances/{id}/step             {"action": <assistant message, OpenAI shape>}
                                                   -> {"messages": [...], "done": bool, "reward": float | null}
  POST   {env_url}/instances/{id}/evaluate         {} -> {"reward": float, "success": bool, "metrics": {...}}
  DELETE {env_url}/instances/{id}                  -> {} (also for an instance already gone)
`messages` are OpenAI-shaped chat messages (the initial observation, then what each step adds: tool results,
user turns); `tools` are OpenAI tool schemas. Extra task fields become the task's metadata. A service should
expire instances nobody released (an episode that crashed cannot release its own).

Idempotency keys. A POST changes the environment (create, step), so sending one twice can apply it twice: a step
the service applied but answered after the client's deadline would be applied again by a retry, and the reward
would no longer match the recorded trajectory. So every POST carries a header `Idempotency-Key: <uuid>`, one per
logical request and the same on each of its retries. A service honours the key by answering a request whose
method, path and key it has seen with the answer it gave the first time (waiting for it if the first is still
running) instead of applying it again, and by saying so on every response with the header
`Idempotency-Key-Honoured: true`. A key reused with a different body is answered 422. The service keeps the
answers for at least a few minutes (retries come within `retries * (request_timeout + backoff)` seconds).

Retries. Every request has a deadline (`request_timeout`). A request that provably never reached the service (the
connection could not be opened: refused, DNS, connect or pool timeout) is retried `retries` times with
exponential backoff (0.5 s, 1 s, 2 s, ...), whatever its method. A timeout, a broken connection or a 5xx after
the request was sent is retried likewise for GET and DELETE (idempotent in this protocol) and for a POST only to
a service that has said it honours idempotency keys (any earlier response of that `env_url`, in this process,
carried the header). Otherwise the POST is not retried and raises `EnvServiceError` saying that the service may
have applied it: the episode fails (and is not trained on) rather than training on a trajectory the environment
did not see. A 4xx is never retried and raises `EnvServiceError` with the service's message. A service that
cannot be reached raises `EnvServiceError` saying so and what to check. Those two (`EnvServiceUnavailable`) are the
environment's failures: the rollout runs the episode again with a fresh instance (astuner/environments/failures.py).
`tutorial/env_service/` holds a small service, which honours idempotency keys, and a workflow that plays it.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

from astuner.environments import failures as env_failures
from astuner.http_body import tls_context
from astuner.watchdog import watch

RETRYABLE_STATUS = (500, 502, 503, 504)
KEY_HEADER = "Idempotency-Key"
HONOURED_HEADER = "Idempotency-Key-Honoured"
# Services (by env_url) seen to honour idempotency keys in this process: their POSTs are safe to retry.
_HONOURS_KEYS: set[str] = set()


class EnvServiceError(RuntimeError):
    pass


class EnvServiceUnavailable(EnvServiceError, env_failures.EnvironmentFailure):
    """The service did not answer, or failed after a POST was sent: the environment's failure, not the model's (the
    episode is flagged and run again: astuner/environments/failures.py)."""


def _never_sent(exc: Exception) -> bool:
    """The connection could not be opened, so the service cannot have seen the request."""
    import httpx

    return isinstance(exc, (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout))


class EnvServiceClient:
    def __init__(self, env_url: str, env_type: str = "default", request_timeout: float = 30.0,
                 retries: int = 3, backoff_s: float = 0.5) -> None:
        if not env_url:
            raise EnvServiceError("no env_url: set astuner.task_reader.env_service.env_url")
        self.env_url = env_url.rstrip("/")
        self.env_type = env_type
        self.request_timeout = float(request_timeout)
        self.retries = int(retries)
        self.backoff_s = float(backoff_s)

    # --- sync (the task reader) ----------------------------------------------------------------------------
    def list_tasks(self, split: str) -> list[dict]:
        body = self._request_sync("GET", "/tasks", params={"env_type": self.env_type, "split": split})
        tasks = body.get("tasks")
        if not isinstance(tasks, list):
            raise EnvServiceError(f"{self.env_url}/tasks answered without a 'tasks' list: {str(body)[:200]}")
        return tasks

    # --- async (workflows and judges) ----------------------------------------------------------------------
    async def create(self, task_id: str) -> dict:
        return await self._request("POST", "/instances", json={"env_type": self.env_type, "task_id": task_id})

    async def step(self, instance_id: str, action: dict) -> dict:
        return await self._request("POST", f"/instances/{instance_id}/step", json={"action": action})

    async def evaluate(self, instance_id: str) -> dict:
        return await self._request("POST", f"/instances/{instance_id}/evaluate", json={})

    async def release(self, instance_id: str) -> None:
        await self._request("DELETE", f"/instances/{instance_id}")

    # --- transport -----------------------------------------------------------------------------------------
    def _describe(self, method: str, path: str) -> str:
        return f"{method} {self.env_url}{path}"

    def _check(self, response, method: str, path: str) -> dict:
        if response.status_code >= 400:
            try:
                detail = response.json().get("error", response.text)
            except ValueError:
                detail = response.text
            raise EnvServiceError(f"{self._describe(method, path)} failed with {response.status_code}: "
                                  f"{str(detail)[:300]}")
        try:
            return response.json() if response.content else {}
        except ValueError:
            raise EnvServiceError(f"{self._describe(method, path)} answered with non-JSON: "
                                  f"{response.text[:200]!r}") from None

    def _give_up(self, method: str, path: str, last: str) -> EnvServiceError:
        return env_failures.record(EnvServiceUnavailable(
            self.env_type, self._describe(method, path),
            f"the environment service did not answer ({last}) after {self.retries + 1} attempts of at most "
            f"{self.request_timeout:g}s each. Check that the service is running and that "
            "astuner.task_reader.env_service.env_url points at it."))

    @property
    def honours_keys(self) -> bool:
        return self.env_url in _HONOURS_KEYS

    def _headers(self, method: str) -> dict[str, str]:
        return {KEY_HEADER: uuid.uuid4().hex} if method == "POST" else {}

    def _failed(self, method: str, path: str, exc: Exception | None, response) -> str | None:
        """None when the attempt got an answer to hand on (2xx or 4xx); else why it failed. Raises when a retry
        could apply a POST twice (rules in the module docstring)."""
        if response is not None and response.headers.get(HONOURED_HEADER, "").lower() == "true":
            _HONOURS_KEYS.add(self.env_url)
        if exc is None and response.status_code not in RETRYABLE_STATUS:
            return None
        last = f"HTTP {response.status_code}" if exc is None else f"{type(exc).__name__}: {exc}"
        if method == "POST" and not (exc is not None and _never_sent(exc)) and not self.honours_keys:
            raise env_failures.record(EnvServiceUnavailable(
                self.env_type, self._describe(method, path),
                f"failed after it was sent ({last}); not retried, because the service may have applied it and it "
                f"does not say it honours Idempotency-Key (response header {HONOURED_HEADER}: true), so a retry "
                "could apply it twice (the episode is run again from a fresh instance). See astuner/env_service.py."))
        return last

    def _request_sync(self, method: str, path: str, **kwargs: Any) -> dict:
        import httpx

        last, headers = "", self._headers(method)
        with httpx.Client(timeout=self.request_timeout, verify=tls_context()) as http:
            for attempt in range(self.retries + 1):
                if attempt:
                    time.sleep(self.backoff_s * 2 ** (attempt - 1))
                try:
                    response, exc = http.request(method, self.env_url + path, headers=headers, **kwargs), None
                except httpx.HTTPError as error:
                    response, exc = None, error
                last = self._failed(method, path, exc, response)
                if last is None:
                    return self._check(response, method, path)
        raise self._give_up(method, path, last)

    async def _request(self, method: str, path: str, **kwargs: Any) -> dict:
        import httpx

        last, headers = "", self._headers(method)
        with watch("env service", f"{method} {path}"):
            async with httpx.AsyncClient(timeout=self.request_timeout, verify=tls_context()) as http:
                for attempt in range(self.retries + 1):
                    if attempt:
                        await asyncio.sleep(self.backoff_s * 2 ** (attempt - 1))
                    try:
                        response = await http.request(method, self.env_url + path, headers=headers, **kwargs)
                        exc = None
                    except httpx.HTTPError as error:
                        response, exc = None, error
                    last = self._failed(method, path, exc, response)
                    if last is None:
                        return self._check(response, method, path)
        raise self._give_up(method, path, last)


def client_for(task) -> EnvServiceClient:
    """The client of the service a task came from (the env_service reader links it in the task's metadata)."""
    link = (getattr(task, "metadata", None) or {}).get("env_service")
    if not isinstance(link, dict):
        raise EnvServiceError("this task did not come from an environment service (astuner.task_reader.type "
                              "env_service); its metadata has no 'env_service' link")
    return EnvServiceClient(link["env_url"], link["env_type"], link["request_timeout"], link["retries"])
