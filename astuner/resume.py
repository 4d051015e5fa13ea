"""Where a run writes and what it continues from (`astuner.trainer_common.resume_mode`).

    auto     the latest complete checkpoint in experiment_dir, if any, is continued. A folder holding an earlier
             run without one is left alone: the run goes to a new folder <experiment_dir>_N.
    disable  never continue; a folder holding an earlier run is left alone and the run goes to a new folder.
    <path>   continue from that checkpoint folder (global_step_N with its astuner_resume/), writing on in
             experiment_dir.

A checkpoint is complete when `global_step_N/astuner_resume/state.json` exists: the trainer writes it last, inside
a temporary folder that is renamed into place, so a run killed at any moment never leaves a half checkpoint that
looks complete. A run never appends silently to another run's metrics or tensorboard: a resumed run first cuts
them back to the checkpoint's step (`Monitor(resume_step=...)`).
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from pathlib import Path

from astuner.errors import UserError

RESUME_DIR = "astuner_resume"  # inside a checkpoint folder: what a resumed run needs beyond the HF weights
_STEP_DIR = re.compile(r"global_step_(\d+)$")


@dataclass(frozen=True)
class RunStart:
    loaded: object  # LoadedConfig, with experiment_dir possibly moved to a fresh folder
    checkpoint: Path | None  # the checkpoint to continue from, or None
    message: str  # what was decided, for the console


def is_complete(checkpoint: Path) -> bool:
    return (checkpoint / RESUME_DIR / "state.json").is_file()


def latest_checkpoint(experiment_dir: Path) -> Path | None:
    found = []
    for child in experiment_dir.glob("global_step_*"):
        match = _STEP_DIR.match(child.name)
        if match and child.is_dir() and is_complete(child):
            found.append((int(match.group(1)), child))
    return max(found)[1] if found else None


def holds_a_run(experiment_dir: Path) -> bool:
    metrics = experiment_dir / "metrics.jsonl"
    return (metrics.is_file() and metrics.stat().st_size > 0) or any(experiment_dir.glob("global_step_*")) or any(
        (experiment_dir / "tensorboard").glob("events.*")
    )


def fresh_folder(experiment_dir: Path) -> Path:
    n = 1
    while True:
        candidate = experiment_dir.with_name(f"{experiment_dir.name}_{n}")
        if not candidate.exists() or not holds_a_run(candidate):
            return candidate
        n += 1


def plan_start(loaded) -> RunStart:
    mode = loaded.typed.astuner.trainer_common.resume_mode
    out = loaded.experiment_dir
    if mode not in ("auto", "disable"):
        path = Path(mode).expanduser()
        if not path.is_absolute():
            path = (loaded.config_dir / path) if (loaded.config_dir / path).exists() else Path.cwd() / path
        if not path.is_dir() or not is_complete(path):
            raise UserError(
                f"astuner.trainer_common.resume_mode={mode!r}: {path} is not a complete astuner checkpoint (a "
                f"global_step_N folder holding {RESUME_DIR}/state.json). Use auto, disable, or such a folder."
            )
        return RunStart(loaded, path.resolve(), f"resuming from {path.resolve()} (resume_mode is a path)")
    if mode == "auto":
        checkpoint = latest_checkpoint(out) if out.is_dir() else None
        if checkpoint is not None:
            return RunStart(loaded, checkpoint, f"resuming from {checkpoint} (resume_mode auto)")
    if out.is_dir() and holds_a_run(out):
        new = fresh_folder(out)
        why = "has no complete checkpoint to resume" if mode == "auto" else "holds a run and resume_mode is disable"
        moved = dataclasses.replace(loaded, experiment_dir=new)
        return RunStart(moved, None, f"{out} {why}; starting a fresh run in {new}")
    return RunStart(loaded, None, f"starting a fresh run in {out}")
