"""The warm start's dry run, kept: what it read (the tools the agent offers, the results its calls were shown) is
saved with a fingerprint of the agent, so a rerun of `astuner warmstart` for an unchanged agent skips it."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

DRY_RUN = "dry_run.json"  # {"fingerprint", "tools", "results"}


@dataclass(frozen=True)
class DryRun:
    """What a dry run read, and of which agent (agent_fingerprint)."""

    folder: Path
    fingerprint: str
    tools: list
    results: list


def agent_fingerprint(loaded) -> str:
    """What the tools an agent offers follow from: its workflow's name, the Python files beside its workflow's
    file (the agent and the modules it keeps there), and the config's rollout section. A dry run of an agent
    with the same fingerprint reads the same tools."""
    import hashlib
    import inspect

    from omegaconf import OmegaConf

    from astuner.workflow import load_user_class, workflow_spec

    digest = hashlib.sha256(str(workflow_spec(loaded.typed)).encode())
    digest.update(json.dumps(OmegaConf.to_container(loaded.cfg.astuner.rollout, resolve=True), sort_keys=True,
                             default=str).encode())
    try:
        agent = load_user_class(workflow_spec(loaded.typed), loaded.config_dir, "workflow",
                                "astuner.rollout.agentscope_workflow")
        source = Path(inspect.getsourcefile(agent) or "")
    except (TypeError, OSError):  # a workflow with no file of its own: its name and the rollout section only
        source = None
    if source is not None and source.is_file():
        for file in sorted(source.parent.glob("*.py")):
            digest.update(file.name.encode() + b"\0" + file.read_bytes())
    return digest.hexdigest()


def earlier_dry_run(base: Path, fingerprint: str) -> DryRun | None:
    """The newest dry run saved in the warm start folder `base` or a numbered `base_N` beside it (earlier warm
    starts of this config) whose agent had `fingerprint`; None when there is none."""
    siblings = [p for p in base.parent.iterdir() if p.name.startswith(base.name + "_")
                and p.name[len(base.name) + 1:].isdigit()] if base.parent.is_dir() else []
    found = []
    for candidate in [base, *siblings]:
        path = candidate / DRY_RUN
        if not path.is_file():
            continue
        try:
            saved = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        if isinstance(saved, dict) and saved.get("fingerprint") == fingerprint and saved.get("tools"):
            found.append((path.stat().st_mtime, DryRun(candidate, fingerprint, saved["tools"],
                                                       list(saved.get("results") or []))))
    return max(found, key=lambda f: f[0])[1] if found else None


def save_dry_run(folder: Path, dry: DryRun) -> None:
    (folder / DRY_RUN).write_text(json.dumps({"fingerprint": dry.fingerprint, "tools": dry.tools,
                                              "results": dry.results}, indent=2, ensure_ascii=False) + "\n",
                                  encoding="utf-8")
