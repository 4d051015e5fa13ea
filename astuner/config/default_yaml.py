"""The packaged default YAMLs, generated from the schema: each key's doc becomes the comment above it, and a key
that acts only under some setting is marked "[only ...]" (applicability.py).

    python -m astuner.config.default_yaml           # exit 1 and name the stale files
    python -m astuner.config.default_yaml --write   # regenerate them
"""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path
from typing import Any

from astuner.config.applicability import APPLIES_ONLY_WITH
from astuner.config.backbones import BACKBONES
from astuner.config.schema import RunConfig, Section

HEADERS = {
    "astuner": (
        "astuner defaults. Generated from astuner/config/schema.py (python -m astuner.config.default_yaml "
        "--write); edit the schema, not this file. Every key below is read by astuner; a user YAML may set any of "
        "them. Keys marked [only ...] act only under that setting; setting one elsewhere is reported in one warning "
        "at start."
    ),
    **{b.name: b.defaults_header for b in BACKBONES.values() if b.defaults_file},
}
DEFAULT_FILE_OF = {**{b.name: b.defaults_file for b in BACKBONES.values() if b.defaults_file},
                   "astuner": "astuner_default.yaml"}


def _wrap(text: str, indent: str, width: int = 116) -> list[str]:
    return textwrap.wrap(text, width=width - len(indent) - 2, break_on_hyphens=False) or [""]


def _scalar(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return repr(value) if "e" not in repr(value) else f"{value:.1e}".replace("e-0", "e-")
    if isinstance(value, int):
        return str(value)
    if isinstance(value, list):
        return "[" + ", ".join(_scalar(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_scalar(v)}" for k, v in value.items()) + "}"
    text = str(value)
    return text if text and text.replace("_", "").replace("-", "").replace(":", "").replace(".", "").replace(
        ">", "").isalnum() and not text[0].isdigit() else json.dumps(text)


def render_yaml(name: str) -> str:
    """The default YAML of one top-level section, comments from the schema's docs."""
    model_cls = RunConfig.model_fields[name].annotation
    lines = [f"# {line}" for line in _wrap(HEADERS[name], "")]

    def walk(cls: type[Section], indent: str, prefix: str) -> None:
        for field_name, info in cls.model_fields.items():
            path = f"{prefix}.{field_name}"
            annotation = info.annotation
            is_section = isinstance(annotation, type) and issubclass(annotation, Section)
            doc = info.description or ""
            if path in APPLIES_ONLY_WITH:  # marked where its scope starts, not on every key inside it
                doc = f"[only {APPLIES_ONLY_WITH[path][0]}] {doc}".rstrip()
            if doc:
                lines.extend(f"{indent}# {line}" for line in _wrap(doc, indent))
            if is_section:
                if annotation.model_fields:
                    lines.append(f"{indent}{field_name}:")
                    walk(annotation, indent + "  ", path)
                else:
                    lines.append(f"{indent}{field_name}: {{}}")
            else:
                default = info.default if info.default_factory is None else info.default_factory()
                lines.append(f"{indent}{field_name}: {_scalar(default)}")

    if model_cls.model_fields:
        lines.append(f"{name}:")
        walk(model_cls, "  ", name)
    else:
        lines.append(f"{name}: {{}}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    root = Path(__file__).resolve().parent.parent / "default_config"
    stale = []
    for name, rel in DEFAULT_FILE_OF.items():
        text = render_yaml(name)
        target = root / rel
        if target.read_text(encoding="utf-8") != text:
            stale.append(str(target))
            if "--write" in args:
                target.write_text(text, encoding="utf-8")
    if stale and "--write" not in args:
        print("stale (run python -m astuner.config.default_yaml --write):", *stale, sep="\n  ")
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
