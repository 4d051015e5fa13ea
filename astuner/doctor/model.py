"""The doctor's checks that load the model: the trainer (and its rotary buffers), the engine's start, logprob
parity on a long sequence, a verified weight sync, and a sleep -> train step -> wake cycle (astuner/doctor/__init__.py).

They try the config they are given (`--conf`; without one, the packaged defaults on `--model`): every model of its
roster (astuner.model and astuner.models) is built as a debug run builds it (`run_models.build_models`: the
config's engine and its arguments, the trainer's precision and LoRA, adapters on a shared base sharing one
engine), and each model samples with its own temperature, top_p and top_k, which its trainer's recomputation
applies too.

Parity limits come from the dtype both sides compute in. The engine's logprobs of its own sampled tokens and
the trainer's recomputation of them differ only by kernels and summation order:
  fp32: mean |d| <= 1e-3 and max |d| <= 2e-2 (measured on CPU at 3k tokens: ~1e-5 mean);
  bf16: mean |d| <= 2e-2 and max |d| <= 0.3 (the GPU checklist's figures; rounding of 8-bit mantissas).
A mean past the limit that grows with position is the signature of a rounded rotary table.
"""

from __future__ import annotations

import asyncio
import copy
import time
from pathlib import Path

from astuner.config.derived import resolve_engine_name, run_facts, vllm_available
from astuner.doctor.base import GIB, Check, Context

PARITY_LIMITS = {"float32": (1e-3, 2e-2), "bfloat16": (2e-2, 0.3)}  # dtype -> (mean, max) of |logprob diff|
RESPONSE_TOKENS = 32


def _typed(ctx: Context):
    """The typed config the checks build from: --conf's, else the packaged defaults with --model."""
    if "typed" not in ctx.built:
        loaded = ctx.loaded
        if loaded is None:
            from astuner.config import load_config
            from astuner.config.compose import DEFAULT_CONFIG_DIR

            loaded = load_config(DEFAULT_CONFIG_DIR / "astuner_default.yaml", [f"astuner.model.path={ctx.model}"])
        ctx.built["typed"] = loaded.typed
    return ctx.built["typed"]


def _model_path(ctx: Context) -> str:
    if "model_path" not in ctx.built:
        from astuner.model_cache import resolve_model_path

        ctx.built["model_path"] = resolve_model_path(ctx.model)
    return ctx.built["model_path"]


def _models(ctx: Context):
    """The config's ModelSet, its first model's folder the one under test (--model)."""
    if "model_set" not in ctx.built:
        from astuner.runtime import model_set

        ctx.built["model_set"] = model_set(_typed(ctx), _model_path(ctx))
    return ctx.built["model_set"]


def _precision(ctx: Context) -> str:
    from astuner.trainer.precision import resolve_precision

    return resolve_precision(_typed(ctx).astuner.trainer_common.precision, ctx.device)


def _dtype(ctx: Context) -> str:
    """What engine and trainer compute in (the engine follows the trainer's precision)."""
    from astuner.engine.vllm_engine import engine_dtype

    return engine_dtype(_precision(ctx))


def sync_bytes(ctx: Context) -> int:
    """Bytes of one synced copy of the model's weights (what /dev/shm must hold), from its config alone."""
    if ctx.quick:
        return 0
    from astuner.preflight import read_model_facts

    facts = read_model_facts(_model_path(ctx), "--model")
    return facts.num_params * (2 if _precision(ctx) == "bf16" else 4)


def sampling_of(spec):
    """A model's sampling as its rollout calls use it (its `ModelSpec`)."""
    from astuner.types import SamplingParams

    return SamplingParams(max_tokens=RESPONSE_TOKENS, temperature=spec.temperature, top_p=spec.top_p,
                          top_k=spec.top_k)


def _max_model_len(ctx: Context) -> int:
    """Room for the parity prompt and its response, within the model's positions (the prompt shrinks to fit)."""
    if "max_model_len" not in ctx.built:
        from astuner.preflight import read_model_facts

        limit = read_model_facts(_model_path(ctx), "--model").max_position_embeddings
        if limit is not None and ctx.parity_tokens + RESPONSE_TOKENS + 64 > limit:
            ctx.parity_tokens = limit - RESPONSE_TOKENS - 64  # the model's positions end there
        ctx.built["max_model_len"] = ctx.parity_tokens + RESPONSE_TOKENS + 64
    return ctx.built["max_model_len"]


