"""Several trained models in this process (astuner.models): each with its own engine and trainer.

A step's samples are split by the model that served their call (`Sample.model`); each trainer takes one step
on its own samples only, so a call of one agent never moves another model's weights. A model that got no sample
this step takes no step. `models` is ordered as the run's `ModelSet`: the first is astuner.model's.
Metrics: the first model's keep their usual names (every curve and alarm of a one-model run reads them); another
model's are named `model/<name>/<metric>` here, logged as `model/<name>/actor/<metric>` (monitor/metrics.py), with
`num_samples` also when it trained on none.

Checkpoints: the first model's folder is `global_step_N/` as in a one-model run; each other model's is
`global_step_N/<name>/` (a Hugging Face folder or adapter with its own resume state). They are written first,
into a staging folder, and moved into the first model's folder before it is marked complete, so a checkpoint
holds every model or is not complete at all.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

from astuner.errors import UserError
from astuner.run_models import LocalModel
from astuner.types import Sample, SyncReport, TrainResult

log = logging.getLogger(__name__)


def train_models(models: dict[str, LocalModel], samples: list[Sample], objective) -> TrainResult:
    """One step of every model that has samples, on its samples only; their metrics in one dict (module
    docstring) and the trainers' logprobs in the order of `samples`."""
    mine = samples_by_model(samples, list(models))
    results = {name: models[name].trainer.train([samples[i] for i in where], objective=objective)
               for name, where in mine.items() if where}
    return merge_model_results(results, mine, len(samples))


def samples_by_model(samples: list[Sample], models: list[str]) -> dict[str, list[int]]:
    """The indices of each model's samples; RuntimeError for a sample of a model not in `models`."""
    unknown = sorted({s.model for s in samples} - set(models))
    if unknown:  # the roster and the stages are built from one config: this is a bug, not a user error
        raise RuntimeError(f"samples of models {unknown} that this run does not train ({', '.join(models)})")
    return {name: [i for i, s in enumerate(samples) if s.model == name] for name in models}


def merge_model_results(results: dict[str, TrainResult], mine: dict[str, list[int]], n: int) -> TrainResult:
    """One TrainResult of the steps of several models: `results` by model (the trainers' logprobs in the order of
    that model's samples, whose places among the `n` samples are `mine`); metrics named as the module docstring
    says, with every other model's `num_samples` (0 for one that took no step)."""
    metrics: dict[str, float] = {}
    logprobs: list[list[float] | None] = [None] * n
    for at, (name, where) in enumerate(mine.items()):
        prefix = f"model/{name}/" if at else ""  # the first model's under their one-model names
        if at:
            metrics[f"{prefix}num_samples"] = float(len(where))
        if name not in results:
            continue
        for i, lp in zip(where, results[name].trainer_logprobs):
            logprobs[i] = lp
        metrics.update({prefix + k: v for k, v in results[name].metrics.items()})
    return TrainResult(metrics, logprobs)


def sync_models(models: dict[str, LocalModel]) -> SyncReport:
    """Every engine serves its trainer's weights: one report, verified only if every sync was."""
    return SyncReport.worst([m.sync() for m in models.values()])


def save_models(models: dict[str, LocalModel], path: Path, tokenizer, run_state: dict) -> None:
    """The checkpoint at `path`: every other model first, into a staging folder, then the first model's folder,
    which takes them in before it is marked complete (module docstring)."""
    first, *names = models
    others = {name: models[name] for name in names}
    staging = path.parent / f".{path.name}.models-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    try:
        for name, model in others.items():
            model.trainer.save_checkpoint(staging / name, tokenizer=tokenizer,
                                          run_state={"model": name, "step": run_state.get("step", 0)})
        models[first].trainer.save_checkpoint(path, tokenizer=tokenizer, run_state=run_state,
                                              include={name: staging / name for name in others})
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def checkpoint_models(path: Path) -> list[str]:
    """The other models a checkpoint holds (its subfolders with weights and resume state), by name."""
    from astuner.resume import RESUME_DIR

    return sorted(p.name for p in Path(path).iterdir() if p.is_dir() and (p / RESUME_DIR / "state.json").is_file())


def check_checkpoint_models(path: Path, names: list[str]) -> None:
    """UserError unless the checkpoint at `path` holds a folder for each of the other models `names`."""
    missing = [name for name in names if not (Path(path) / name).is_dir()]
    if missing:
        raise UserError(f"checkpoint {path} holds no folder for model(s) {', '.join(missing)} of astuner.models: "
                        "it was written by a run with other models. Resume with that run's config, or start "
                        "afresh (astuner.trainer_common.resume_mode: disable).")


def load_models(models: dict[str, LocalModel], path: Path) -> dict:
    """Every model's weights, optimizer and step count from the checkpoint at `path`; the first model's run
    state."""
    first, *others = models
    check_checkpoint_models(path, others)
    state = models[first].trainer.load_checkpoint(path)
    for name in others:
        models[name].trainer.load_checkpoint(path / name)
    return state
