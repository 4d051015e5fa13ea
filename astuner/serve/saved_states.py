"""Where `astuner serve` keeps what its clients save: `tinker://<model_id>/weights/<name>` (a training client's
state) and `tinker://<model_id>/sampler_weights/<name>` (weights for samplers), as files under
`<experiment_dir>/serve/state/`, so a restarted server loads what an earlier one saved. A model's folder holds a
`tenant` file naming whose its files are; a folder without one (saved before tenants existed) is the loopback
tenant's. Another tenant's path is answered as one that does not exist (404)."""

from __future__ import annotations

import re
from pathlib import Path

from astuner.serve.futures import NotFound, RequestError
from astuner.serve.sessions import LOCAL

NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
MODEL_ID = re.compile(r"s[0-9a-f]+-[0-9a-f]+:train:[0-9]+")  # always with fullmatch: `$` takes a trailing newline
TENANT_FILE = "tenant"


class SavedStates:
    def __init__(self, state_dir: Path):
        self.state_dir = Path(state_dir)

    def path(self, model_id, kind: str, name) -> tuple[str, Path]:
        """The tinker:// path of a save and its file."""
        if not isinstance(model_id, str) or not MODEL_ID.fullmatch(model_id):
            raise RequestError(f"{model_id!r} is not a training client id of this server")
        if not isinstance(name, str) or not NAME.fullmatch(name):
            raise RequestError(f"checkpoint name {name!r}: letters, digits, '.', '_' and '-' only (up to 128)")
        return f"tinker://{model_id}/{kind}/{name}", self.state_dir / model_id.replace(":", "_") / kind / name

    def file_of(self, path: str, kind: str, tenant: str) -> Path:
        """The tenant's saved file at a tinker:// path; 404 when there is none, or it is another tenant's."""
        text = path if isinstance(path, str) else ""
        match = re.fullmatch(r"tinker://([^/]+)/(weights|sampler_weights)/([^/]+)", text)
        if match is None or match.group(2) != kind:
            raise RequestError(f"{path!r} is not a tinker://<model_id>/{kind}/<name> path of this server")
        file = self.path(match.group(1), kind, match.group(3))[1]
        if not file.exists() or tenant_of(file.parent.parent) != tenant:
            raise NotFound(f"{path}: no such {'saved state' if kind == 'weights' else 'sampler weights'} on this "
                           f"server")
        return file

    def new_file(self, model_id: str, tenant: str, kind: str, name: str) -> tuple[str, Path]:
        """Where a model saves `name`, in a folder that says whose it is."""
        uri, file = self.path(model_id, kind, name)
        file.parent.mkdir(parents=True, exist_ok=True)
        owner = file.parent.parent / TENANT_FILE
        if not owner.exists():
            owner.write_text(tenant, encoding="utf-8")
        return uri, file


def tenant_of(folder: Path) -> str:
    try:
        return (folder / TENANT_FILE).read_text(encoding="utf-8").strip()
    except FileNotFoundError:
        return LOCAL  # saved before tenants existed: a loopback server's, without keys