def _build(ctx: Context, role: str) -> dict:
    """Every model of the roster with `role` ("engine" or "trainer") built as a debug run builds it; merged into
    ctx.built["models"] ({name: run_models.LocalModel})."""
    from astuner.run_models import LocalModel, build_models
    from astuner.tokenizer import load_tokenizer

    typed = _typed(ctx)
    if "tokenizer" not in ctx.built:
        ctx.built["tokenizer"] = load_tokenizer(_model_path(ctx))
    steps = typed.astuner.trainer_common.total_training_steps or 1
    built = build_models(typed, run_facts(typed), ctx.built["tokenizer"], _models(ctx), _max_model_len(ctx), steps,
                         roles=(role,))
    models = ctx.built.setdefault("models", {})
    for name, model in built.items():
        have = models.setdefault(name, LocalModel(None, None, model.adapter))
        setattr(have, role, getattr(model, role))
    return built


def _roster_line(models: dict) -> str:
    if len(models) == 1:
        return ""
    shared = [n for n, m in models.items() if m.adapter]
    own = [n for n in models if n not in shared]
    parts = ([f"{', '.join(shared)} as adapters on one base"] if shared else []) + \
        ([f"{', '.join(own)} with weights of {'its' if len(own) == 1 else 'their'} own"] if own else [])
    return f"; models: {'; '.join(parts)}"


def float_buffers_not_fp32(model) -> list[str]:
    import torch

    return [name for name, b in model.named_buffers() if b.is_floating_point() and b.dtype != torch.float32]


def check_trainer(ctx: Context) -> Check:
    """Build every model's trainer as the config does (precision, LoRA, optimizer); their floating buffers (rotary
    inv_freq) must stay fp32 under bf16, as vLLM keeps them, or logprobs drift with position. On an fp32 trainer
    a bf16 copy is probed."""
    from astuner.trainer.precision import MasterWeights

    built = _build(ctx, "trainer")
    precision = _precision(ctx)
    kinds, rounded = [], []
    for name, model in built.items():
        trainer = model.trainer
        lora = trainer.settings.lora
        kinds.append(f"{name} {'LoRA rank %d' % lora.rank if lora else 'full fine-tuning'}")
        probe = trainer.model
        if precision != "bf16":
            probe = copy.deepcopy(trainer.model)
            MasterWeights(probe, "bf16")  # the cast a bf16 trainer makes
        rounded += [f"{name}: {b}" for b in float_buffers_not_fp32(probe)]
    first = next(iter(built.values())).trainer
    params = sum(p.numel() for p in first.model.parameters())
    seen = f"{params / 1e6:.0f}M parameters, {precision} on {first.device}; {', '.join(kinds)}"
    figures = {"models": {name: {"lora_rank": m.trainer.settings.lora.rank if m.trainer.settings.lora else 0}
                          for name, m in built.items()}}
    if rounded:
        return Check("trainer", "fail", seen + f"; buffers rounded by the bf16 cast: {', '.join(rounded[:4])}",
                     "logprobs then drift with position on long sequences: update astuner", figures=figures)
    return Check("trainer", "pass", seen + "; floating buffers stay fp32 under the bf16 cast", figures=figures)


def check_engine_start(ctx: Context) -> Check:
    """Start the engine(s) of the config's roster with the config's arguments (vLLM's share of the GPU, its
    max_num_seqs, tensor parallelism; adapters on one base in one engine)."""

    typed = _typed(ctx)
    name = resolve_engine_name(typed.astuner.rollout.engine)
    if name == "vllm" and not vllm_available():
        return Check("engine start", "skip", "a vLLM engine start", "vLLM is not installed (see versions)")
    started = time.perf_counter()
    built = _build(ctx, "engine")
    seconds = time.perf_counter() - started
    todo = ""
    if seconds > 300:
        todo = "slow start (compilation): later starts reuse vLLM's compile cache; raise the start timeout if " \
               "several engines start at once"
    label = "vLLM" if name == "vllm" else "the HF engine"
    share = f", gpu_memory_utilization {typed.astuner.rollout.gpu_memory_utilization:g}" \
        if name == "vllm" and ctx.device == "cuda" else ""
    return Check("engine start", "warn" if todo else "pass",
                 f"{label} {_dtype(ctx)} ready in {seconds:.0f} s{share}{_roster_line(built)}", todo,
                 figures={"start_s": round(seconds, 1), "engine": name, "models": list(built)})


