"""The doctor's checks that load the model: the trainer (and its rotary buffers), a vLLM engine start, logprob
parity on a long sequence, a verified weight sync, and a sleep -> train step -> wake cycle (astuner/doctor/__init__.py).

Parity limits come from the dtype both sides compute in. The engine's logprobs of its own sampled tokens and
the trainer's recomputation of them differ only by kernels and summation order:
  fp32: mean |d| <= 1e-3 and max |d| <= 2e-2 (measured on CPU at 3k tokens: ~1e-5 mean);
  bf16: mean |d| <= 2e-2 and max |d| <= 0.3 (the GPU checklist's figures; rounding of 8-bit mantissas).
A mean past the limit that grows with position is the signature of a rounded rotary table.
"""

from __future__ import annotations

import copy
import time
from pathlib import Path

from astuner.doctor.base import GIB, Check, Context

PARITY_LIMITS = {"float32": (1e-3, 2e-2), "bfloat16": (2e-2, 0.3)}  # dtype -> (mean, max) of |logprob diff|
RESPONSE_TOKENS = 32


def _model_path(ctx: Context) -> str:
    if "model_path" not in ctx.built:
        from astuner.model_cache import resolve_model_path

        ctx.built["model_path"] = resolve_model_path(ctx.model)
    return ctx.built["model_path"]


def _precision(ctx: Context) -> str:
    from astuner.trainer.precision import resolve_precision

    return resolve_precision("auto", ctx.device)


def sync_bytes(ctx: Context) -> int:
    """Bytes of one synced copy of the model's weights (what /dev/shm must hold), from its config alone."""
    if ctx.quick:
        return 0
    from astuner.preflight import read_model_facts

    facts = read_model_facts(_model_path(ctx), "--model")
    return facts.num_params * (2 if _precision(ctx) == "bf16" else 4)


def float_buffers_not_fp32(model) -> list[str]:
    import torch

    return [name for name, b in model.named_buffers() if b.is_floating_point() and b.dtype != torch.float32]


def check_trainer(ctx: Context) -> Check:
    """Build the trainer at the device's precision; its floating buffers (rotary inv_freq) must stay fp32 under
    bf16, as vLLM keeps them, or logprobs drift with position. On an fp32 trainer a bf16 copy is probed."""
    from astuner.trainer.precision import MasterWeights
    from astuner.trainer import Trainer

    precision = _precision(ctx)
    trainer = Trainer(_model_path(ctx), precision=precision, lr=1e-6, seed=0)
    ctx.built["trainer"] = trainer
    model = trainer.model
    if precision != "bf16":
        model = copy.deepcopy(trainer.model)
        MasterWeights(model, "bf16")  # the cast a bf16 trainer makes
    rounded = float_buffers_not_fp32(model)
    params = sum(p.numel() for p in trainer.model.parameters())
    seen = f"{params / 1e6:.0f}M parameters, {precision} on {trainer.device}"
    if rounded:
        return Check("trainer", "fail", seen + f"; buffers rounded by the bf16 cast: {', '.join(rounded[:4])}",
                     "logprobs then drift with position on long sequences: update astuner")
    return Check("trainer", "pass", seen + "; floating buffers stay fp32 under the bf16 cast")


def check_engine_start(ctx: Context) -> Check:
    from astuner.config.derived import vllm_available

    if not vllm_available():
        return Check("engine start", "skip", "a vLLM engine start", "vLLM is not installed (see versions)")
    from astuner.engine.vllm_engine import VLLMEngine, engine_dtype

    from astuner.preflight import read_model_facts

    dtype = engine_dtype(_precision(ctx))
    limit = read_model_facts(_model_path(ctx), "--model").max_position_embeddings
    if limit is not None and ctx.parity_tokens + RESPONSE_TOKENS + 64 > limit:
        ctx.parity_tokens = limit - RESPONSE_TOKENS - 64  # the model's positions end there
    started = time.perf_counter()
    engine = VLLMEngine(_model_path(ctx), max_model_len=ctx.parity_tokens + RESPONSE_TOKENS + 64, max_num_seqs=4,
                        dtype=dtype, gpu_memory_utilization=0.5)
    ctx.built["engine"] = engine
    seconds = time.perf_counter() - started
    todo = ""
    if seconds > 300:
        todo = "slow start (compilation): later starts reuse vLLM's compile cache; raise the start timeout if " \
               "several engines start at once"
    return Check("engine start", "warn" if todo else "pass", f"vLLM {dtype} ready in {seconds:.0f} s", todo,
                 figures={"start_s": round(seconds, 1)})


def _needs(ctx: Context, name: str, *keys: str) -> Check | None:
    missing = [k for k in keys if k not in ctx.built]
    if missing:
        return Check(name, "skip", name, f"needs the {' and the '.join(missing)}, which did not start")
    return None


def long_prompt(tokenizer, tokens: int) -> list[int]:
    """A natural-text prompt of exactly `tokens` tokens: the package's README, repeated as needed."""
    root = Path(__file__).resolve().parent.parent
    text = next((p.read_text(errors="replace") for p in (root / "README.md", Path(__file__)) if p.is_file()), "")
    ids = tokenizer(text).input_ids or [0]
    while len(ids) < tokens:
        ids = ids + ids
    return ids[:tokens]


