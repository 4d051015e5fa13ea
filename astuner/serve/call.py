"""A Tinker API request as `astuner serve`'s handlers see it (`Call`): the tenant it acts for and its body."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from astuner.http_body import HttpError


@dataclass
class Call:
    """One Tinker API request as a handler sees it: the tenant it acts for and its body, read within its route's
    limit."""

    request: Any  # starlette's Request
    tenant: str
    body: bytes
    _json: dict | None = field(default=None, repr=False)

    def json(self) -> dict:
        if self._json is None:
            try:
                data = json.loads(self.body or b"{}")
            except ValueError as exc:
                raise HttpError(400, f"the body is not JSON ({exc})") from None
            if not isinstance(data, dict):
                raise HttpError(400, "the body must be a JSON object")
            self._json = data
        return self._json

    def field(self, key: str, kind: type = str):
        value = self.json().get(key)
        if not isinstance(value, kind) or isinstance(value, bool) and kind is int:
            raise HttpError(400, f"{key}: a {kind.__name__} is required")
        return value


def json_sequence(call: Call) -> tuple[str, int] | None:
    """A JSON training request's model_id and seq_id (None when it names neither, or is no JSON)."""
    try:
        data = call.json()
    except HttpError:
        return None
    model_id, seq_id = data.get("model_id"), data.get("seq_id")
    ok = isinstance(model_id, str) and isinstance(seq_id, int) and not isinstance(seq_id, bool)
    return (model_id, seq_id) if ok else None
