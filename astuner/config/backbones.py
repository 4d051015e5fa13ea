"""The backbones, one record each: everything the config, the launcher and the planner know of a backbone.

A backbone decides where the loop's stages run (astuner/backbone/); what differs between them for the rest of
astuner is a few facts, named here once, so nothing else tests a backbone's name:

    on_ray            its stages are Ray actors: --with-ray, the placement keys (nnodes, n_gpus_per_node,
                      strategy, cpus_per_worker, actor_timeout_s) act, and the memory plan counts its processes
    explorers         its engines run in explorer actors apart from its trainers, on GPUs of their own: the
                      explorer keys (n_explorers, trinity.synchronizer, a staleness bound) act, and several models
                      may each have a trainer group of their own (trainer_groups: per_model)
    defaults_dir      its packaged defaults (default_config/<dir>/<name>_default.yaml, keys named after it)

Imports nothing heavy: `astuner --help` and the config module read it.
"""

from __future__ import annotations

from dataclasses import dataclass

from astuner.errors import UserError


@dataclass(frozen=True)
class Backbone:
    name: str
    run: str  # module:function that runs it
    on_ray: bool
    explorers: bool
    offline_run: str | None = None  # module:function for offline objectives (sft, dpo, ...); None: refused
    defaults_dir: str | None = None  # folder of its packaged defaults under default_config/; None: it has none
    defaults_header: str = ""  # the first lines of that file

    @property
    def defaults_file(self) -> str | None:
        return None if self.defaults_dir is None else f"{self.defaults_dir}/{self.name}_default.yaml"


BACKBONES: dict[str, Backbone] = {b.name: b for b in (
    Backbone("debug", "astuner.backbone.debug:run", on_ray=False, explorers=False,
             offline_run="astuner.offline.run:run"),
    Backbone("verl", "astuner.backbone.verl:run", on_ray=True, explorers=False, defaults_dir="verl",
             defaults_header="Defaults for keys named after the verl backbone. Generated from "
             "astuner/config/schema.py. The verl backbone reads its placement from astuner.trainer_common (nnodes, "
             "n_gpus_per_node, cpus_per_worker), so this section holds no keys; any key set under `verl:` is "
             "reported as unknown."),
    Backbone("trinity", "astuner.backbone.trinity:run", on_ray=True, explorers=True, defaults_dir="trinity",
             defaults_header="Defaults for keys named after the Trinity-RFT backbone: its weight syncs, and an old "
             "name kept for configs written for it. Generated from astuner/config/schema.py."),
)}


def backbone(name: str) -> Backbone:
    """The record of backbone `name`; UserError naming the backbones for another name."""
    if name not in BACKBONES:
        raise UserError(f"unknown backbone {name!r}; choose one of: {', '.join(BACKBONES)} (--backbone debug)")
    return BACKBONES[name]


def names_where(fact: str) -> tuple[str, ...]:
    """The backbones whose `fact` (a field of Backbone) holds, for messages: ("verl", "trinity")."""
    return tuple(name for name, b in BACKBONES.items() if getattr(b, fact))
