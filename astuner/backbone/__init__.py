"""Backbones decide where the loop's stages run. Explicit registry of `module:function` entry points."""

from __future__ import annotations

import importlib

from astuner.errors import UserError

BACKBONES = {
    "debug": "astuner.backbone.debug:run",
    "verl": "astuner.backbone.verl:run",
    "trinity": "astuner.backbone.trinity:run",
}


def run_backbone(name: str, loaded, checkpoint=None, with_ray: bool = False) -> None:
    """Run backbone `name`; `with_ray` (verl, trinity): start a local Ray cluster when none is reachable."""
    if name not in BACKBONES:
        raise UserError(f"unknown backbone {name!r}; choose one of: {', '.join(sorted(BACKBONES))}")
    module_name, func = BACKBONES[name].split(":")
    extra = {} if name == "debug" else {"start_ray": with_ray}
    getattr(importlib.import_module(module_name), func)(loaded, checkpoint=checkpoint, **extra)
