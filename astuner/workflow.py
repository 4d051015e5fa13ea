"""The user-facing workflow API and the loader for `module->Class` strings."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from astuner.types import Task

if TYPE_CHECKING:
    from astuner.model_tuner import ModelTuner


@dataclass
class WorkflowTask:
    """What a workflow receives for one episode."""

    task: Task
    repeat_index: int = 0
    episode_uid: str = ""
    is_validation: bool = False


@dataclass
class WorkflowOutput:
    """What a workflow returns. reward=None lets the configured judge score `metadata`."""

    reward: float | None = None
    is_success: bool | None = None
    metadata: dict[str, Any] = field(default_factory=dict)


class Workflow:
    """Subclass this and implement `execute`. A fresh instance runs each episode."""

    name: str = "workflow"

    def __init__(self, config: Any = None) -> None:
        self.config = config

    async def execute(self, workflow_task: WorkflowTask, model_tuner: "ModelTuner") -> WorkflowOutput:
        raise NotImplementedError


class ClassSpecError(ValueError):
    """A `module->Class` string that cannot be resolved."""


def load_class(spec: str, search_dirs: list[Path] | None = None) -> type:
    """Resolve "pkg.module->Class" or "path/to/file.py->Class".

    Module names are imported with `search_dirs` (e.g. the YAML's folder) tried first on sys.path;
    file paths are tried relative to each of `search_dirs`, then the working directory.
    """
    if not isinstance(spec, str) or "->" not in spec:
        raise ClassSpecError(f"expected 'pkg.module->Class' or 'path/file.py->Class', got {spec!r}")
    target, class_name = (part.strip() for part in spec.rsplit("->", 1))
    dirs = [Path(d).resolve() for d in (search_dirs or [])] + [Path.cwd()]
    if target.endswith(".py") or "/" in target:
        module = _load_file(target, dirs, spec)
    else:
        module = _import_module(target, dirs, spec)
    try:
        return getattr(module, class_name)
    except AttributeError:
        raise ClassSpecError(f"{spec!r}: module {module.__name__!r} has no attribute {class_name!r}") from None


def _load_file(target: str, dirs: list[Path], spec: str):
    candidates = [Path(target)] if Path(target).is_absolute() else [d / target for d in dirs]
    for path in candidates:
        if path.is_file():
            name = f"astuner_user_{abs(hash(str(path.resolve())))}"
            if name in sys.modules:
                return sys.modules[name]
            module_spec = importlib.util.spec_from_file_location(name, path)
            module = importlib.util.module_from_spec(module_spec)
            sys.path.insert(0, str(path.parent))  # lets the file import its siblings
            sys.modules[name] = module
            module_spec.loader.exec_module(module)
            return module
    raise ClassSpecError(f"{spec!r}: file {target!r} not found (looked in {', '.join(str(d) for d in dirs)})")


def _import_module(target: str, dirs: list[Path], spec: str):
    for d in reversed(dirs):
        if str(d) not in sys.path:
            sys.path.insert(0, str(d))
    try:
        return importlib.import_module(target)
    except ModuleNotFoundError as exc:
        if exc.name and target.startswith(exc.name):
            raise ClassSpecError(f"{spec!r}: no module named {target!r}") from None
        raise
