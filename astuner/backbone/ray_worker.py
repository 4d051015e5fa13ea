"""The one actor class of the Ray backbones: a process that holds the existing pieces, by role.

    "trainer": a `Trainer` replica (rank `rank` of `world`: data-parallel through astuner/trainer/data_parallel.py)
    "engine":  an inference engine and a rollout runner (the user's workflow and judge run here)

verl places both roles in each worker (colocated: rollout and training take turns on the same device);
trinity places "engine" in its explorers and "trainer" in its trainer workers. The class is plain Python: the
backbones wrap it with `ray.remote`, and tests may call it directly.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path

log = logging.getLogger(__name__)

ENGINE_ALONE_GPU_SHARE = 0.9  # vLLM's own default gpu_memory_utilization, for an engine with its GPUs to itself
SHARE_KEY = "astuner.rollout.gpu_memory_utilization"


def engine_config(loaded, roles: tuple[str, ...], on_cuda: bool):
    """The typed config this process builds its engine from. An engine alone in its process on CUDA (a trinity
    explorer: its bundle's GPUs hold no trainer) takes vLLM's own default share, ENGINE_ALONE_GPU_SHARE, unless
    the user set SHARE_KEY; the default 0.6 is sized for an engine beside a trainer (verl, debug), and alone it
    would leave 40% of the explorer's GPU idle, KV cache it could have used."""
    from astuner.config.derived import resolve_engine_name

    typed = loaded.typed
    if "trainer" in roles or not on_cuda or SHARE_KEY in loaded.user_keys:
        return typed
    if resolve_engine_name(typed.astuner.rollout.engine) != "vllm":
        return typed
    rollout = typed.astuner.rollout.model_copy(update={"gpu_memory_utilization": ENGINE_ALONE_GPU_SHARE})
    return typed.model_copy(update={"astuner": typed.astuner.model_copy(update={"rollout": rollout})})


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
    def __init__(self, loaded, roles: tuple[str, ...], rank: int, world: int, model_path: str,
                 max_model_len: int, total_steps: int, name: str, kv_cache_bytes: int | None = None,
                 micro_batch_tokens: int | None = None) -> None:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        check_gpu_isolation(os.environ)
        from astuner import runtime
        from astuner.logs import setup_logging

        setup_logging(loaded.experiment_dir)  # the run's log file, as in the driver (workflows' loguru lines too)
        runtime.quiet_library_progress()

        self.name, self.rank, self.world = name, rank, world
        self.loaded, self.model_path = loaded, model_path
        typed = loaded.typed
        runtime.seed_everything(typed.astuner.seed)
        self.tokenizer = runtime.load_tokenizer(model_path)
        self.trainer = self.engine = self.runner = None
        self.version = 0  # trainer steps behind the engine's weights (see sync_schedule.py)
        if "engine" in roles:
            workflow_cls = runtime.load_workflow(loaded)
            judge = runtime.build_judge(loaded)
            import torch

            engine_typed = engine_config(loaded, roles, torch.cuda.is_available())
            if engine_typed is not typed:
                log.info("%s: its engine has its GPUs to itself, so it takes %g of their memory (%s to choose)",
                         name, ENGINE_ALONE_GPU_SHARE, SHARE_KEY)
            self.engine = runtime.build_engine(engine_typed, model_path, self.tokenizer, max_model_len,
                                               kv_cache_bytes)
            self.runner = runtime.build_runner(loaded, self.engine, self.tokenizer, workflow_cls, judge, model_path,
                                               max_model_len, runtime.roster_of(typed, self.engine, {}))
        if "trainer" in roles:
            self.trainer = runtime.build_trainer(typed, model_path, total_steps, micro_batch_tokens, world)

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
        return self.trainer.join_group(dp, self.loaded.typed.astuner.trainer_common.strategy)

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
        if self.engine is not None:
            self.engine.sleep()  # colocated vLLM frees its GPU memory for the step; the sync wakes it
        result = self.trainer.train(samples, objective=objective)
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

        from astuner.types import SyncReport

        start = time.perf_counter()
        report = self.engine.load_weights(self.trainer.named_parameters_for_sync()) or SyncReport()
        self.version = version
        return dataclasses.replace(report, engine_load_s=time.perf_counter() - start)

    def export_weights(self) -> dict | None:
        """The trainer's weights for the object store: name -> (numpy array, torch dtype name). bf16 travels as
        its raw 16 bits (numpy has no bf16), so nothing is converted. A sharded group: every rank gathers, rank 0
        returns them (the others None)."""
        import torch

        out = {}
        for name, tensor in self.trainer.named_parameters_for_sync():
            if self.rank != 0:
                continue
            t = tensor.detach().to("cpu").contiguous()
            if t.dtype == torch.bfloat16:
                out[name] = (t.view(torch.int16).numpy(), "bfloat16")
            else:
                out[name] = (t.numpy(), str(t.dtype).removeprefix("torch."))
        return out if self.rank == 0 else None

    def load_weights(self, weights: dict, version: int) -> float:
        """trinity: new weights from the trainer (through the object store), as policy `version`."""
        import warnings

        import torch

        start = time.perf_counter()

        def tensors():
            for name, (array, dtype) in weights.items():
                with warnings.catch_warnings():  # read-only object-store memory: the engine copies, never writes
                    warnings.simplefilter("ignore", UserWarning)
                    t = torch.from_numpy(array)
                yield name, t.view(torch.bfloat16) if dtype == "bfloat16" else t

        self.engine.load_weights(tensors())
        self.version = version
        return time.perf_counter() - start

    # --- checkpoints -----------------------------------------------------------------------------------------

    def save_checkpoint(self, path: str, run_state: dict) -> str:
        """Rank 0 writes; the other ranks of a sharded group take part in the gather."""
        self.trainer.save_checkpoint(Path(path), tokenizer=self.tokenizer, run_state=run_state,
                                     write=self.rank == 0)
        return path

    def load_checkpoint(self, path: str) -> dict:
        return self.trainer.load_checkpoint(Path(path))

    def shutdown(self) -> None:
        if self.runner is not None:
            self.runner.close()
        if self.engine is not None:
            self.engine.shutdown()
        if self.trainer is not None and self.trainer.dp is not None:
            self.trainer.dp.close()
