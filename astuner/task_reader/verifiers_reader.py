"""`verifiers`: an environment of Prime Intellect's verifiers (v1, https://github.com/PrimeIntellect-ai/verifiers),
loaded as verifiers loads it, its tasks astuner's (astuner/environments/verifiers_env.py plays them).

The environment is named by its taskset id, the module verifiers imports (`env_id`; `env_dir`, relative to the
YAML's folder, is put on the import path first, for a package of your own), with the taskset's config keys in
`env_args` and the agent's (its harness, turn and token caps) in `agent`. The agent runs with verifiers' local
`subprocess` runtime unless `agent.runtime` says otherwise (verifiers' default is a remote sandbox).
Training tasks are the taskset's first `size` (null: all but the validation ones), validation tasks the
`validation_size` after them. A task keeps its recipe (the environment's config and the task's index), so any
process loads the same environment and task. The reader loads the environment once at start: a missing package,
an unknown id or a config the taskset refuses stops the run there (exit 2).
"""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path
from typing import Any

from astuner.errors import UserError
from astuner.task_reader.base import TaskReader
from astuner.types import Task

SECTION = "astuner.task_reader.verifiers"
RECIPE_KEY = "verifiers"  # Task.metadata[RECIPE_KEY]: {"config": <verifiers env config>, "env_dir", "index"}
LOCAL_RUNTIME = {"type": "subprocess"}


def import_verifiers():
    if sys.version_info < (3, 11):
        raise UserError("task_reader.type verifiers needs Python 3.11 or newer (verifiers 0.4 does), in an "
                        "environment of its own: verifiers pins mcp==2.0.0, which AgentScope 1.x refuses.")
    try:
        import verifiers.v1 as vf
    except ModuleNotFoundError as exc:
        raise UserError(f"task_reader.type verifiers needs the verifiers package ({exc}): pip install "
                        "'astuner[verifiers]' (verifiers==0.4.0) in an environment without AgentScope 1.x (it pins "
                        "mcp==2.0.0, which AgentScope 1.x refuses); scripts/setup_env.sh --test builds one, "
                        ".venv-vf.") from None
    return vf


def env_config(section: Any) -> dict[str, Any]:
    """The verifiers environment config of the section: {"taskset": {"id", ...env_args}, "agent": {...}}."""
    agent = {"runtime": dict(LOCAL_RUNTIME), **dict(section.agent)}
    return {"taskset": {"id": section.env_id, **dict(section.env_args)}, "agent": agent}


def load(config: dict[str, Any], env_dir: str | None):
    """(the environment, its tasks) for a config, once per process."""
    return _load(json.dumps(config, sort_keys=True), env_dir)


@functools.lru_cache(maxsize=8)
def _load(config_json: str, env_dir: str | None):
    vf = import_verifiers()
    if env_dir and env_dir not in sys.path:
        sys.path.insert(0, env_dir)
    config = json.loads(config_json)
    try:
        env = vf.load_environment(vf.resolve_env_config(config))
        tasks = list(env.taskset)
    except (ModuleNotFoundError, ImportError) as exc:
        raise UserError(f"{SECTION}.env_id={config['taskset']['id']!r}: verifiers could not import it ({exc}); "
                        "name an installed taskset module, or set env_dir to the folder that holds yours.") from None
    except (TypeError, ValueError) as exc:  # pydantic's ValidationError is a ValueError
        raise UserError(f"{SECTION}: verifiers refused the environment {config['taskset']['id']!r}: "
                        f"{' '.join(str(exc).split())[:600]}") from None
    return env, tasks


class VerifiersTaskReader(TaskReader):
    def __init__(self, reader_cfg: Any, base_dir: Path) -> None:
        super().__init__(reader_cfg, base_dir)
        self.section = reader_cfg.verifiers
        self.env_dir = self._env_dir()
        self.config = env_config(self.section)
        _env, tasks = load(self.config, self.env_dir)  # before any weights load
        self.total = len(tasks)
        held = self.section.validation_size
        size = self.total - held if self.section.size is None else self.section.size
        if size < 1 or size + held > self.total:
            raise UserError(f"{SECTION}: the taskset {self.section.env_id!r} has {self.total} tasks; size "
                            f"{self.section.size} and validation_size {held} ask for {size + held}.")
        self.size = size

    def _env_dir(self) -> str | None:
        if self.section.env_dir is None:
            return None
        folder = Path(self.section.env_dir)
        if not folder.is_absolute():
            folder = next((d / folder for d in (self.base_dir, Path.cwd()) if (d / folder).is_dir()),
                          self.base_dir / folder)
        if not folder.is_dir():
            raise UserError(f"{SECTION}.env_dir={self.section.env_dir!r}: no such folder in {self.base_dir} or "
                            f"{Path.cwd()}.")
        return str(folder.resolve())

    def _tasks(self, split: str, indices: range) -> list[Task]:
        _env, tasks = load(self.config, self.env_dir)
        out = []
        for n, index in enumerate(indices):
            data = tasks[index].data
            prompt = data.prompt if isinstance(data.prompt, str) else json.dumps(data.prompt, default=str)
            out.append(Task(task_id=f"{split}-{n}", main_query=str(prompt or data.name or index), metadata={
                RECIPE_KEY: {"config": self.config, "env_dir": self.env_dir, "index": index}}))
        return out

    def training_tasks(self) -> list[Task]:
        return self._cached("train", lambda: self._tasks("train", range(self.size)))

    def validation_tasks(self) -> list[Task]:
        held = self.section.validation_size
        return self._cached("validation", lambda: self._tasks("validation", range(self.size, self.size + held)))
