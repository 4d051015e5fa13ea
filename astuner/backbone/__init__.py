"""Backbones decide where the loop's stages run. Explicit registry of `module:function` entry points."""

from __future__ import annotations

import importlib

from astuner.errors import UserError

BACKBONES = {
    "debug": "astuner.backbone.debug:run",
}
LATER = {"verl", "trinity"}


def run_backbone(name: str, loaded, checkpoint=None) -> None:
    if name in LATER:
        raise UserError(f"the {name!r} backbone comes in a later release; use --backbone debug for now")
    if name not in BACKBONES:
        raise UserError(f"unknown backbone {name!r}; choose one of: {', '.join(sorted(BACKBONES))}")
    module_name, func = BACKBONES[name].split(":")
    getattr(importlib.import_module(module_name), func)(loaded, checkpoint=checkpoint)
