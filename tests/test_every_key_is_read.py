"""No config key is silently ignored: every leaf key of the defaults is read by the code that runs, or is listed
as acting only with another backbone/engine (and then named in the start-up warning)."""

from __future__ import annotations

import re
from pathlib import Path

from astuner.config import valid_keys
from astuner.config.applicability import APPLIES_ONLY_WITH

PACKAGE = Path(__file__).resolve().parents[1] / "astuner"


def code_outside_config() -> str:
    return "\n".join(p.read_text() for p in PACKAGE.rglob("*.py") if "config" not in p.relative_to(PACKAGE).parts[:1])


def unread_keys(keys, source: str) -> list[str]:
    leaves = [k for k in keys if not any(other.startswith(k + ".") for other in keys)]
    unread = []
    for key in leaves:
        if key in APPLIES_ONLY_WITH:
            continue
        name = key.rsplit(".", 1)[-1]
        # Attribute access (cfg.x.name) or item access (cfg["name"] / .get("name")).
        if not re.search(rf"\.{name}\b|[\"']{name}[\"']", source):
            unread.append(key)
    return unread


def test_every_leaf_key_is_read_somewhere():
    unread = unread_keys(list(valid_keys()), code_outside_config())
    assert not unread, f"config keys no code reads: {unread}"


def test_the_check_notices_an_unread_key():
    keys = ["astuner.rollout", "astuner.rollout.temperature", "astuner.rollout.new_knob"]
    assert unread_keys(keys, "t = cfg.astuner.rollout.temperature") == ["astuner.rollout.new_knob"]
