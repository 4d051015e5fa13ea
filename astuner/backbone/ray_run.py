"""What the verl and trinity backbones share: the driver's run (the same loop as the debug backbone), placing
`Worker` actors, the trainer group (data-parallel ranks), checkpoints, the token-pipeline check, and shutdown.

The driver holds no weights: it reads the data, runs `astuner.loop.run_loop`, and calls the actors through
`ray_cluster.get`, so every wait has a deadline (astuner.trainer_common.actor_timeout_s) and a lost actor stops
the run with its error (after checkpointing the last completed step when the trainer still holds it).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

from astuner.backbone import ray_cluster
from astuner.backbone.ray_cluster import Bundle
from astuner.errors import WorkerLost
from astuner.loop import LoopSettings, RunSummary, count_steps, drive
from astuner.stages import Stages
from astuner.types import Episode, Sample, Task, TrainResult
from astuner.watchdog import watch

log = logging.getLogger(__name__)

SHUTDOWN_WAIT_S = 20.0  # for the actors to stop their engines before they are killed


def split_evenly(items: list, n: int) -> list[list]:
    """`items` in `n` contiguous parts whose sizes differ by at most one (empty parts when n > len)."""
    size, extra = divmod(len(items), n)
    out, start = [], 0
    for i in range(n):
        stop = start + size + (1 if i < extra else 0)
        out.append(items[start:stop])
        start = stop
    return out


@dataclass
class Sent:
    """A rollout sent to actors, one part each: the pending results, who holds them, episodes per part, and the
    policy version the actors will run it on."""

    refs: list
    names: list[str]
    sizes: list[int]
    version: int = 0


@dataclass
class TrainerGroup:
    """The trainer workers of one model of astuner.models with a group of its own (trinity's trainer_groups:
    per_model): its actors, their names, and whether they shard the model (fsdp2)."""

    actors: list
    names: list[str]
    sharded: bool = False

    def calling(self) -> tuple[list, list[str]]:
        """The ranks a call that runs the model goes to (rank 0; every rank when sharded), and their names."""
        n = len(self.actors) if self.sharded else 1
        return self.actors[:n], self.names[:n]


def episodes_of(results) -> list[Episode]:
    return [e for episodes, _, _ in results for e in episodes]


def engine_tp(typed) -> int:
    """GPUs of one engine: vLLM's tensor_model_parallel_size (the HF engine runs on one device)."""
    from astuner.config.derived import resolve_engine_name

    vllm = resolve_engine_name(typed.astuner.rollout.engine) == "vllm"
    return typed.astuner.rollout.tensor_model_parallel_size if vllm else 1


