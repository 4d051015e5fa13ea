"""The keys of `astuner serve`: one per client, created and revoked from the command line.

Stored as SHA-256 digests in `<experiment_dir>/serve/keys.json` (mode 0600), never as keys; a key is shown once,
when it is created. The server rereads the file when it changes, so a revoked key stops working at once. A key
starts with `tml-` because the Tinker SDK refuses to send any other.

Once the file exists the server takes only its keys, also when every key has been revoked: revoking the last key
closes the server to everyone, it never reopens it. Only a loopback server without the file takes any key (one
tenant, "local"); deleting the file and restarting returns to that.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
from pathlib import Path

from astuner.errors import UserError


def digest(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


class KeyStore:
    def __init__(self, path: Path):
        self.path = Path(path)
        self.required = False  # set for a server beyond loopback: without keys it refuses every request
        self._mtime: tuple | None = None
        self._digests: dict[str, str] = {}  # digest -> name
        self._seen: dict[str, str] = {}  # every digest valid since this store was made -> name (revoked included)

    def _read(self) -> dict[str, str]:
        """name -> digest."""
        if not self.path.exists():
            return {}
        try:
            return dict(json.loads(self.path.read_text(encoding="utf-8")))
        except (OSError, ValueError) as exc:
            raise UserError(f"{self.path}: not a keys file ({exc}); remove it and create the keys again") from None

    def _write(self, keys: dict[str, str]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(keys, f, indent=1)
        tmp.replace(self.path)

    def create(self, name: str) -> str:
        keys = self._read()
        if name in keys:
            raise UserError(f"a key named {name!r} exists; revoke it first (astuner serve-key revoke {name})")
        key = "tml-" + secrets.token_urlsafe(32)
        keys[name] = digest(key)
        self._write(keys)
        return key

    def revoke(self, name: str) -> int:
        """Revokes `name`'s key; the number of keys left."""
        keys = self._read()
        if name not in keys:
            raise UserError(f"no key named {name!r}; the keys are: {', '.join(sorted(keys)) or 'none'}")
        del keys[name]
        self._write(keys)
        return len(keys)

    def names(self) -> list[str]:
        return sorted(self._read())

    def any(self) -> bool:
        self._refresh()
        return bool(self._digests)

    def open_access(self) -> bool:
        """Any key is taken: the server is on loopback and no key was ever created (the file does not exist). A
        server whose last key was revoked takes none."""
        self._refresh()
        return not self.required and self._mtime is None

    def owner(self, key: str | None) -> str | None:
        """The name of the client holding `key`, or None for no valid key."""
        self._refresh()
        if not key:
            return None
        given = digest(key)
        for d, name in self._digests.items():
            if hmac.compare_digest(d, given):
                return name
        return None

    def revoked(self, key: str | None) -> str | None:
        """The name of a key this server accepted earlier and that has since been revoked (None otherwise)."""
        if not key or self.owner(key) is not None:
            return None
        return self._seen.get(digest(key))

    def _refresh(self) -> None:
        try:
            st = self.path.stat()
            mtime = (st.st_mtime_ns, st.st_ino, st.st_size)  # a rewrite within one clock tick still shows
        except FileNotFoundError:
            mtime = None
        if mtime != self._mtime:
            self._digests = {d: name for name, d in self._read().items()}
            self._seen.update(self._digests)
            self._mtime = mtime
