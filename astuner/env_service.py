"""A client for environment services: environments that live behind HTTP (a sandbox, a web app, a game server).

The protocol (JSON bodies; every request names the environment type):
  GET    {env_url}/tasks?env_type=T&split=S        -> {"tasks": [{"task_id": str, "query": str, ...}, ...]}
  POST   {env_url}/instances                       {"env_type": T, "task_id": str}
                                                   -> {"instance_id": str, "messages": [...], "tools": [...]}
  POST   {env_url}/instances/{id}/step             {"action": <assistant message, OpenAI shape>}
                                                   -> {"messages": [...], "done": bool, "reward": float | null}
  POST   {env_url}/instances/{id}/evaluate         {} -> {"reward": float, "success": bool, "metrics": {...}}
  DELETE {env_url}/instances/{id}                  -> {}
`messages` are OpenAI-shaped chat messages (the initial observation, then what each step adds: tool results,
user turns); `tools` are OpenAI tool schemas. Extra task fields become the task's metadata. A service should
expire instances nobody released (an episode that crashed cannot release its own).

Every request has a deadline (`request_timeout`); a connection error, a timeout or a 5xx is retried `retries`
times with exponential backoff (0.5 s, 1 s, 2 s, ...); a 4xx is not retried and raises `EnvServiceError` with the
service's message. A service that cannot be reached raises `EnvServiceError` saying so and what to check.
`tutorial/env_service/` holds a small service and a workflow that plays it.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

RETRYABLE_STATUS = (500, 502, 503, 504)


class EnvServiceError(RuntimeError):
    pass


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
        return EnvServiceError(
            f"{self._describe(method, path)}: the environment service did not answer ({last}) after "
            f"{self.retries + 1} attempts of at most {self.request_timeout:g}s each. Check that the service is "
            "running and that astuner.task_reader.env_service.env_url points at it."
        )

    def _request_sync(self, method: str, path: str, **kwargs: Any) -> dict:
        import httpx

        last = ""
        with httpx.Client(timeout=self.request_timeout) as http:
            for attempt in range(self.retries + 1):
                if attempt:
                    time.sleep(self.backoff_s * 2 ** (attempt - 1))
                try:
                    response = http.request(method, self.env_url + path, **kwargs)
                except httpx.HTTPError as exc:
                    last = f"{type(exc).__name__}: {exc}"
                    continue
                if response.status_code in RETRYABLE_STATUS:
                    last = f"HTTP {response.status_code}"
                    continue
                return self._check(response, method, path)
        raise self._give_up(method, path, last)

    async def _request(self, method: str, path: str, **kwargs: Any) -> dict:
        import httpx

        last = ""
        async with httpx.AsyncClient(timeout=self.request_timeout) as http:
            for attempt in range(self.retries + 1):
                if attempt:
                    await asyncio.sleep(self.backoff_s * 2 ** (attempt - 1))
                try:
                    response = await http.request(method, self.env_url + path, **kwargs)
                except httpx.HTTPError as exc:
                    last = f"{type(exc).__name__}: {exc}"
                    continue
                if response.status_code in RETRYABLE_STATUS:
                    last = f"HTTP {response.status_code}"
                    continue
                return self._check(response, method, path)
        raise self._give_up(method, path, last)


def client_from_config(typed) -> EnvServiceClient:
    env = typed.astuner.task_reader.env_service
    return EnvServiceClient(env.env_url or "", env.env_type, env.request_timeout, env.retries)


def client_for(task) -> EnvServiceClient:
    """The client of the service a task came from (the env_service reader links it in the task's metadata)."""
    link = (getattr(task, "metadata", None) or {}).get("env_service")
    if not isinstance(link, dict):
        raise EnvServiceError("this task did not come from an environment service (astuner.task_reader.type "
                              "env_service); its metadata has no 'env_service' link")
    return EnvServiceClient(link["env_url"], link["env_type"], link["request_timeout"], link["retries"])
