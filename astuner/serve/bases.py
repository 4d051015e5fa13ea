"""The base models `astuner serve` offers over the Tinker API: the YAML's `astuner.model` and each of
`astuner.models` (the multi-model roster), one entry per model folder.

A client names one as `base_model`: by the path the YAML gives it, its local folder, the folder's name, or its
roster name (`policy` for astuner.model, the key under astuner.models). Roster entries on one folder are one base
(their adapters then share it). Each base has its tokenizer at once and its own engine (rollout.engine): on vLLM
every engine at start (they split the GPU's share), on HF from its first sampling request (astuner.model's at start),
so a model nobody samples costs no engine memory there.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Callable

from astuner.serve.futures import RequestError


@dataclass
class ServedBase:
    name: str  # what capabilities list and get_info report: the YAML's path of the model
    model_path: str  # the local folder (a demo: model resolved)
    roster: tuple[str, ...]  # its names in the YAML: `policy` and/or keys of astuner.models
    tokenizer: Any
    facts: Any  # preflight.ModelFacts: parameters, position limit
    make_engine: Callable[["ServedBase"], Any] | None = None
    engine: Any = None
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    @property
    def aliases(self) -> tuple[str, ...]:
        """Every name base_model may take for it."""
        return (self.name, self.model_path, self.model_path.rstrip("/").rsplit("/", 1)[-1], *self.roster)

    def get_engine(self):
        """The base's engine, built on first use (seconds: call it off the event loop)."""
        with self._lock:
            if self.engine is None:
                self.engine = self.make_engine(self)
            return self.engine


def served_bases(typed) -> dict[str, ServedBase]:
    """The YAML's models by served name, astuner.model first (their engines: `build_service` gives the maker)."""
    from astuner import preflight, runtime
    from astuner.config.model_set import same_folder
    from astuner.tokenizer import load_tokenizer

    bases: dict[str, ServedBase] = {}
    for spec in runtime.model_set(typed):
        same = next((b for b in bases.values() if same_folder(b.model_path, spec.folder)), None)
        if same is not None:
            same.roster += (spec.name,)
            continue
        bases[spec.path] = ServedBase(spec.path, spec.folder, (spec.name,), load_tokenizer(spec.folder),
                                      preflight.read_model_facts(spec.folder, f"{spec.key}.path"))
    return bases


def base_of(bases: dict[str, ServedBase], name: str | None) -> ServedBase:
    """The base a request names (None: astuner.model's), or a 400 that lists what is served (or, for a name two
    bases answer to, such as a folder name they share, the names that tell them apart)."""
    if name is None:
        return next(iter(bases.values()))
    named = [base for base in bases.values() if name in base.aliases]
    exact = [base for base in named if name in (base.name, base.model_path, *base.roster)]
    if len(exact) == 1 or len(named) == 1:
        return (exact or named)[0]
    if named:
        raise RequestError(f"base_model {name!r} names {len(named)} models of this server ("
                           + ", ".join(f"{b.model_path} as {b.roster[0]!r}" for b in named)
                           + "); name one by its path or its roster name")
    served = "; ".join(f"{b.name!r} (also {', '.join(repr(a) for a in dict.fromkeys(b.aliases[1:]))})"
                       for b in bases.values())
    raise RequestError(f"base_model {name!r} is not served here; this server serves {served} (astuner.model and "
                       f"astuner.models of its YAML)")


def base_of_file(bases: dict[str, ServedBase], file) -> ServedBase:
    """The base a sampler weights file was saved from (its metadata; a file without it is astuner.model's)."""
    from safetensors import safe_open

    with safe_open(str(file), "pt") as f:
        name = (f.metadata() or {}).get("base_model")
    return base_of(bases, name)
