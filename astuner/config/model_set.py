"""The run's models as one set of equal records, resolved once from the config.

    astuner.model              the first model, named `policy`: it serves every agent astuner.agents does not list
    astuner.models.<name>      every other model, in the YAML's order

Each `ModelSpec` has every default applied (its LoRA rank, learning rate and sampling are its own where it sets
them, else the run's). Models whose folder is the first model's, all training LoRA adapters, are adapters on one
shared base (`ModelSpec.adapter`): one engine serves them and one copy of the frozen base is held per process.
A run of one model is a set of one. Backbones, serve, eval, preflight and the doctor build their models from the
set, and none tells the first model apart by its name (only the config's own checks read astuner.models).

Imports nothing heavy (the config module's rule); folders are resolved by the caller (`runtime.model_set`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Iterator

from astuner.config.schema_models import POLICY


@dataclass(frozen=True)
class LoraSettings:
    """LoRA adapters (astuner/trainer/lora.py): rank 0 trains the full model."""

    rank: int
    alpha: float
    dropout: float
    target_modules: tuple[str, ...] | str

    @property
    def enabled(self) -> bool:
        return self.rank > 0


@dataclass(frozen=True)
class ModelSpec:
    name: str
    key: str  # where the config sets it: astuner.model or astuner.models.<name>
    path: str  # as the YAML writes it
    folder: str  # the local folder it resolves to (the path itself until resolved)
    lora_rank: int  # 0: full fine-tuning
    lr: float
    temperature: float  # of its calls in training rollouts (validation is greedy)
    top_p: float
    top_k: int
    # (temperature, top_p, top_k) the model sets itself, None where the rollout's applies: a call's own request
    # may still override the rollout's temperature, never the model's own (model_tuner/completion.py)
    own_sampling: tuple = (None, None, None)
    adapter: bool = False  # a LoRA adapter on the base the set's first model trains, sharing its engine
    lora: LoraSettings | None = None  # at lora_rank, trainer_common.lora's other settings; None at rank 0


@dataclass(frozen=True)
class ModelSet:
    models: tuple[ModelSpec, ...]

    def __iter__(self) -> Iterator[ModelSpec]:
        return iter(self.models)

    def __len__(self) -> int:
        return len(self.models)

    def __getitem__(self, name: str) -> ModelSpec:
        for spec in self.models:
            if spec.name == name:
                return spec
        raise KeyError(f"no model {name!r} in this run; its models are {', '.join(self.names)}")

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(spec.name for spec in self.models)

    @property
    def first(self) -> ModelSpec:
        """The model of astuner.model: the one agents not listed in astuner.agents call."""
        return self.models[0]

    @property
    def adapters(self) -> tuple[str, ...]:
        """The models served as LoRA adapters on one shared base (the first model among them), or none."""
        return tuple(spec.name for spec in self.models if spec.adapter)

    @property
    def engines(self) -> int:
        """How many engines serve the set: one for the shared base's adapters, one for every other model."""
        shared = [spec for spec in self.models if spec.adapter]
        return len(self.models) - len(shared) + bool(shared)

    def only(self, names) -> "ModelSet":
        """The models of `names` (None: all), in the set's order."""
        return self if names is None else ModelSet(tuple(s for s in self.models if s.name in names))

    def resolved(self, resolve: Callable[[ModelSpec], str]) -> "ModelSet":
        """The set with every folder `resolve(spec)` (a hub id or checkpoint to its local folder) and the shared
        base found among the resolved folders."""
        return _mark_adapters(tuple(replace(s, folder=resolve(s)) for s in self.models))


def model_set(typed) -> ModelSet:
    """The config's models with their defaults applied; folders as written (`ModelSet.resolved` resolves them)."""
    a = typed.astuner
    r, lora, lr = a.rollout, a.trainer_common.lora, a.trainer_common.optim.lr

    def spec(name: str, key: str, path, entry) -> ModelSpec:
        own = tuple(None if entry is None else getattr(entry, k) for k in ("temperature", "top_p", "top_k"))
        rank = lora.rank if entry is None or entry.lora_rank is None else entry.lora_rank
        own_lr = None if entry is None else entry.lr
        return ModelSpec(name, key, str(path), str(path), rank, lr if own_lr is None else own_lr,
                         *(getattr(r, k) if v is None else v for k, v in zip(("temperature", "top_p", "top_k"), own)),
                         own_sampling=own, lora=lora_settings(lora, rank))

    models = (spec(POLICY, "astuner.model", a.model.path, None),
              *(spec(name, f"astuner.models.{name}", e.path, e) for name, e in a.models.items()))
    return _mark_adapters(models)


def lora_settings(section, rank: int) -> LoraSettings | None:
    """The `LoraSettings` of trainer_common.lora (`section`) at `rank`; None at rank 0 (full fine-tuning)."""
    if rank == 0:
        return None
    targets = section.target_modules if isinstance(section.target_modules, str) else tuple(section.target_modules)
    return LoraSettings(rank=rank, alpha=section.alpha, dropout=section.dropout, target_modules=targets)


def _mark_adapters(models: tuple[ModelSpec, ...]) -> ModelSet:
    """Adapters on one base: the first model and every other whose folder is its folder, when all train LoRA."""
    first = models[0]
    on_base = {s.name for s in models[1:] if s.lora_rank > 0 and same_folder(s.folder, first.folder)}
    if first.lora_rank == 0 or not on_base:
        on_base = set()
    else:
        on_base.add(first.name)
    return ModelSet(tuple(replace(s, adapter=s.name in on_base) for s in models))


def same_folder(a: str, b: str) -> bool:
    """Whether two model paths name one folder (however spelled: relative, through a symlink): models on one base."""
    return a == b or (Path(a).is_dir() and Path(b).is_dir() and Path(a).resolve() == Path(b).resolve())
