"""OpenEnv environment servers started on this machine, no containers: the user's environment package served by
uvicorn in a child process, restarted when it dies.

An OpenEnv environment is an ASGI app (`create_app(Env, Action, Observation, ...)`) whose episodes run over a
WebSocket session each (its HTTP /reset and /step build a fresh environment per request, so they cannot hold an
episode). A `ServerPool` per process and environment starts `servers` such apps on free ports of 127.0.0.1 and
lends sessions: at most `sessions_per_server` episodes at once on one server (the app's own
`max_concurrent_envs`, 1 unless its environment declares concurrent sessions). A server is started at its first
lease and is ready when `GET /health` answers within START_TIMEOUT_S; one whose process has died is started again
at the next lease (counted in `restarts`), and one an episode lost its connection to is checked, and restarted if
it is dead or does not answer. Servers stop with the process (their own process groups, killed at exit).
"""

from __future__ import annotations

import asyncio
import atexit
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections import deque
from dataclasses import dataclass
from pathlib import Path

START_TIMEOUT_S = 60.0  # the app's imports (OpenEnv loads gradio when installed) take seconds
HEALTH_TIMEOUT_S = 5.0
LOG_TAIL_BYTES = 4000


@dataclass(frozen=True)
class AppSpec:
    """Where an environment's app lives: `app` "module:attribute" imported from `app_dir`."""

    app: str
    app_dir: str


class LocalServer:
    """One uvicorn process serving the app on 127.0.0.1."""

    def __init__(self, spec: AppSpec, log_path: Path) -> None:
        self.spec, self.log_path = spec, log_path
        self.proc: subprocess.Popen | None = None
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=HEALTH_TIMEOUT_S) as response:
                return response.status == 200
        except OSError:
            return False

    def start(self) -> None:
        """Start the app and wait until it answers /health; RuntimeError quoting its log's tail when it does not."""
        self.stop()
        self.port = _free_port()
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")
        env = {**os.environ, "ENABLE_WEB_INTERFACE": "false", "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "uvicorn", self.spec.app, "--app-dir", self.spec.app_dir, "--host", "127.0.0.1",
             "--port", str(self.port), "--log-level", "warning"],
            stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env, start_new_session=True)
        log.close()
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if not self.alive():
                raise RuntimeError(f"the OpenEnv app {self.spec.app} (from {self.spec.app_dir}) exited with code "
                                   f"{self.proc.returncode} at start: {self.log_tail()}")
            if self.healthy():
                return
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"the OpenEnv app {self.spec.app} did not answer /health within {START_TIMEOUT_S:g}s: "
                           f"{self.log_tail()}")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(timeout=10)
        self.proc = None

    def log_tail(self) -> str:
        try:
            data = self.log_path.read_bytes()[-LOG_TAIL_BYTES:]
        except OSError:
            return "(no log)"
        return " ".join(data.decode("utf-8", "replace").split()) or "(its log is empty)"


class ServerPool:
    """`servers` LocalServers of one app, each lending `sessions_per_server` sessions at a time."""

    def __init__(self, spec: AppSpec, servers: int, sessions_per_server: int, log_dir: Path) -> None:
        self.spec = spec
        self.servers = [LocalServer(spec, log_dir / f"openenv_server_{i}.log") for i in range(servers)]
        self.free: deque[int] = deque(i for i in range(servers) for _ in range(sessions_per_server))
        self.restarts = 0
        self._loop: asyncio.AbstractEventLoop | None = None

    def _bind(self) -> None:
        """The semaphore and lock of the running loop (the rollout keeps one; a script may run several in turn)."""
        loop = asyncio.get_running_loop()
        if loop is not self._loop:
            self._loop, self.available, self._lock = loop, asyncio.Semaphore(len(self.free)), asyncio.Lock()

    async def lease(self) -> int:
        """A session slot: the index of a server that is up (started or restarted here)."""
        self._bind()
        await self.available.acquire()
        index = self.free.popleft()
        try:
            async with self._lock:  # one start at a time, off the event loop
                server = self.servers[index]
                if not server.alive():
                    if server.proc is not None:
                        self.restarts += 1
                    await asyncio.to_thread(server.start)
        except BaseException:
            self.release(index)
            raise
        return index

    def release(self, index: int) -> None:
        self.free.append(index)
        self.available.release()

    async def check(self, index: int) -> None:
        """After a lost connection: restart the server when its process died or it does not answer."""
        server = self.servers[index]
        self._bind()
        async with self._lock:
            if not server.alive() or not await asyncio.to_thread(server.healthy):
                if server.proc is not None:
                    self.restarts += 1
                await asyncio.to_thread(server.start)

    def stop(self) -> None:
        for server in self.servers:
            server.stop()


_POOLS: dict[tuple, ServerPool] = {}


def pool_for(spec: AppSpec, servers: int, sessions_per_server: int, log_dir: Path) -> ServerPool:
    """This process's pool for the app, made on first use (on the running loop, which the rollout keeps)."""
    key = (spec, servers, sessions_per_server)
    if key not in _POOLS:
        if not _POOLS:
            atexit.register(stop_all)
        _POOLS[key] = ServerPool(spec, servers, sessions_per_server, log_dir)
    return _POOLS[key]


def stop_all() -> None:
    for pool in _POOLS.values():
        pool.stop()
    _POOLS.clear()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