class RayStages(Stages):
    """Base of the backbones' stages: trainer workers (rank 0 saves checkpoints) and the driver-side waits."""

    def __init__(self, loaded, prep) -> None:
        self.loaded, self.prep = loaded, prep
        tc = loaded.typed.astuner.trainer_common
        self.timeout_s = tc.actor_timeout_s
        self.world = tc.nnodes * tc.n_gpus_per_node
        self.cpus = tc.cpus_per_worker
        self.trainers: list = []
        self.group = None  # the placement group: released at shutdown, or its CPUs/GPUs stay reserved
        self.trainer_names: list[str] = []
        self.stuck: set[str] = set()  # actors that died or missed a deadline: killed at shutdown without waiting
        self.trainer_version = 0  # loop steps the trainer has completed (its weights' policy version)
        self.sharded = False  # fsdp2: every trainer call that runs the model goes to all ranks at once
        self.model_groups: dict[str, TrainerGroup] = {}  # other models' own trainer groups (trinity, per_model)

    # --- placement -------------------------------------------------------------------------------------------

    def gpus_per_process(self) -> float:
        import ray

        return 1.0 if ray.cluster_resources().get("GPU", 0) > 0 else 0.0

    def host_bytes(self, roles: tuple[str, ...]) -> float:
        """The preflight estimate of a process's host memory, for the placement check (GPU runs: 0, the
        estimate is device memory there). The other models of a run (astuner.models), whose estimate is one sum
        of their trainers and engines, count whole in every process: an upper bound."""
        plan = self.prep.plan
        if plan.device != "cpu":
            return 0.0
        return float(("trainer" in roles) * (plan.trainer_bytes + plan.ref_bytes + plan.activation_bytes)
                     + ("engine" in roles) * (plan.engine_bytes + plan.kv_cache_bytes) + plan.others_bytes)

    def spawn(self, group, index: int, bundle: Bundle, roles: tuple[str, ...], rank: int, world: int,
              only: tuple[str, ...] | None = None):
        import ray
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        from astuner.backbone.ray_worker import Worker

        actor = ray.remote(Worker).options(
            num_cpus=bundle.cpus, num_gpus=bundle.gpus, name=None, max_restarts=0,
            runtime_env={"env_vars": ray_cluster.worker_env()},
            scheduling_strategy=PlacementGroupSchedulingStrategy(placement_group=group,
                                                                 placement_group_bundle_index=index),
        ).remote(self.loaded, roles, rank, world, self.prep.models, self.prep.max_model_len,
                 self.prep.total_steps, bundle.name, self.prep.plan.kv_cache_bytes,
                 self.prep.plan.micro_batch_token_budget, only)
        return actor

    def wait_ready(self, actors: list, names: list[str]) -> None:
        nodes = ray_cluster.get([a.ready.remote() for a in actors], self.timeout_s, "the driver", names,
                                "load the model", trainer_ok=False)
        # Where each actor runs, by Ray node id (as `ray status` and `ray list nodes` name nodes): a lost node's
        # workers can then be told from the message that names them.
        log.info("placement: %s", ", ".join(f"{name} on node {node} ({ip})" for name, (node, ip) in zip(names, nodes)))

    def init_data_parallel(self) -> None:
        if self.world == 1:
            return
        self.sharded = self._join(self.trainers, self.trainer_names, "")
        for name, group in self.model_groups.items():
            group.sharded = self._join(group.actors, group.names, f" of model {name}")

    def _join(self, actors: list, names: list[str], whose: str) -> bool:
        """One trainer group's process group up; whether it shards (fsdp2)."""
        addr, port = self.get(actors[0].free_address.remote(), names[:1], "report its address")
        strategies = self.get([t.init_data_parallel.remote(addr, port, self.timeout_s) for t in actors], names,
                              "join the data-parallel group")
        log.info("%d trainer workers%s, strategy %s", len(actors), whose, strategies[0])
        return strategies[0] == "fsdp2"

    def to_trainers(self, method: str, *args) -> list:
        """Call `method` on trainer rank 0, or on every rank when sharded (each must join the gathers); returns
        the pending results, rank 0's first."""
        ranks = self.trainers if self.sharded else self.trainers[:1]
        return [getattr(t, method).remote(*args) for t in ranks]

    def get(self, refs, who: list[str], what: str, trainer_ok: bool = True, timeout_s: float | None = None):
        try:
            with watch("actor", f"{', '.join(who)} to {what}"):
                return ray_cluster.get(refs, timeout_s or self.timeout_s, "the driver", who, what, trainer_ok)
        except WorkerLost:
            self.stuck.update(who)
            raise

    # --- stages ----------------------------------------------------------------------------------------------

    def train(self, samples: list[Sample], objective: str = "policy") -> TrainResult:
        import ray

        if self.model_groups:
            return self._train_groups(samples, objective)
        shared = ray.put(samples)  # serialised once for every worker
        results = self.get([t.train.remote(shared, objective) for t in self.trainers], self.trainer_names,
                           "train a step", trainer_ok=False)
        return TrainResult(results[0][0], _logprobs(results, len(samples)))

    def _train_groups(self, samples: list[Sample], objective: str) -> TrainResult:
        """Every model's group trains on its own samples at the same time; one result as local_models.train_models
        gives it (every model's metrics as `model/<name>/...`)."""
        import ray

        from astuner.backbone.local_models import merge_model_results, samples_by_model

        groups = self.groups()
        mine = samples_by_model(samples, list(groups))
        sent = {}
        for name, group in groups.items():
            if mine[name]:
                part = ray.put([samples[i] for i in mine[name]])  # serialised once for the group's workers
                sent[name] = [t.train.remote(part, objective) for t in group.actors]
        names = [n for name in sent for n in groups[name].names]
        flat = self.get([ref for refs in sent.values() for ref in refs], names, "train a step", trainer_ok=False)
        results, at = {}, 0
        for name, refs in sent.items():
            ranks = flat[at:at + len(refs)]
            at += len(refs)
            results[name] = TrainResult(ranks[0][0], _logprobs(ranks, len(mine[name])))
        return merge_model_results(results, mine, len(samples))

    def groups(self) -> dict[str, TrainerGroup]:
        """Every model's trainer workers by model name, the first model's first (its group: `self.trainers`)."""
        return {self.prep.models.first.name: TrainerGroup(self.trainers, self.trainer_names, self.sharded),
                **self.model_groups}

    def save_checkpoint(self, step: int, run_state: dict) -> Path:
        """A run of one model: its trainer writes the checkpoint. Several: every group writes its models' folders
        into a staging folder at once, which is then sealed with the run state (backbone/local_models.py)."""
        import shutil

        from astuner.backbone.local_models import seal_checkpoint, staging_folder

        path = self.loaded.experiment_dir / f"global_step_{step}"
        several = len(self.prep.models.names) > 1
        target = staging_folder(path) if several else path
        try:
            calls = [group.calling() for group in self.groups().values()]
            self.get([a.save_checkpoint.remote(str(target), run_state) for actors, _ in calls for a in actors],
                     [n for _, names in calls for n in names], f"save checkpoint {path}")
            if several:
                seal_checkpoint(target, path, run_state)
        finally:
            if several:
                shutil.rmtree(target, ignore_errors=True)
        log.info("saved checkpoint %s", path)
        return path

    def load_checkpoint(self, path: Path) -> dict:
        """Every trainer worker loads its models; the run state (several models: read beside their folders)."""
        from astuner.backbone.local_models import check_checkpoint_models
        from astuner.resume import read_run_state

        several = len(self.prep.models.names) > 1
        if several:
            check_checkpoint_models(path, list(self.prep.models.names))
        refs, names = [], []
        for group in self.groups().values():
            refs += [a.load_checkpoint.remote(str(path)) for a in group.actors]
            names += group.names
        states = self.get(refs, names, f"load checkpoint {path}", trainer_ok=False)
        return read_run_state(path) if several else states[0]

    def send_rollout(self, actors: list, names: list[str], tasks: list[Task], validation: bool, step: int,
                     repeats: int | None = None) -> Sent:
        """Split `tasks` into contiguous parts, one per actor (a task's episodes stay on one engine); `repeats`:
        sampled validation (pass@k), that many episodes per task."""
        per_task = (repeats or 1) if validation else self.loaded.typed.astuner.rollout.num_repeat
        parts = split_evenly(tasks, len(actors))
        used = [i for i, p in enumerate(parts) if p]
        return Sent([actors[i].rollout.remote(parts[i], validation, step, repeats) for i in used],
                     [names[i] for i in used], [len(parts[i]) * per_task for i in used])

    def gather_rollouts(self, sent: Sent, description: str, step: int, progress=None
                        ) -> list[tuple[list[Episode], float, float]]:
        """(episodes, seconds, wall-clock start) of every part, in part order, updating the `progress` bar (the
        stages contract's) as parts finish."""
        import contextlib

        import ray

        refs, names, sizes = sent.refs, sent.names, sent.sizes
        start = time.perf_counter()
        results: dict[int, list] = {}
        pending = dict(enumerate(refs))
        with (progress(description, sum(sizes)) if progress else contextlib.nullcontext()) as bar, \
                watch("actor", f"{', '.join(names)} to roll out step {step}"):
            while pending:
                left = self.timeout_s - (time.perf_counter() - start)
                done, _ = ray.wait(list(pending.values()), num_returns=1, timeout=max(left, 0))
                if not done:
                    self.stuck.update(names[i] for i in pending)
                    raise WorkerLost(
                        f"the driver waited {self.timeout_s:g} s for {', '.join(names[i] for i in pending)} to roll "
                        f"out step {step}, in vain (astuner.trainer_common.actor_timeout_s; episodes have their own "
                        "astuner.rollout.episode_timeout, so the actor is stuck)", trainer_ok=True)
                for i, ref in list(pending.items()):
                    if ref in done:
                        results[i] = self.get(ref, [names[i]], f"roll out step {step}")
                        del pending[i]
                        if bar:
                            bar.update(sizes[i])
        return [results[i] for i in range(len(refs))]

    # --- preflight and shutdown ------------------------------------------------------------------------------

    def check_pipeline(self, engine_actor, engine_name: str) -> None:
        """The token-pipeline table of the debug backbone, with the logprob check across the two actors."""
        from astuner import runtime
        from astuner.model_tuner.pipeline_check import CheckSampling, check_runner, logprob_check

        prep, trainer, trainer_name = self.prep, self.trainers[0], self.trainer_names[:1]

        def score(prompt, ids, temperature):
            refs = self.to_trainers("compute_logprobs", prompt, ids, temperature)
            return self.get(refs, self.trainer_names[:len(refs)], "score the preflight answer")[0]

        runner = runtime.build_runner(self.loaded, None, prep.tokenizer, prep.workflow_cls, prep.judge,
                                      prep.stop_ids, prep.max_model_len)
        sampling = CheckSampling.of(prep.models.first)
        check = logprob_check(
            runner.renderer,
            lambda prompt: self.get(engine_actor.sample_for_check.remote(prompt, runner.stop_token_ids, sampling),
                                    [engine_name], "sample the preflight answer"),
            score,
            self.get(trainer.precision.remote(), trainer_name, "report its precision"),
            sampling)
        check_runner(self.loaded.typed.astuner.rollout.preflight, runner, check)

    def all_actors(self) -> list[tuple[str, object]]:
        groups = [pair for g in self.model_groups.values() for pair in zip(g.names, g.actors)]
        return list(zip(self.trainer_names, self.trainers)) + groups

    def shutdown(self) -> None:
        import ray

        named = self.all_actors()
        actors = [a for _, a in named]
        healthy = [a for name, a in named if name not in self.stuck]
        try:  # a clean stop (engines' own processes, the process group); a dead or stuck actor is then killed
            ray.wait([a.shutdown.remote() for a in healthy], num_returns=len(healthy), timeout=SHUTDOWN_WAIT_S)
        except Exception as exc:
            log.warning("shutting the actors down: %s", exc)
        for a in actors:
            ray.kill(a)
        if self.group is not None:
            from ray.util.placement_group import remove_placement_group

            remove_placement_group(self.group)


