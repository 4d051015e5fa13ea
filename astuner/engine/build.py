"""Engines built from the composed config: `build_engine` (the rollout's, a teacher's, a served base's) and
`build_adapter_engine` (one engine over a base shared by LoRA adapters), each through a registry keyed by the
engine's name ("vllm" or "hf", `auto` already resolved: config.derived.RunFacts.engine)."""

from __future__ import annotations

from pathlib import Path

from astuner.errors import UserError


def _device_type() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"  # as the trainer picks its device


def _hf_settings(typed, tokenizer) -> dict:
    """The HF engine's keyword arguments (engine/hf_engine.py; its adapter engine takes the same)."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    return dict(max_batch_size=typed.astuner.rollout.max_env_worker, seed=typed.astuner.seed, pad_token_id=pad)


def vllm_engine_settings(typed, max_model_len: int, kv_cache_bytes: int | None, device_type: str,
                         gpu_share: float | None = None) -> dict:
    """VLLMEngine's keyword arguments from the config. The engine computes in the trainer's precision (an fp32
    trainer beside a bf16 engine would fail the preflight's fp32 tolerance); its start deadline allows for the
    engines that may start at once on a node (verl: one per worker; trinity: one per explorer). `gpu_share`: the
    part of the GPU this engine takes (config.derived.gpu_share_per_engine), else rollout.gpu_memory_utilization."""
    from astuner.engine.vllm_engine import engine_dtype, start_timeout_s
    from astuner.trainer.precision import resolve_precision

    r, tc = typed.astuner.rollout, typed.astuner.trainer_common
    return dict(
        max_model_len=max_model_len,
        max_num_seqs=r.max_num_seqs,
        tensor_parallel_size=r.tensor_model_parallel_size,
        gpu_memory_utilization=r.gpu_memory_utilization if gpu_share is None else gpu_share,
        seed=typed.astuner.seed,
        kv_cache_bytes=kv_cache_bytes,
        dtype=engine_dtype(resolve_precision(tc.precision, device_type)),
        start_timeout_s=start_timeout_s(max(tc.n_gpus_per_node, tc.n_explorers)),
    )


def _hf_engine(typed, model_path: str, tokenizer, max_model_len: int, kv_cache_bytes: int | None = None,
               gpu_share: float | None = None):
    from astuner.engine.hf_engine import HFEngine

    return HFEngine(model_path, **_hf_settings(typed, tokenizer))


def _vllm_engine(typed, model_path: str, tokenizer, max_model_len: int, kv_cache_bytes: int | None = None,
                 gpu_share: float | None = None):
    from astuner.engine.vllm_engine import VLLMEngine

    return VLLMEngine(model_path, **vllm_engine_settings(typed, max_model_len, kv_cache_bytes, _device_type(),
                                                         gpu_share))


def _hf_adapter_engine(typed, base: str, lora: dict, tokenizer, max_model_len: int, kv_cache_bytes: int | None,
                       gpu_share: float | None):
    from astuner.engine.adapters import AdapterHFEngine

    return AdapterHFEngine(base, lora, **_hf_settings(typed, tokenizer))


def _vllm_adapter_engine(typed, base: str, lora: dict, tokenizer, max_model_len: int, kv_cache_bytes: int | None,
                         gpu_share: float | None):
    device_type = _device_type()
    settings = vllm_engine_settings(typed, max_model_len, kv_cache_bytes, device_type, gpu_share)
    if device_type == "cuda" and settings["dtype"] == "float32":  # before the engine fails at its start
        raise UserError(
            f"models {', '.join(lora)} are LoRA adapters on one base, served by vLLM's LoRA kernels, "
            "which compute in bf16 or fp16 only; this run's trainer is fp32 (astuner.trainer_common.precision), "
            "and its engine computes as it does. Set astuner.trainer_common.precision: bf16 (auto is bf16 on "
            "CUDA), or astuner.rollout.engine: hf")
    from astuner.engine.vllm_adapters import AdapterVLLMEngine

    return AdapterVLLMEngine(base, lora, **settings)


# astuner.rollout.engine -> builder(typed config, model_path, tokenizer, max_model_len, kv_cache_bytes, gpu_share)
ENGINES = {"vllm": _vllm_engine, "hf": _hf_engine}
# The same engine over one base with LoRA adapters: builder(typed config, base folder, {model name: LoraSettings},
# tokenizer, max_model_len, kv_cache_bytes, gpu_share); vLLM's multi-LoRA (engine/vllm_adapters.py) or the HF
# engine's PEFT adapters (engine/adapters.py).
ADAPTER_ENGINES = {"vllm": _vllm_adapter_engine, "hf": _hf_adapter_engine}


def build_engine(typed, model_path: str, tokenizer, max_model_len: int, kv_cache_bytes: int | None = None, *,
                 engine: str, gpu_share: float | None = None):
    """The rollout engine named `engine` (config.derived.RunFacts.engine, or a teacher's teacher_engine);
    `kv_cache_bytes`: vLLM's KV cache on CPU as the memory fit sized it (preflight); `gpu_share`: vLLM's part of
    the GPU (None: rollout.gpu_memory_utilization)."""
    from astuner.phase import phase

    with phase(f"starting the {engine} engine ({Path(str(model_path)).name}, max_model_len {max_model_len})"):
        return ENGINES[engine](typed, model_path, tokenizer, max_model_len, kv_cache_bytes, gpu_share)


def build_adapter_engine(typed, engine: str, models, tokenizer, max_model_len: int, kv_cache_bytes: int | None,
                         gpu_share: float | None = None):
    """One engine named `engine` over the shared base of `models` (a `ModelSet`), with an adapter for each of its
    adapters at the adapter's own `ModelSpec.lora`."""
    from astuner.phase import phase

    adapters = [models[name] for name in models.adapters]
    base, lora = adapters[0].folder, {spec.name: spec.lora for spec in adapters}
    with phase(f"starting the {engine} engine ({Path(base).name} with adapters {', '.join(lora)}, max_model_len "
               f"{max_model_len})"):
        return ADAPTER_ENGINES[engine](typed, base, lora, tokenizer, max_model_len, kv_cache_bytes, gpu_share)
