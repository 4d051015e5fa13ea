"""Where a run writes and what it continues from (`astuner.trainer_common.resume_mode`).

    auto     the latest complete checkpoint in experiment_dir, if any, is continued. A folder holding an earlier
             run without one is left alone: the run goes to a new folder <experiment_dir>_N.
    disable  never continue; a folder holding an earlier run is left alone and the run goes to a new folder.
    <path>   continue from that checkpoint folder (global_step_N with its astuner_resume/), writing on in
             experiment_dir.

A folder holds a run once a run saved its config there. One a live run holds (astuner/run_lock.py) is never
resumed or written into: a fresh run goes to the next free `<experiment_dir>_N`, a resume of it is refused naming
the live run's PID.

A checkpoint is complete when `global_step_N/astuner_resume/state.json` exists: the trainer writes it last, inside
a temporary folder that is renamed into place, so a run killed at any moment never leaves a half checkpoint that
looks complete. A run never appends silently to another run's metrics or tensorboard: a resumed run first cuts
them back to the checkpoint's step (`Monitor(resume_step=...)`).

A resume first compares this run's config with the one the checkpoint was trained with (`config.yaml` beside it,
or the `config.resumed_<s>.yaml` of the resumed run that wrote it): a change to the model, the data, the rollout
shape, the reward or the algorithm refuses (the table: `astuner.config.resume_keys`); allowed changes (the run's
length, logging, checkpoint and validation frequency, placement, deadlines) are named. The resumed run saves its
own config as `config.resumed_<step>.yaml`, so the checkpoint's stays as it was.
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass
from pathlib import Path

from astuner.errors import UserError
from astuner.run_lock import busy, live_holder

RESUME_DIR = "astuner_resume"  # inside a checkpoint folder: what a resumed run needs beyond the HF weights
_STEP_DIR = re.compile(r"global_step_(\d+)$")
_RESUMED_CONFIG = re.compile(r"config\.resumed_(\d+)\.yaml$")
# The header lines of a saved config (config/compose.save_config) that say where its relative paths start.
COMPOSED_FROM, WORKING_DIR = "# Composed by astuner from ", "# Working directory: "


@dataclass(frozen=True)
class RunStart:
    loaded: object  # LoadedConfig, with experiment_dir possibly moved to a fresh folder
    checkpoint: Path | None  # the checkpoint to continue from, or None
    message: str  # what was decided, for the console
    note: str | None = None  # the allowed config changes a resume carries (or why none were checked)

    @property
    def resumed_step(self) -> int | None:
        return None if self.checkpoint is None else step_of(self.checkpoint)


def is_complete(checkpoint: Path) -> bool:
    return (checkpoint / RESUME_DIR / "state.json").is_file()


def step_of(checkpoint: Path) -> int:
    match = _STEP_DIR.match(checkpoint.name)
    return int(match.group(1)) if match else int(read_run_state(checkpoint).get("step", 0))


def read_run_state(checkpoint: Path) -> dict:
    """The run state a complete checkpoint holds (RESUME_DIR/state.json)."""
    return json.loads((Path(checkpoint) / RESUME_DIR / "state.json").read_text(encoding="utf-8"))


def write_run_state(folder: Path, run_state: dict) -> None:
    """RESUME_DIR/state.json in `folder`; written last, its presence marks the checkpoint complete."""
    (Path(folder) / RESUME_DIR).mkdir(parents=True, exist_ok=True)
    (Path(folder) / RESUME_DIR / "state.json").write_text(json.dumps(run_state, indent=1), encoding="utf-8")


def checkpoint_models(checkpoint: Path) -> list[str]:
    """The models a checkpoint of several models holds (its subfolders that are complete checkpoints themselves),
    by name; [] for a one-model checkpoint or a plain model folder."""
    checkpoint = Path(checkpoint)
    return sorted(p.name for p in checkpoint.iterdir() if p.is_dir() and is_complete(p)) if checkpoint.is_dir() else []


def checkpoint_config(checkpoint: Path) -> Path | None:
    """The config `checkpoint` was trained with: that of the latest run in its folder that started before it."""
    step = step_of(checkpoint)
    resumed = [(int(m.group(1)), p) for p in checkpoint.parent.glob("config.resumed_*.yaml")
               if (m := _RESUMED_CONFIG.match(p.name)) and int(m.group(1)) < step]
    if resumed:
        return max(resumed)[1]
    first = checkpoint.parent / "config.yaml"
    return first if first.is_file() else None


def check_resume(loaded, checkpoint: Path) -> str | None:
    """Refuse (UserError) to continue `checkpoint` under a config that changes what it was trained with;
    returns the line naming the allowed changes, or None when there are none."""
    # Deferred: the trainer's workers import this module for RESUME_DIR and need no config machinery.
    import yaml
    from omegaconf import OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    from astuner.config.resume_keys import Bases, config_changes, flatten
    from astuner.config.validate import default_tree

    saved = checkpoint_config(checkpoint)
    if saved is None:
        return f"no config.yaml beside {checkpoint} to compare this run's config with; resuming unchecked"
    try:
        old = OmegaConf.to_container(OmegaConf.load(saved), resolve=False)
    except (OSError, ValueError, yaml.YAMLError, OmegaConfBaseException) as exc:
        old = exc
    if not isinstance(old, dict):
        raise UserError(f"cannot read {saved}, the config {checkpoint} was trained with ({old}); restore it, or "
                        "set astuner.trainer_common.resume_mode=disable to start a fresh run.")
    new_bases = Bases(Path.cwd(), loaded.config_dir)
    changes = config_changes(old, OmegaConf.to_container(loaded.cfg, resolve=True), flatten(default_tree()),
                             bases=(saved_bases(saved, new_bases), new_bases))
    changes = [dataclasses.replace(c, default_changed=_at_default_unset(loaded, c.key, c.new)) for c in changes]
    refused = [c for c in changes if not c.allowed]
    if refused:
        back = "set the keys named above back" if not all(c.default_changed for c in refused) else (
            "set the old defaults named above")
        raise UserError(
            f"resume refused: this run's config changes what {checkpoint} was trained with ({saved}): "
            f"{'; '.join(map(str, refused))}. Continuing it would report one run under another's config. To start "
            f"fresh, set another astuner.experiment_dir (e.g. {fresh_folder(loaded.experiment_dir)}; rerunning "
            f"that command then resumes the new run). To continue {checkpoint.name}, {back} (with "
            f"astuner.trainer_common.resume_mode={checkpoint} it continues into another experiment_dir)."
        )
    if not changes:
        return None
    return f"resuming with allowed config changes: {'; '.join(map(str, changes))}"


def saved_bases(saved: Path, fallback):
    """Where the run that wrote `saved` resolved relative paths, from the header `save_config` writes; a config
    without that header (an older astuner) is taken to have run from this run's folders."""
    from astuner.config.resume_keys import Bases

    head = dict(cwd=fallback.cwd, yaml_dir=fallback.yaml_dir)
    with saved.open(encoding="utf-8", errors="replace") as lines:
        for line in lines:
            if not line.startswith("#"):
                break
            if line.startswith(COMPOSED_FROM):
                head["yaml_dir"] = Path(line[len(COMPOSED_FROM):].strip()).parent
            elif line.startswith(WORKING_DIR):
                head["cwd"] = Path(line[len(WORKING_DIR):].strip())
    return Bases(**head)