def _logprobs(ranks: list, n: int) -> list[list[float] | None]:
    """The trainers' logprobs of the `n` samples a group trained on, from each rank's (metrics, {index: logprobs
    of the samples it forwarded before the update})."""
    out: list[list[float] | None] = [None] * n
    for _, seen in ranks:
        for i, values in seen.items():
            out[i] = values
    return out


def _gpu_memory() -> tuple[int, int]:
    """(free, total) bytes of this process's GPU: run as a Ray task on a GPU worker, never in the driver."""
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError("the cluster lent this worker a GPU, but torch sees no CUDA device here")
    free, total = torch.cuda.mem_get_info()
    return int(free), int(total)


def probe_gpu_worker(gpus: float, timeout_s: float) -> tuple[int, int]:
    """One GPU's (free, total) memory, from a task holding `gpus` GPUs as a trainer worker does, within
    `timeout_s`. Its worker process exits after the task (max_calls=1), and with it the CUDA context it made."""
    import ray

    remote = ray.remote(num_gpus=gpus, num_cpus=0, max_calls=1,
                        runtime_env={"env_vars": ray_cluster.worker_env()})(_gpu_memory)
    ref = remote.remote()
    try:
        return ray.get(ref, timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        ray.cancel(ref, force=True)
        raise WorkerLost(f"the driver waited {timeout_s:g} s for a GPU worker to report its free memory, in vain "
                         "(astuner.trainer_common.actor_timeout_s): `ray status` shows whether the cluster's GPUs "
                         "are held by another job", trainer_ok=False) from None
    except ray.exceptions.RayTaskError as exc:
        raise WorkerLost(f"a GPU worker could not report its memory ({exc.cause if exc.cause else exc}): run "
                         "`python -c 'import torch; print(torch.cuda.is_available())'` on the GPU nodes, in the "
                         "environment Ray starts workers in; it must print True", trainer_ok=False) from None


def cluster_device(resources: dict, timeout_s: float, probe=probe_gpu_worker):
    """The trainer's device as the cluster offers it (`ray.cluster_resources()`), without starting CUDA in the
    driver: that would hold a CUDA context on the head's GPU 0 for the whole run, and a CPU-only head would plan
    for CPU. cuda when the cluster has GPUs, with one card's memory from `probe(gpus, timeout_s)` on a GPU worker
    (the trainer workers take one GPU each); cpu otherwise."""
    from astuner.memory import DeviceFacts

    if resources.get("GPU", 0) <= 0:
        return DeviceFacts("cpu")
    free, total = probe(1.0, timeout_s)
    return DeviceFacts("cuda", free, total)


def run_on_ray(loaded, checkpoint: Path | None, backbone: str, make_stages, start_ray: bool = False) -> RunSummary:
    """The driver of a Ray backbone: `make_stages(loaded, prep)` places the actors; `start_ray`: start a local
    cluster when none is reachable (--with-ray)."""
    import ray

    from astuner import runtime
    from astuner.logs import setup_logging

    typed = loaded.typed
    setup_logging(loaded.experiment_dir)
    settings = LoopSettings.from_config(typed)
    runtime.seed_everything(typed.astuner.seed)
    started_cluster = False

    def device():  # joined once user code, data and the model's config have passed (they fail faster)
        nonlocal started_cluster
        started_cluster = ray_cluster.connect(start_local=start_ray)
        return cluster_device(ray.cluster_resources(), typed.astuner.trainer_common.actor_timeout_s)

    try:
        prep = runtime.prepare(loaded, backbone, total_steps_of=lambda n: count_steps(n, settings), device_of=device)
        stages = make_stages(loaded, prep)  # a failed start releases what it placed
        return drive(loaded, settings, stages, prep.train_tasks, prep.val_tasks, prep.total_steps, prep.tokenizer,
                     checkpoint)
    finally:
        if started_cluster:
            ray.shutdown()
