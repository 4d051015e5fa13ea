"""The one actor class of the Ray backbones: a process that holds the existing pieces, by role.

    "trainer": a `Trainer` replica (rank `rank` of `world`: data-parallel through astuner/trainer/data_parallel.py)
    "engine":  an inference engine and a rollout runner (the user's workflow and judge run here)

verl places both roles in each worker (colocated: rollout and training take turns on the same device);
trinity places "engine" in its explorers and "trainer" in its trainer workers. A run of several models
(astuner.models) holds every model in each worker, for its roles (run_models.py): the engines side by side (an
episode may call any agent), the trainers trained one after another, each on its own samples, every model's
replicas summing their gradients over the worker's one process group. The class is plain Python: the backbones wrap
it with `ray.remote`, and tests may call it directly.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

from astuner.backbone.local_models import save_model_folders, sync_models, train_models
from astuner.config.derived import run_facts
from astuner.config.schema_models import strategy_of
from astuner.run_models import build_models, roster_of_models
from astuner.task_judge.loading import build_judge
from astuner.workflow import load_workflow

log = logging.getLogger(__name__)

ENGINE_ALONE_GPU_SHARE = 0.9  # vLLM's own default gpu_memory_utilization, for an engine with its GPUs to itself
SHARE_KEY = "astuner.rollout.gpu_memory_utilization"


def engine_share(loaded, roles: tuple[str, ...], on_cuda: bool) -> float | None:
    """The part of the GPU this process's engines take together (None: rollout.gpu_memory_utilization). Engines alone
    in their process on CUDA (a trinity explorer: its bundle's GPUs hold no trainer) take vLLM's own default share,
    ENGINE_ALONE_GPU_SHARE, unless the user set SHARE_KEY; the default 0.6 is sized for an engine beside a trainer
    (verl, debug), and alone it would leave 40% of the explorer's GPU idle, KV cache it could have used. Several
    models' engines split the share (config.derived.gpu_share_per_engine)."""
    from astuner.config.derived import resolve_engine_name

    typed = loaded.typed
    alone = "trainer" not in roles and on_cuda and SHARE_KEY not in loaded.user_keys
    return ENGINE_ALONE_GPU_SHARE if alone and resolve_engine_name(typed.astuner.rollout.engine) == "vllm" else None


NOSET_VISIBLE = "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"


def check_gpu_isolation(env) -> None:
    """Each actor's "cuda" is its own GPU only because Ray sets CUDA_VISIBLE_DEVICES per actor; with Ray told not
    to, every rank's trainer and vLLM engine would land on GPU 0 (and NCCL refuse duplicate GPUs)."""
    if env.get(NOSET_VISIBLE, "") not in ("", "0"):
        from astuner.errors import UserError

        raise UserError(f"{NOSET_VISIBLE} is set on this Ray cluster: every astuner worker would then use GPU 0. "
                        f"Start the cluster without it (ray stop; unset {NOSET_VISIBLE}; ray start ...), so that "
                        "Ray gives each worker its own GPUs.")


class Worker:
    def __init__(self, loaded, roles: tuple[str, ...], rank: int, world: int, model_set,
                 max_model_len: int, total_steps: int, name: str, kv_cache_bytes: int | None = None,
                 micro_batch_tokens: int | None = None, only: tuple[str, ...] | None = None) -> None:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        check_gpu_isolation(os.environ)
        from astuner import runtime
        from astuner.logs import setup_logging

        setup_logging(loaded.experiment_dir)  # the run's log file, as in the driver (workflows' loguru lines too)
        runtime.quiet_library_progress()

        self.name, self.rank, self.world = name, rank, world
        self.loaded, self.model_set = loaded, model_set  # the run's ModelSet, folders resolved by the driver
        model_path = model_set.first.folder  # the run's tokenizer and chat template
        typed = loaded.typed
        runtime.seed_everything(typed.astuner.seed)
        self.tokenizer = runtime.load_tokenizer(model_path)
        self.runner = None
        self.version = 0  # trainer steps behind the engine's weights (see sync_schedule.py)
        share = None
        if "engine" in roles:
            workflow_cls, judge = load_workflow(loaded), build_judge(loaded)
            import torch

            share = engine_share(loaded, roles, torch.cuda.is_available())
            if share is not None:
                log.info("%s: its engines have their GPUs to themselves, so they take %g of their memory (%s to "
                         "choose)", name, ENGINE_ALONE_GPU_SHARE, SHARE_KEY)
        # name -> LocalModel: the policy's engine and trainer (for this worker's roles), then astuner.models'; `only`:
        # a trainer group of some models (trinity's trainer_groups: per_model)
        self.models = build_models(typed, run_facts(typed), self.tokenizer, model_set, max_model_len, total_steps,
                                   roles=roles, kv_cache_bytes=kv_cache_bytes, micro_batch_tokens=micro_batch_tokens,
                                   world=world, gpu_share=share, only=only)
        first = next(iter(self.models.values()))  # the run's first model, or a one-model group's model
        self.engine, self.trainer = first.engine, first.trainer
        if "engine" in roles:
            stop_ids = runtime.stop_token_ids(model_path, self.tokenizer)
            self.runner = runtime.build_runner(loaded, self.engine, self.tokenizer, workflow_cls, judge, stop_ids,
                                               max_model_len, roster_of_models(typed, model_set, self.models))

    def ready(self) -> tuple[str, str]:
        """(Ray node id, node IP) of this process: the driver logs where each actor was placed."""
        import ray

        return ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address()

    # --- data parallel ---------------------------------------------------------------------------------------

    def free_address(self) -> tuple[str, int]:
        """This node's address and a free port, for rank 0 to host the process group's store."""
        import ray

        from astuner.trainer.data_parallel import free_port

        return ray.util.get_node_ip_address(), free_port()

    def init_data_parallel(self, addr: str, port: int, timeout_s: float) -> str:
        """Join the trainer group; returns the strategy in force (ddp or fsdp2, astuner/trainer/fsdp.py)."""
        from astuner.trainer.data_parallel import DataParallel

        dp = DataParallel.init(self.rank, self.world, addr, port, self.trainer.device.type, timeout_s)
        strategy = strategy_of(self.loaded.typed, len(self.models))
        # Several models share the one process group (they train in the same order on every rank), each with its
        # own map of which rank owns which sample.
        return [model.trainer.join_group(dp if model.trainer is self.trainer else DataParallel(self.rank, self.world),
                                         strategy) for model in self.models.values()][0]

    # --- rollout ---------------------------------------------------------------------------------------------

    def rollout(self, tasks, validation: bool, step: int, repeats: int | None = None):
        """(episodes stamped with this engine's policy version, seconds, wall-clock start)."""
        wall, start = time.time(), time.perf_counter()
        episodes = self.runner.run(tasks, validation=validation, step=step, sampled_repeats=repeats)
        for e in episodes:
            e.policy_version = self.version
        return episodes, time.perf_counter() - start, wall

    def sample_for_check(self, prompt_ids: list[int], stop_token_ids: tuple[int, ...], sampling):
        """(token ids, logprobs) the engine samples after `prompt_ids` with the rollout's `sampling`: one side of
        the preflight logprob check."""
        from astuner.model_tuner.pipeline_check import sample_check_answer

        return sample_check_answer(self.engine, prompt_ids, stop_token_ids, sampling)

    # --- training --------------------------------------------------------------------------------------------

    def train(self, samples, objective: str = "policy"):
        """(metrics, {index: trainer logprobs} of the samples this rank forwarded before any update)."""
        for model in self.models.values():
            if model.engine is not None:
                model.engine.sleep()  # colocated vLLM frees its GPU memory for the step; the sync wakes it
        if len(self.models) == 1:
            result = self.trainer.train(samples, objective=objective)
        else:  # each model on its own samples; `model/<name>/` metrics (backbone/local_models.py)
            result = train_models(self.models, samples, objective)
        seen = {i: logprobs for i, logprobs in enumerate(result.trainer_logprobs) if logprobs is not None}
        return result.metrics, seen

    def compute_logprobs(self, prompt_ids, response_ids, temperature: float) -> list[float]:
        return self.trainer.compute_logprobs(prompt_ids, response_ids, temperature)

    def precision(self) -> str:
        return self.trainer.precision

    # --- weights ---------------------------------------------------------------------------------------------

    def sync_local(self, version: int):
        """verl: this worker's engine takes this worker's trainer weights (same process, no transfer); its
        SyncReport (verification: engine/fingerprint.py) with the load's seconds as this worker timed them."""
        import dataclasses

        start = time.perf_counter()
        report = sync_models(self.models)
        self.version = version
        return dataclasses.replace(report, engine_load_s=time.perf_counter() - start)

    def export_weights(self) -> dict | None:
        """Every model's weights for the object store: model -> {name: (numpy array, torch dtype name)}; an adapter
        on a shared base exports its adapter alone (run_models.LocalModel.sync_tensors). bf16 travels as its raw 16
        bits (numpy has no bf16), so nothing is converted. A sharded group: every rank gathers, rank 0 returns them
        (the others None)."""
        import torch

        out: dict[str, dict] = {}
        for model, local in self.models.items():
            mine = out.setdefault(model, {})
            for name, tensor in local.sync_tensors():
                if self.rank != 0:
                    continue
                t = tensor.detach().to("cpu").contiguous()
                if t.dtype == torch.bfloat16:
                    mine[name] = (t.view(torch.int16).numpy(), "bfloat16")
                else:
                    mine[name] = (t.numpy(), str(t.dtype).removeprefix("torch."))
        return out if self.rank == 0 else None

    def load_weights(self, version: int, *weights: dict) -> float:
        """trinity: every model's new weights from the trainers (`export_weights` of each trainer group, through the
        object store), as policy `version`."""
        import warnings

        import torch

        start = time.perf_counter()

        def tensors(arrays: dict):
            for name, (array, dtype) in arrays.items():
                with warnings.catch_warnings():  # read-only object-store memory: the engine copies, never writes
                    warnings.simplefilter("ignore", UserWarning)
                    t = torch.from_numpy(array)
                yield name, t.view(torch.bfloat16) if dtype == "bfloat16" else t

        for part in weights:
            for model, arrays in part.items():
                self.models[model].engine.load_weights(tensors(arrays))
        self.version = version
        return time.perf_counter() - start

    # --- checkpoints -----------------------------------------------------------------------------------------

    def save_checkpoint(self, path: str, run_state: dict) -> str:
        """Rank 0 writes; the other ranks of a sharded group take part in the gather. A run of one model: its
        checkpoint at `path`. Several: this worker's models' folders inside `path`, the driver's staging folder,
        which the driver seals once every group wrote (backbone/local_models.py)."""
        if len(self.model_set.names) == 1:
            self.trainer.save_checkpoint(Path(path), tokenizer=self.tokenizer, run_state=run_state,
                                         write=self.rank == 0)
        else:
            save_model_folders(self.models, Path(path), self.tokenizer, run_state["step"], write=self.rank == 0)
        return path

    def load_checkpoint(self, path: str) -> dict:
        """A run of one model: its run state. Several: this worker's models from their folders in `path`, and
        {} (the driver reads the run state)."""
        if len(self.model_set.names) == 1:
            return self.trainer.load_checkpoint(Path(path))
        for name, model in self.models.items():
            model.trainer.load_checkpoint(Path(path) / name)
        return {}

    def shutdown(self) -> None:
        if self.runner is not None:
            self.runner.close()
        for model in self.models.values():
            if model.engine is not None:
                model.engine.shutdown()
        if self.trainer is not None and self.trainer.dp is not None:
            self.trainer.dp.close()  # the process group every model's trainer used
