"""The building blocks of the config schema (`schema.py`): a key with its default, doc and bounds, a key's old
name, a nested section, and the frozen, strict base every section derives from.

Imports only pydantic, so `astuner --help` stays fast.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field


def key(default: Any, doc: str, refused: str | None = None, **bounds: Any) -> Any:
    """A config key: its default, its documentation (a comment above it in the YAML), optional ge/gt/le bounds.
    `refused`: why a value outside the allowed ones is refused, added to the error (e.g. a value another
    trainer accepts that this one does not implement)."""
    extra = {"refused": refused} if refused else None
    return Field(default=default, description=doc, json_schema_extra=extra, **bounds)


def old_name(new_key: str, default: Any, **bounds: Any) -> Any:
    """A key's old name, kept so that configs written for it still load. Loading moves a value set here to
    `new_key` (with one notice) and keeps both equal, so user code reading either sees the same value."""
    doc = (f"Old name of {new_key}: a value set here goes there (with one notice at start), and this key always "
           "holds the same value. Set the new name instead.")
    return Field(default=default, description=doc, json_schema_extra={"old_name_of": new_key}, **bounds)


def section(cls: type, doc: str = "") -> Any:
    return Field(default_factory=cls, description=doc)


class Section(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)