def _at_default_unset(loaded, key: str, value) -> bool:
    """This run neither set `key` nor any section above it, and runs it at its default."""
    from astuner.config.validate import default_at

    parts = key.split(".")
    if any(".".join(parts[:i]) in loaded.user_keys for i in range(1, len(parts) + 1)):
        return False
    found, default = default_at(key)
    return found and default == value


def latest_checkpoint(experiment_dir: Path) -> Path | None:
    found = []
    for child in experiment_dir.glob("global_step_*"):
        match = _STEP_DIR.match(child.name)
        if match and child.is_dir() and is_complete(child):
            found.append((int(match.group(1)), child))
    return max(found)[1] if found else None


def has_results(experiment_dir: Path) -> bool:
    """Metrics, a checkpoint or tensorboard events: what a run's first step leaves."""
    metrics = experiment_dir / "metrics.jsonl"
    return (metrics.is_file() and metrics.stat().st_size > 0) or any(experiment_dir.glob("global_step_*")) or any(
        (experiment_dir / "tensorboard").glob("events.*")
    )


def holds_a_run(experiment_dir: Path) -> bool:
    """A run's results, its saved config (a run that has not finished a step yet, or was killed before one), or a
    live run's lock (astuner/run_lock.py)."""
    return (has_results(experiment_dir) or (experiment_dir / "config.yaml").is_file()
            or live_holder(experiment_dir) is not None)


def fresh_folder(experiment_dir: Path) -> Path:
    n = 1
    while True:
        candidate = experiment_dir.with_name(f"{experiment_dir.name}_{n}")
        if not candidate.exists() or not holds_a_run(candidate):
            return candidate
        n += 1


def _refuse_live(out: Path) -> None:
    """A run's folder that a live run writes is neither resumed nor written into (astuner/run_lock.py)."""
    holder = live_holder(out)
    if holder is not None:
        raise busy(out, holder)


def plan_start(loaded) -> RunStart:
    """Where this run writes and what it continues from. The run then takes its folder with
    astuner.run_lock.claim, which refuses a folder another run took in between."""
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
        path = path.resolve()
        _refuse_live(out)
        return RunStart(loaded, path, f"resuming from {path} (resume_mode is a path)", check_resume(loaded, path))
    if mode == "auto":
        checkpoint = latest_checkpoint(out) if out.is_dir() else None
        if checkpoint is not None:
            _refuse_live(out)
            return RunStart(loaded, checkpoint, f"resuming from {checkpoint} (resume_mode auto)",
                            check_resume(loaded, checkpoint))
    if out.is_dir() and holds_a_run(out):
        new = fresh_folder(out)
        holder = live_holder(out)
        why = ("has no complete checkpoint to resume" if mode == "auto" else "holds a run and resume_mode is disable"
               ) if holder is None else f"is in use by a live run ({holder})"
        moved = dataclasses.replace(loaded, experiment_dir=new)
        return RunStart(moved, None, f"{out} {why}; starting a fresh run in {new}")
    return RunStart(loaded, None, f"starting a fresh run in {out}")
