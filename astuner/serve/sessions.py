"""Who may reach what on `astuner serve`: tenants, their sessions, and the silence after which a session expires.

A tenant is the name of a key (`astuner serve-key`), or "local" on a loopback server without keys. Every object the
server holds belongs to the tenant that made it: sessions here, training clients and samplers through their
session, checkpoints through a `tenant` file beside them (`tinker_service.py`), futures in `futures.py`. Another
tenant's id is answered as one that does not exist (404), so nothing says whether it does.

A session is kept alive by its client: the SDK sends a heartbeat every 10 s from a thread of its own, for as long
as its process lives, and warns after 120 s without an answer. A session silent for `timeout_s` (a script that
ended without `ServiceClient.close()`, a crash, Ctrl-C) expires: the server saves its training clients' states as
at shutdown, logs their tinker:// paths and frees their slots. Its later requests hear 410 (the SDK's heartbeat
stops on it), with where its states were saved.
"""

from __future__ import annotations

import secrets
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field

from astuner.serve.futures import Gone, NotFound

LOCAL = "local"  # the one tenant of a loopback server without keys
ENDED_REMEMBERED = 1024


def tenant_of_key(name: str) -> str:
    return f"key:{name}"


def tenant_label(tenant: str) -> str:
    """How a log line names a tenant."""
    return tenant.removeprefix("key:") if tenant.startswith("key:") else tenant


@dataclass
class Session:
    session_id: str
    tenant: str
    last_seen: float = field(default_factory=time.monotonic)
    ended: str | None = None  # why it ended: finished by its client, or expired (with its saved states)


class Sessions:
    def __init__(self, boot: str, timeout_s: float):
        self.boot, self.timeout_s = boot, timeout_s
        self._live: dict[str, Session] = {}
        self._ended: OrderedDict[str, Session] = OrderedDict()  # for the message a late request gets
        self._lock = threading.Lock()

    def create(self, tenant: str) -> str:
        session_id = f"s{self.boot}-{secrets.token_hex(12)}"
        with self._lock:
            self._live[session_id] = Session(session_id, tenant)
        return session_id

    def get(self, session_id, tenant: str, touch: bool = True) -> Session:
        """The tenant's live session (its silence restarts); 404 for none or another tenant's, 410 for an ended
        one."""
        with self._lock:
            session = self._live.get(session_id) if isinstance(session_id, str) else None
            if session is not None and session.tenant == tenant:
                if touch:
                    session.last_seen = time.monotonic()
                return session
            ended = self._ended.get(session_id) if isinstance(session_id, str) else None
        if ended is not None and ended.tenant == tenant:
            raise Gone(f"session {session_id} {ended.ended}")
        raise NotFound(f"no session {session_id!r} on this server (made by a server that has since restarted, or "
                       f"never made): create a new ServiceClient")

    def touch(self, session_id: str) -> None:
        with self._lock:
            session = self._live.get(session_id)
            if session is not None:
                session.last_seen = time.monotonic()

    def silent(self) -> list[Session]:
        """Live sessions silent for longer than the timeout."""
        now = time.monotonic()
        with self._lock:
            return [s for s in self._live.values() if now - s.last_seen > self.timeout_s]

    def end(self, session_id: str, why: str) -> Session | None:
        """Ends a live session, or says anew why an ended one ended (an expired session, once its states are
        saved, names them)."""
        with self._lock:
            session = self._live.pop(session_id, None) or self._ended.get(session_id)
            if session is None:
                return None
            session.ended = why
            self._ended[session_id] = session
            while len(self._ended) > ENDED_REMEMBERED:
                self._ended.popitem(last=False)
        return session

    def live(self, tenant: str | None = None) -> list[Session]:
        with self._lock:
            return [s for s in self._live.values() if tenant is None or s.tenant == tenant]
