"""`openenv`: an OpenEnv environment (https://github.com/meta-pytorch/OpenEnv) served from the user's package on
this machine, one task per reset seed (astuner/environments/openenv.py plays it).

Training: episodes reset with seeds `seed .. seed + size - 1` (null seed: astuner.seed); validation:
`validation_size` more under other seeds. A task keeps its recipe (the app, its folder, the seed and reset
arguments, the turn cap), so any process can serve and reset the very same episode. The app is named as
OpenEnv's own `openenv.yaml` names it ("module:attribute", e.g. `server.app:app`), imported from `app_dir` (the
YAML's folder when relative); with `app` null, `app_dir/openenv.yaml`'s `app:` line. The reader starts the app once
at start: a missing package, an app that does not import or does not answer stops the run there (exit 2), with the
server's own output.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from astuner.errors import UserError
from astuner.task_reader.base import SeededTaskReader
from astuner.types import Task

SECTION = "astuner.task_reader.openenv"
RECIPE_KEY = "openenv"  # Task.metadata[RECIPE_KEY]: {"app", "app_dir", "seed", "reset_kwargs", "max_turns", ...}


def import_openenv():
    try:
        import openenv.core
    except ModuleNotFoundError as exc:
        raise UserError(f"task_reader.type openenv needs the openenv package ({exc}): pip install "
                        "'astuner[openenv]' (or pip install openenv==0.10.0) in this environment.") from None
    return openenv.core


def log_dir() -> Path:
    """Where this process's environment servers write their output."""
    import os

    return Path(tempfile.gettempdir()) / f"astuner-openenv-{os.getpid()}"


def app_of(section: Any, base_dir: Path) -> tuple[str, str]:
    """(app, absolute app_dir) of the section; UserError naming the key when either is missing."""
    folder = Path(section.app_dir or ".")
    if not folder.is_absolute():
        folder = next((d / folder for d in (base_dir, Path.cwd()) if (d / folder).is_dir()), base_dir / folder)
    if not folder.is_dir():
        raise UserError(f"{SECTION}.app_dir={section.app_dir!r}: no such folder in {base_dir} or {Path.cwd()}.")
    app = section.app
    if app is None:
        manifest = folder / "openenv.yaml"
        if not manifest.is_file():
            raise UserError(f"{SECTION}.app is null and {manifest} does not exist: name the environment's app "
                            "('module:attribute', e.g. server.app:app) or point app_dir at its package.")
        import yaml

        app = (yaml.safe_load(manifest.read_text()) or {}).get("app")
        if not app:
            raise UserError(f"{manifest} names no app (its 'app:' line); set {SECTION}.app.")
    if ":" not in str(app):
        raise UserError(f"{SECTION}.app={app!r}: give 'module:attribute', the app as uvicorn imports it.")
    return str(app), str(folder.resolve())


def check_app(app: str, app_dir: str) -> None:
    """Start the app once and stop it: UserError quoting its output when it does not come up."""
    from astuner.environments.openenv_servers import AppSpec, LocalServer

    server = LocalServer(AppSpec(app, app_dir), log_dir() / "check.log")
    try:
        server.start()
    except RuntimeError as exc:
        raise UserError(f"{SECTION}: {exc}") from None
    finally:
        server.stop()


class OpenEnvTaskReader(SeededTaskReader):
    def __init__(self, reader_cfg: Any, base_dir: Path) -> None:
        super().__init__(reader_cfg, base_dir)
        self.section = reader_cfg.openenv
        import_openenv()
        self.app, self.app_dir = app_of(self.section, self.base_dir)
        check_app(self.app, self.app_dir)  # before any weights load

    def _recipe(self, seed: int) -> dict[str, Any]:
        s = self.section
        return {"app": self.app, "app_dir": self.app_dir, "seed": seed, "reset_kwargs": dict(s.reset_kwargs),
                "max_turns": s.max_turns, "system_prompt": s.system_prompt, "action_field": s.action_field,
                "servers": s.servers, "sessions_per_server": s.sessions_per_server}

    def _tasks(self, split: str, size: int, first_seed: int) -> list[Task]:
        return [Task(task_id=f"{split}-{i}", main_query=f"{self.app} (seed {first_seed + i})",
                     metadata={RECIPE_KEY: self._recipe(first_seed + i)}) for i in range(size)]
