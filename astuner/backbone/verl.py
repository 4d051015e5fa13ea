"""The verl backbone: colocated and synchronous, on Ray.

`nnodes * n_gpus_per_node` workers, each holding a trainer replica and an engine with its rollout runner (one GPU
each on a GPU cluster; on GPU the engine sleeps while the trainer steps). Each step:
    rollout  tasks split into contiguous parts, one per worker (a task's episodes stay on one engine)
    train    every worker gets the step's samples and backwards the episodes it owns; gradients are summed
             over the workers (astuner/trainer/data_parallel.py), so every replica takes the same step
    sync     each worker's engine loads its own trainer's weights (same process: no transfer)
The loop is astuner.loop.run_loop, as in the debug backbone.
"""

from __future__ import annotations

import logging

from astuner.backbone import ray_cluster
from astuner.backbone.ray_cluster import Bundle
from astuner.backbone.ray_run import RayStages, engine_tp, episodes_of, run_on_ray
from astuner.types import Episode, SyncReport, Task

log = logging.getLogger(__name__)


def verl_bundles(world: int, cpus: float, gpus_per_process: float, tp: int, memory: float) -> list[Bundle]:
    """One bundle a worker; a worker's engine spans `tp` GPUs (its trainer uses the first of them)."""
    return [Bundle(f"worker {r}", cpus, gpus_per_process * tp, memory) for r in range(world)]


class VerlStages(RayStages):
    def __init__(self, loaded, prep) -> None:
        super().__init__(loaded, prep)
        bundles = verl_bundles(self.world, self.cpus, self.gpus_per_process(), engine_tp(loaded.typed),
                               self.host_bytes(("trainer", "engine")))
        self.group = group = ray_cluster.place(bundles, self.timeout_s, f"the verl backbone ({self.world} workers)")
        try:
            self.trainers = [self.spawn(group, r, b, ("trainer", "engine"), r, self.world)
                             for r, b in enumerate(bundles)]
            self.trainer_names = [b.name for b in bundles]
            self.wait_ready(self.trainers, self.trainer_names)
            self.init_data_parallel()
            self.check_pipeline(self.trainers[0], self.trainer_names[0])
        except BaseException:
            self.shutdown()  # nothing placed outlives a failed start
            raise

    def rollout(self, tasks: list[Task], validation: bool, step: int = 0, progress=None) -> list[Episode]:
        sent = self.send_rollout(self.trainers, self.trainer_names, tasks, validation, step)
        return episodes_of(self.gather_rollouts(sent, "validation" if validation else "rollout", step, progress))

    def rollout_sampled(self, tasks: list[Task], step: int, repeats: int, progress=None) -> list[Episode]:
        sent = self.send_rollout(self.trainers, self.trainer_names, tasks, True, step, repeats)
        return episodes_of(self.gather_rollouts(sent, "validation", step, progress))

    def sync_weights(self) -> SyncReport:
        self.trainer_version += 1
        loads = self.get([t.sync_local.remote(self.trainer_version) for t in self.trainers], self.trainer_names,
                         "load the new weights into its engine", trainer_ok=False)
        return SyncReport.worst(loads)  # the slowest worker's time; verified only if every worker's engine was

    def resumed(self, step: int) -> None:
        self.trainer_version = step
        self.get([t.sync_local.remote(step) for t in self.trainers], self.trainer_names,
                 "load the checkpoint's weights into its engine", trainer_ok=False)


def run(loaded, checkpoint=None, start_ray: bool = False):
    return run_on_ray(loaded, checkpoint, "verl", VerlStages, start_ray=start_ray)