def parity(ctx: Context, prompt: list[int]) -> dict:
    """Sample a response on the engine at temperature 1 and recompute its logprobs on the trainer."""
    from astuner.types import SamplingParams

    engine, trainer = ctx.built["engine"], ctx.built["trainer"]
    result = engine.generate_batch([prompt], SamplingParams(temperature=1.0, max_tokens=RESPONSE_TOKENS))[0]
    ours = trainer.compute_logprobs(prompt, result.token_ids, 1.0)
    diffs = [abs(a - b) for a, b in zip(result.logprobs, ours)]
    return {"response": result.token_ids, "logprobs": result.logprobs, "mean": sum(diffs) / len(diffs),
            "max": max(diffs)}


def parity_verdict(mean: float, worst: float, dtype: str) -> tuple[str, str]:
    limit_mean, limit_max = PARITY_LIMITS[dtype]
    if mean <= limit_mean and worst <= limit_max:
        return "pass", ""
    return "fail", (f"over the {dtype} limits (mean {limit_mean:g}, max {limit_max:g}): the PPO ratio would be "
                    "biased on long trajectories. Check the engine's dtype matches the trainer's precision, and "
                    "that the trainer's rotary buffers are fp32 (the trainer check)")


def check_parity(ctx: Context) -> Check:
    name = "long-sequence parity"
    if (missing := _needs(ctx, name, "engine", "trainer")) is not None:
        return missing
    from astuner.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(_model_path(ctx))
    prompt = long_prompt(tokenizer, ctx.parity_tokens)
    ctx.built["prompt"] = prompt
    found = parity(ctx, prompt)
    ctx.built["sampled"] = found
    dtype = ctx.built["engine"].dtype
    status, todo = parity_verdict(found["mean"], found["max"], dtype)
    return Check(name, status, f"{len(found['response'])} sampled tokens after {len(prompt)}: mean |d logprob| "
                 f"{found['mean']:.2e}, max {found['max']:.2e} ({dtype})", todo,
                 figures={"mean": found["mean"], "max": found["max"], "prompt_tokens": len(prompt)})


def check_sync(ctx: Context) -> Check:
    name = "weight sync"
    if (missing := _needs(ctx, name, "engine", "trainer")) is not None:
        return missing
    engine = ctx.built["engine"]
    report = engine.load_weights(ctx.built["trainer"].named_parameters_for_sync())
    last = report.figures()
    seen = ", ".join(f"{k} {v:.3g}" for k, v in last.items())
    if last.get("verified", 1.0) != 1.0:
        return Check(name, "fail", seen, "the engine serves other weights than the trainer's: see the log",
                     figures=last)
    return Check(name, "pass", seen, figures=last)


def check_cycle(ctx: Context) -> Check:
    """sleep -> one train step -> release the trainer's cached memory -> wake by syncing -> parity again."""
    name = "sleep, train, wake"
    if (missing := _needs(ctx, name, "engine", "trainer", "sampled")) is not None:
        return missing
    import torch

    from astuner.types import Sample

    engine, trainer, sampled, prompt = (ctx.built[k] for k in ("engine", "trainer", "sampled", "prompt"))
    freed = None
    if ctx.device == "cuda":
        before = torch.cuda.mem_get_info()[0]
        engine.sleep()
        freed = (torch.cuda.mem_get_info()[0] - before) / GIB
    else:
        engine.sleep()  # a no-op on CPU: nothing to release
    metrics = trainer.train_step([Sample(prompt, sampled["response"], sampled["logprobs"], 1.0, 1.0, "doctor")])
    if ctx.device == "cuda":
        torch.cuda.empty_cache()
    synced = engine.load_weights(trainer.named_parameters_for_sync())
    after = parity(ctx, prompt)
    status, todo = parity_verdict(after["mean"], after["max"], engine.dtype)
    sleep = f"sleep freed {freed:.1f} GiB" if freed is not None else "sleep skipped (CPU)"
    seen = (f"{sleep}; train step grad norm {metrics.get('grad_norm', float('nan')):.3g}; sync verified "
            f"{1.0 if synced.verified is None else synced.verified:g}; parity after it: mean {after['mean']:.2e}, "
            f"max {after['max']:.2e}")
    if not metrics.get("num_optimizer_steps"):
        status, todo = "fail", "the train step made no optimizer step: see the log"
    elif synced.verified not in (None, 1.0):
        status, todo = "fail", "the sync after the train step did not take: see the log"
    return Check(name, status, seen, todo, figures={"freed_gib": freed, "mean": after["mean"], "max": after["max"]})


MODEL_CHECKS = {  # the engine before the trainer: vLLM's start claims its share of what is free on the GPU
    "engine start": check_engine_start,
    "trainer": check_trainer,
    "long-sequence parity": check_parity,
    "weight sync": check_sync,
    "sleep, train, wake": check_cycle,
}


def close(ctx: Context) -> None:
    ctx.built.pop("trainer", None)
    engine = ctx.built.pop("engine", None)
    if engine is not None:
        engine.shutdown()
