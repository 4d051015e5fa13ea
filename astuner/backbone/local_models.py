"""Several trained models in this process (astuner.models): each with its own engine and trainer.

A step's samples are split by the model that served their call (`Sample.model`); each trainer takes one step
on its own samples only, so a call of one agent never moves another model's weights. A model that got no sample
this step takes no step. `models` is ordered as the run's `ModelSet`.

Every model of several is named alike, the first too:
- metrics: `model/<name>/<metric>` here, logged as `model/<name>/actor/<metric>` (monitor/metrics.py), with
  `num_samples` also for a model that trained on none (the pipeline's `rollout/logprob_abs_diff_*` are the
  worst model's: monitor/metrics.py);
- checkpoints: `global_step_N/<name>/` for each model (a Hugging Face folder or adapter with its own resume state)
  and `global_step_N/astuner_resume/state.json`, the run's state. The model folders are written into a staging
  folder that takes the run state last and is then renamed into place, so a checkpoint holds every model or is
  not complete at all.
A run of one model keeps a one-model run's names: unprefixed metrics, its folder at `global_step_N/`.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

from astuner.errors import UserError
from astuner.resume import read_run_state, write_run_state
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
    says. One model: its metrics as they are."""
    if len(mine) == 1:
        (name,) = mine
        return results.get(name, TrainResult({}, [None] * n))
    metrics: dict[str, float] = {}
    logprobs: list[list[float] | None] = [None] * n
    for name, where in mine.items():
        metrics[f"model/{name}/num_samples"] = float(len(where))
        if name not in results:
            continue
        for i, lp in zip(where, results[name].trainer_logprobs):
            logprobs[i] = lp
        metrics.update({f"model/{name}/{k}": v for k, v in results[name].metrics.items()})
    return TrainResult(metrics, logprobs)


def sync_models(models: dict[str, LocalModel]) -> SyncReport:
    """Every engine serves its trainer's weights: one report, verified only if every sync was."""
    return SyncReport.worst([m.sync() for m in models.values()])


def save_models(models: dict[str, LocalModel], path: Path, tokenizer, run_state: dict) -> None:
    """The checkpoint at `path` (module docstring): one model's folder, or every model's folder and the run state."""
    if len(models) == 1:
        (model,) = models.values()
        model.trainer.save_checkpoint(path, tokenizer=tokenizer, run_state=run_state)
        return
    staging = staging_folder(path)
    try:
        save_model_folders(models, staging, tokenizer, run_state["step"])
        seal_checkpoint(staging, path, run_state)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def staging_folder(path: Path) -> Path:
    """Where the model folders of the checkpoint `path` are written before it is sealed (a fresh hidden sibling)."""
    staging = path.parent / f".{path.name}.models-{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    return staging


def save_model_folders(models: dict[str, LocalModel], folder: Path, tokenizer, step: int,
                       write: bool = True) -> None:
    """Each model's weights and resume state at `folder/<name>/` (a sharded trainer's ranks all call this and
    only the one with `write` writes)."""
    for name, model in models.items():
        model.trainer.save_checkpoint(folder / name, tokenizer=tokenizer, run_state={"model": name, "step": step},
                                      write=write)


def seal_checkpoint(staging: Path, path: Path, run_state: dict) -> None:
    """`staging`, which holds every model's folder, becomes the complete checkpoint `path`: the run state written
    last (its presence marks a checkpoint complete: astuner/resume.py), then renamed into place."""
    from astuner.trainer.checkpoint import move_into_place

    write_run_state(staging, run_state)
    move_into_place(staging, path, str(os.getpid()))


def check_checkpoint_models(path: Path, names: list[str]) -> None:
    """UserError unless the checkpoint at `path` holds a folder for each of the models `names`."""
    missing = [name for name in names if not (Path(path) / name).is_dir()]
    if missing:
        raise UserError(f"checkpoint {path} holds no folder for model(s) {', '.join(missing)} of astuner.models: "
                        "it was written by a run with other models. Resume with that run's config, or start "
                        "afresh (astuner.trainer_common.resume_mode: disable).")


def load_models(models: dict[str, LocalModel], path: Path) -> dict:
    """Every model's weights, optimizer and step count from the checkpoint at `path`; the run state."""
    if len(models) == 1:
        (model,) = models.values()
        return model.trainer.load_checkpoint(path)
    check_checkpoint_models(path, list(models))
    for name, model in models.items():
        model.trainer.load_checkpoint(path / name)
    return read_run_state(path)
