"""Backbones decide where the loop's stages run. Their registry is config/backbones.py: one record each, with its
`module:function` entry points.

The algorithm is chosen here too: offline objectives (algorithm.type sft, dpo, orpo) read their data in one
process, so they run the loop with the offline stages (astuner/offline/run.py) in place of the debug backbone's
and are refused on the Ray backbones, which place rollouts."""

from __future__ import annotations

import importlib

from astuner.algorithm.catalog import algorithm
from astuner.config.backbones import BACKBONES, backbone, names_where
from astuner.config.schema_models import shared_trainer_group
from astuner.errors import UserError

__all__ = ["BACKBONES", "run_backbone"]


def run_backbone(name: str, loaded, checkpoint=None, with_ray: bool = False) -> None:
    """Run backbone `name`; `with_ray` (verl, trinity): start a local Ray cluster when none is reachable."""
    record = backbone(name)
    kind = algorithm(loaded.typed.astuner.trainer_common.algorithm.type)
    if kind.offline and record.offline_run is None:
        raise UserError(f"algorithm.type {kind.name} trains on offline data in one process: run it with --backbone "
                        f"{' or '.join(names_where('offline_run'))} (the {name} backbone places rollouts).")
    models = sorted(loaded.typed.astuner.models)
    if models and kind.offline:
        raise UserError(f"astuner.models ({', '.join(models)}) trains several models on rollouts; algorithm.type "
                        f"{kind.name} (offline data) trains one. Train each model in a run of its own.")
    tc = loaded.typed.astuner.trainer_common
    if models and record.on_ray and not record.explorers and tc.trainer_groups == "per_model":
        raise UserError(f"astuner.trainer_common.trainer_groups per_model gives each model a trainer group of its own "
                        f"on the {' or '.join(names_where('explorers'))} backbone; {name} colocates every model's "
                        f"engine and trainer in each worker. Use --backbone {names_where('explorers')[0]}, or "
                        "trainer_groups: one.")
    if record.on_ray and tc.strategy == "fsdp2" and shared_trainer_group(loaded.typed, name):
        raise UserError(f"astuner.trainer_common.strategy fsdp2 shards one model over the trainer workers; with "
                        f"several models (astuner.models: {', '.join(models)}) each worker holds a replica of every "
                        "model's trainer: set the strategy to ddp (or auto, which picks ddp here), or on trinity "
                        "give each model its own group (astuner.trainer_common.trainer_groups: per_model).")
    module_name, func = (record.offline_run if kind.offline else record.run).split(":")
    extra = {"start_ray": with_ray} if record.on_ray else {}
    getattr(importlib.import_module(module_name), func)(loaded, checkpoint=checkpoint, **extra)