def _needs(ctx: Context, name: str, *keys: str) -> Check | None:
    """Skip when a role some model lacks ("engine", "trainer"), or the sampled responses, did not get built."""
    models = ctx.built.get("models", {})
    missing = [k for k in keys if ((k not in ctx.built) if k == "sampled"
                                   else not models or any(getattr(m, k) is None for m in models.values()))]
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


def parity(model, prompt: list[int], sampling) -> dict:
    """Sample a response on the model's engine with its sampling settings and recompute its logprobs on its
    trainer (which applies the same temperature, top_p and top_k)."""
    result = asyncio.run(model.engine.generate(prompt, sampling))
    ours = model.trainer.compute_logprobs(prompt, result.token_ids, sampling.temperature)
    diffs = [abs(a - b) for a, b in zip(result.logprobs, ours)] or [0.0]
    return {"response": result.token_ids, "logprobs": result.logprobs, "mean": sum(diffs) / len(diffs),
            "max": max(diffs)}


def parity_verdict(mean: float, worst: float, dtype: str) -> tuple[str, str]:
    limit_mean, limit_max = PARITY_LIMITS[dtype]
    if mean <= limit_mean and worst <= limit_max:
        return "pass", ""
    return "fail", (f"over the {dtype} limits (mean {limit_mean:g}, max {limit_max:g}): the PPO ratio would be "
                    "biased on long trajectories. Check the engine's dtype matches the trainer's precision, and "
                    "that the trainer's rotary buffers are fp32 (the trainer check)")


def _parity_all(ctx: Context, prompt: list[int]) -> dict:
    """{model: parity(...) plus its sampling}, every model of the roster."""
    out = {}
    for name, model in ctx.built["models"].items():
        sampling = sampling_of(_models(ctx)[name])
        out[name] = {**parity(model, prompt, sampling), "temperature": sampling.temperature,
                     "top_p": sampling.top_p, "top_k": sampling.top_k}
    return out


def _parity_summary(found: dict) -> tuple[float, float, str, dict]:
    """The worst mean and max over the models, a line per model when there are several, and the figures."""
    mean, worst = max(f["mean"] for f in found.values()), max(f["max"] for f in found.values())
    per = {name: {k: f[k] for k in ("mean", "max", "temperature", "top_p", "top_k")} for name, f in found.items()}
    lines = "".join(f"\n{name} ({_sampling_words(f)}): mean {f['mean']:.2e}, max {f['max']:.2e}"
                    for name, f in found.items()) if len(found) > 1 else ""
    return mean, worst, lines, per


def _sampling_words(s: dict) -> str:
    words = [f"temperature {s['temperature']:g}"]
    words += [f"top_p {s['top_p']:g}"] if s["top_p"] < 1 else []
    words += [f"top_k {s['top_k']}"] if s["top_k"] else []
    return ", ".join(words)


def check_parity(ctx: Context) -> Check:
    name = "long-sequence parity"
    if (missing := _needs(ctx, name, "engine", "trainer")) is not None:
        return missing
    prompt = long_prompt(ctx.built["tokenizer"], ctx.parity_tokens)
    ctx.built["prompt"] = prompt
    found = _parity_all(ctx, prompt)
    ctx.built["sampled"] = found
    mean, worst, lines, per = _parity_summary(found)
    status, todo = parity_verdict(mean, worst, _dtype(ctx))
    first = next(iter(found.values()))
    sampling = f" ({_sampling_words(first)})" if len(found) == 1 else ""
    return Check(name, status, f"{len(first['response'])} sampled tokens after {len(prompt)}{sampling}: "
                 f"mean |d logprob| {mean:.2e}, max {worst:.2e} ({_dtype(ctx)})"
                 + lines, todo, figures={"mean": mean, "max": worst, "prompt_tokens": len(prompt), "models": per})


