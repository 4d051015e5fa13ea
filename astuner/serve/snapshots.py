"""What the Tinker API's samplers serve: weight snapshots, the sampling sessions that name them, and the engine
of their base model (one per base, `bases.py`), which switches snapshots between requests.

    named       `save_weights_for_sampler(name)`: a file under the server's state folder; saving a name again
                makes a new snapshot (a new key), so its samplers serve the newer weights
    ephemeral   `save_weights_and_get_sampling_client`: in memory, the last EPHEMERAL_KEPT per training client
    base        the base model, as the engine loaded it (kept in memory the first time the engine leaves it)
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from dataclasses import dataclass
from pathlib import Path

from astuner.serve.futures import NotFound, RequestError

EPHEMERAL_KEPT = 2


@dataclass
class Snapshot:
    """Weights a sampler serves: in memory (`tensors`), in a file, or the base model (neither)."""

    key: str
    model_name: str
    tenant: str | None = None  # whose weights these are (None: the base model, everyone's)
    tensors: dict | None = None
    file: Path | None = None

    def load(self) -> dict:
        if self.tensors is not None:
            return self.tensors
        from safetensors.torch import load_file

        return load_file(str(self.file))


class Samplers:
    """One base model's snapshots by path (or ephemeral id) and sampling sessions by id; `serving` holds its
    engine (`get_engine()`, built on first use) on one."""

    def __init__(self, get_engine, model_name: str):
        self.model_name = model_name
        self.snapshots: dict[str, Snapshot] = {"base": Snapshot("base", model_name)}
        self.sessions: dict[str, tuple[str, str]] = {}  # sampling_session_id -> (snapshot path, its tenant)
        self._keys = itertools.count(1)
        self._gate = EngineGate(get_engine)

    def add(self, path: str, tenant: str, tensors: dict | None = None, file: Path | None = None) -> None:
        """A snapshot under `path`, replacing what it held (a new key: the engine loads it again)."""
        self.snapshots[path] = Snapshot(f"{path}#{next(self._keys)}", self.model_name, tenant, tensors, file)

    def open_session(self, sampler_id: str, path: str, tenant: str) -> None:
        self.sessions[sampler_id] = (path, tenant)

    def tenant_of(self, sampler_id: str) -> str | None:
        held = self.sessions.get(sampler_id)
        return None if held is None else held[1]

    def forget(self, paths: list[str], session_prefix: str) -> None:
        """A closed session's snapshots in memory and sampling sessions."""
        for path in paths:
            self.snapshots.pop(path, None)
        for sampler in [k for k in self.sessions if k.startswith(session_prefix)]:
            del self.sessions[sampler]

    def info(self, sampler_id: str) -> dict:
        path = self._path_of(sampler_id)
        return {"sampler_id": sampler_id, "base_model": self.model_name,
                "model_path": None if path == "base" else path}

    def _path_of(self, sampler_id: str) -> str:
        if sampler_id not in self.sessions:
            raise NotFound(f"no sampling session {sampler_id!r} on this server")
        return self.sessions[sampler_id][0]

    def snapshot_of(self, sampler_id: str) -> Snapshot:
        snapshot = self.snapshots.get(self._path_of(sampler_id))
        if snapshot is None:
            raise RequestError(f"sampling session {sampler_id}: its weights were let go (astuner serve keeps the last "
                               f"{EPHEMERAL_KEPT} of save_weights_and_get_sampling_client per training client); "
                               f"save_weights_for_sampler(name) keeps a snapshot on disk")
        return snapshot

    def serving(self, snapshot: Snapshot):
        return self._gate.serving(snapshot)


class EngineGate:
    """The engine serves one snapshot at a time: a switch waits until the requests in flight are done.

    Fair in arrival order: a request for the snapshot being served joins it only if it came before every request
    waiting for another snapshot; a later one waits, so the engine drains and switches, and no snapshot starves
    under a stream of requests for another. Runs of requests for one snapshot still share its turn."""

    def __init__(self, get_engine):
        self.get_engine = get_engine
        self.engine = None
        self.current = "base"
        self._base: dict | None = None
        self._inflight = 0
        self._cond: asyncio.Condition | None = None
        self._tickets = itertools.count()
        self._waiting: dict[int, str] = {}  # ticket -> the snapshot key it waits for

    def _may_go(self, ticket: int, key: str) -> bool:
        if self._inflight == 0:
            return True
        other = min((t for t, k in self._waiting.items() if k != key), default=None)
        return self.current == key and (other is None or ticket < other)

    @contextlib.asynccontextmanager
    async def serving(self, snapshot: Snapshot):
        if self.engine is None:
            self.engine = await asyncio.to_thread(self.get_engine)  # a model's first sampling loads it
        if self._cond is None:
            self._cond = asyncio.Condition()
        async with self._cond:
            ticket = next(self._tickets)
            self._waiting[ticket] = snapshot.key
            try:
                await self._cond.wait_for(lambda: self._may_go(ticket, snapshot.key))
                if self.current != snapshot.key:
                    await asyncio.to_thread(self._switch, snapshot)
                self._inflight += 1
            finally:
                del self._waiting[ticket]
                self._cond.notify_all()  # a request that stops waiting may let later ones of its snapshot go
        try:
            yield self.engine
        finally:
            async with self._cond:
                self._inflight -= 1
                self._cond.notify_all()

    def _switch(self, snapshot: Snapshot) -> None:
        if self.current == "base" and self._base is None:  # kept before the base weights are overwritten
            self._base = base_weights(self.engine)
        tensors = self._base if snapshot.key == "base" else snapshot.load()
        self.current = None  # a load that fails half way leaves weights no snapshot names
        self.engine.load_weights(tensors.items())
        self.current = snapshot.key


def base_weights(engine) -> dict:
    """The weights an engine serves before any switch, on the CPU (`InferenceEngine.base_weights`)."""
    try:
        return engine.base_weights()
    except FileNotFoundError as exc:
        raise RequestError(f"{exc}: the base model cannot be served again") from None
