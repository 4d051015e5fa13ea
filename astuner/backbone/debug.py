"""The debug backbone: the whole loop in one process, no Ray. Breakpoints in workflows and judges work,
and unlike a dry run it really trains: the same loop, trainer and engine interface as the cluster backbones."""

from __future__ import annotations

import logging
from pathlib import Path

from astuner.backbone.local_models import LocalModel, load_models, save_models, sync_models, train_models
from astuner.config.schema_models import POLICY
from astuner.heap import release_freed_memory
from astuner.loop import LoopSettings, RunSummary, count_steps, drive
from astuner.stages import LocalTrainerStages
from astuner.types import Episode, Sample, SyncReport, Task, TrainResult

log = logging.getLogger(__name__)


class InProcessStages(LocalTrainerStages):
    """Every stage in this process: the engine and trainer hold separate copies of the weights. `models`: every
    trained model by name (run_models.build_models; default: the policy's `engine` and `trainer` alone)."""

    def __init__(self, runner, trainer, engine, experiment_dir: Path, tokenizer,
                 models: dict[str, LocalModel] | None = None) -> None:
        self.runner, self.trainer, self.engine = runner, trainer, engine
        self.experiment_dir, self.tokenizer = experiment_dir, tokenizer
        self.version = 0  # trainer steps behind the engine's weights: always the last one here
        self.models = models or {POLICY: LocalModel(engine, trainer)}

    def rollout(self, tasks: list[Task], validation: bool, step: int = 0, progress=None) -> list[Episode]:
        return self._run(tasks, validation, step, progress)

    def rollout_sampled(self, tasks: list[Task], step: int, repeats: int, progress=None) -> list[Episode]:
        return self._run(tasks, True, step, progress, repeats)

    def _run(self, tasks: list[Task], validation: bool, step: int, progress, repeats: int | None = None
             ) -> list[Episode]:
        try:
            if progress is None:
                episodes = self.runner.run(tasks, validation=validation, step=step, sampled_repeats=repeats)
            else:
                total = len(tasks) * ((repeats or 1) if validation else self.runner.settings.num_repeat)
                with progress("validation" if validation else "rollout", total) as bar:
                    episodes = self.runner.run(tasks, validation=validation, step=step,
                                               sampled_repeats=repeats, on_episode_done=lambda _: bar.update(1))
        finally:
            release_freed_memory()
        for e in episodes:
            e.policy_version = self.version
        return episodes

    def train(self, samples: list[Sample], objective: str = "policy") -> TrainResult:
        for model in self.models.values():
            model.engine.sleep()  # vLLM on a shared GPU frees its memory for the step; the sync wakes it
        try:
            if len(self.models) == 1:
                return self.trainer.train(samples, objective=objective)
            return train_models(self.models, samples, objective)
        finally:
            release_freed_memory()

    def sync_weights(self) -> SyncReport:
        report = sync_models(self.models)
        self.version += 1
        return report

    def save_checkpoint(self, step: int, run_state: dict) -> Path:
        path = self.experiment_dir / f"global_step_{step}"
        save_models(self.models, path, self.tokenizer, run_state)
        log.info("saved checkpoint %s", path)
        return path

    def load_checkpoint(self, path: Path) -> dict:
        return load_models(self.models, path)

    def resumed(self, step: int) -> None:
        sync_models(self.models)
        self.version = step

    def shutdown(self) -> None:
        self.runner.close()
        for model in self.models.values():
            model.engine.shutdown()


def run(loaded, checkpoint: Path | None = None) -> RunSummary:
    """The whole run in this process; `checkpoint`: a complete checkpoint to continue from (see astuner.resume)."""
    from astuner.logs import setup_logging
    from astuner.config.derived import resolve_engine_name
    from astuner.run_models import build_runtime, distinct_engines

    setup_logging(loaded.experiment_dir)
    settings = LoopSettings.from_config(loaded.typed)
    rt = build_runtime(loaded, "debug", total_steps_of=lambda n: count_steps(n, settings))
    stages = InProcessStages(rt.runner, rt.trainer, rt.engine, loaded.experiment_dir, rt.tokenizer, rt.models)
    vllm_here = len(distinct_engines(rt.models)) \
        if resolve_engine_name(loaded.typed.astuner.rollout.engine) == "vllm" else 0
    return drive(loaded, settings, stages, rt.train_tasks, rt.val_tasks, count_steps(len(rt.train_tasks), settings),
                 rt.tokenizer, checkpoint, vllm_here)