def check_sync(ctx: Context) -> Check:
    """Each model's sync; full weights must be verified by fingerprint. An adapter on a shared vLLM base is
    checked by file round trip (vLLM's stacked LoRA buffers cannot be read back): the parity after the train
    step (the next check) is what shows the engine took it."""
    from astuner.types import SyncReport

    name = "weight sync"
    if (missing := _needs(ctx, name, "engine", "trainer")) is not None:
        return missing
    reports = {model_name: model.sync() for model_name, model in ctx.built["models"].items()}
    unverified = [n for n, r in reports.items() if r.verified not in (None, 1.0)
                  and not ctx.built["models"][n].adapter]
    worst = SyncReport.worst(list(reports.values()))
    last = worst.figures()
    adapters = [n for n in reports if ctx.built["models"][n].adapter]
    # an adapter's 0 means "not fingerprinted" (said below), not a mismatch
    seen = ", ".join(f"{k} {v:.3g}" for k, v in last.items() if k != "verified" or len(adapters) < len(reports))
    if adapters:
        seen += f"; {', '.join(adapters)}: adapters, checked by file round trip and the parity after a train step"
    if unverified:
        return Check(name, "fail", seen, f"the engine of {', '.join(unverified)} serves other weights than the "
                     "trainer's: see the log", figures=last)
    return Check(name, "pass", seen, figures={**last, "adapters": adapters})


def check_cycle(ctx: Context) -> Check:
    """sleep -> one train step per model -> release the trainer's cached memory -> wake by syncing -> parity
    again. An engine serving adapters sleeps at level 1 (its base weights kept), a plain one at level 2."""
    name = "sleep, train, wake"
    if (missing := _needs(ctx, name, "engine", "trainer", "sampled")) is not None:
        return missing
    import torch

    from astuner.run_models import distinct_engines
    from astuner.types import Sample

    models, sampled, prompt = ctx.built["models"], ctx.built["sampled"], ctx.built["prompt"]
    engines = distinct_engines(models)
    levels = sorted({getattr(e, "SLEEP_LEVEL", None) for e in engines} - {None})
    freed = None
    before = torch.cuda.mem_get_info()[0] if ctx.device == "cuda" else None
    for engine in engines:
        engine.sleep()  # a no-op on CPU: nothing to release
    if before is not None:
        freed = (torch.cuda.mem_get_info()[0] - before) / GIB
    norms, stepped = [], True
    for model_name, model in models.items():
        found = sampled[model_name]
        metrics = model.trainer.train_step([Sample(prompt, found["response"], found["logprobs"], 1.0,
                                                   found["temperature"], "doctor")])
        norms.append(metrics.get("grad_norm", float("nan")))
        stepped = stepped and bool(metrics.get("num_optimizer_steps"))
    if ctx.device == "cuda":
        torch.cuda.empty_cache()
    synced = [model.sync() for model in models.values()]
    after = _parity_all(ctx, prompt)
    mean, worst, lines, per = _parity_summary(after)
    status, todo = parity_verdict(mean, worst, _dtype(ctx))
    sleep = f"sleep (level {'/'.join(map(str, levels))}) freed {freed:.1f} GiB" if freed is not None else \
        "sleep skipped (CPU)"
    verified = [r.verified for r, m in zip(synced, models.values()) if not m.adapter]
    sync = f"sync verified {min(v for v in verified if v is not None):g}" \
        if any(v is not None for v in verified) else "adapters synced"
    seen = (f"{sleep}; train step grad norm {', '.join(f'{g:.3g}' for g in norms)}; {sync}; parity after it: "
            f"mean {mean:.2e}, max {worst:.2e}" + lines)
    if not stepped:
        status, todo = "fail", "the train step made no optimizer step: see the log"
    elif any(v not in (None, 1.0) for v in verified):
        status, todo = "fail", "the sync after the train step did not take: see the log"
    return Check(name, status, seen, todo, figures={"freed_gib": freed, "mean": mean, "max": worst,
                                                    "sleep_levels": levels, "models": per})


MODEL_CHECKS = {  # the engine before the trainer: vLLM's start claims its share of what is free on the GPU
    "engine start": check_engine_start,
    "trainer": check_trainer,
    "long-sequence parity": check_parity,
    "weight sync": check_sync,
    "sleep, train, wake": check_cycle,
}


def close(ctx: Context) -> None:
    from astuner.run_models import distinct_engines

    models = ctx.built.pop("models", {})
    for engine in distinct_engines(models):
        engine.shutdown()
