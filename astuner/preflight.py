"""Checks and figures from the model's config alone, before any weight loads: the context limit, the parameter
count, a trainer memory estimate against this machine's memory, and the effective-config block printed at start.

Memory estimate (bytes, fp32 master weights with AdamW, as the trainer runs):
    trainer  = 16 * P          fp32: weights 4 + gradients 4 + Adam first and second moments 4 + 4
             = 18 * P          bf16 (CUDA default): weights 2 + fp32 master 4 + fp32 gradients 4 + Adam 8
             = 2 or 4 * P      LoRA: the frozen base in bf16 or fp32 (+5% for adapters and their states)
    engine   =  4 * P          the engine's own fp32 copy on CPU (hf, or vLLM's weights; its KV cache on top)
             + VLLM_CPU_RUNTIME  vLLM on CPU: its engine-core process and its worker's runtime, per engine
             =  u * M          vLLM on a GPU of M bytes: it reserves gpu_memory_utilization u for weights and KV
                               cache, and keeps it while the trainer's states stay resident
    ref      =  4 * P          the frozen reference model, only with the KL loss
    act      the trainer's activations and logits for one micro-batch of min(budget, the step's tokens) tokens
             (budget: trainer_common.micro_batch_token_budget; a sample longer than it forms its own micro-batch),
             the LM head as it runs: chunked on CUDA, plain on CPU, with top-k / top-p and entropy_coeff counted
    kv       the engine's KV cache: the HF engine's for max_env_worker sequences of max_model_len tokens; vLLM's on
             CPU is sized from the memory left (below); on a GPU vLLM's share u * M holds it
(formulas for act and kv: astuner/memory.py). On CPU the run must fit in the memory this machine has (less
RESERVE for the interpreter, data and allocator slack). vLLM's KV cache takes what it wants (max_num_seqs full-length
sequences) up to half of what is left after the weights, at least one full-length sequence; the micro-batch budget
is lowered to what the rest holds (the gradient is the same, micro-batches only cost time). A run where one
full-length sequence does not fit in both is refused before anything loads, with the figures.
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass, replace
from pathlib import Path

from astuner.algorithm.catalog import algorithm
from astuner.cuts import POLICIES as ON_CUT
from astuner.errors import UserError
from astuner.memory import DeviceFacts, ModelShape, available_memory, blocks_of, local_device
from astuner.resume import checkpoint_models

log = logging.getLogger(__name__)

GIB = 1024**3
RESERVE = GIB  # the interpreter, tokenizer, data and allocator slack beside the estimated tensors
# vLLM on CPU runs two processes beside the driver: the engine core (0.6 GiB resident) and the worker, whose
# resident size is 0.9 GiB over its weights and KV cache. Measured with the demo model (SmolLM2-135M, fp32) at
# 1 GiB of KV and 16 sequences and at 3 GiB and 64: 1.50 and 1.52 GiB over weights + KV, the same at both sizes.
VLLM_CPU_RUNTIME = int(1.5 * GIB)


@dataclass
class ModelFacts:
    path: str
    architecture: str
    num_params: int
    max_position_embeddings: int | None
    shape: ModelShape | None = None  # layers, widths, vocabulary: activations and KV cache (astuner/memory.py)


@dataclass
class RunPlan:
    """The effective numbers of a run, shown in one block at start."""

    backbone: str
    engine: str
    tasks_per_step: int
    episodes_per_step: int
    optimizer_steps_per_step: int
    micro_batch_token_budget: int
    total_steps: int
    max_model_len: int
    trainer_bytes: int
    engine_bytes: int
    ref_bytes: int
    available_bytes: int | None
    device: str
    sandbox: str = ""
    cuts: str = ""  # the three limits and what training does with a cut (astuner/cuts.py)
    activation_bytes: int = 0
    kv_cache_bytes: int = 0  # the engine's KV cache (vLLM on CPU: what it is given; on GPU: inside engine_bytes)
    kv_sequences: float = 0.0  # full-length sequences the KV cache holds
    resized: tuple[str, ...] = ()  # what the memory fit changed, in words
    misfit: str = ""  # why the run does not fit even with the least of everything (check_fits raises it)
    # astuner.models: each other model's trainer and engine, in bytes, and a line saying what they hold
    others_bytes: int = 0
    others: tuple[str, ...] = ()
    other_engines: int = 0  # engines of other models (an adapter on the policy's base has none of its own)
    engine_apart: bool = False  # the engines hold GPUs of their own (trinity's explorers), not the trainer's card
    teacher: tuple[int, str] = (0, "")  # a distillation teacher in the loop's process: its bytes, what it holds

    @property
    def engines(self) -> int:
        """Engines this process runs, each with a KV cache of kv_cache_bytes: the policy's and other models'."""
        return 1 + self.other_engines

    @property
    def weights_bytes(self) -> int:
        """Weights, gradients, optimizer states, the engine's and the reference model's weights (every model's),
        on the trainer's card or host (an engine apart, on cards of its own, is not on it)."""
        return self.trainer_bytes + (0 if self.engine_apart else self.engine_bytes) + self.ref_bytes + \
            self.others_bytes + self.teacher[0]

    @property
    def total_bytes(self) -> int:
        return self.weights_bytes + self.activation_bytes + self.kv_cache_bytes * self.engines

    def block(self, model: ModelFacts) -> str:
        available = "unknown" if self.available_bytes is None else f"{self.available_bytes / GIB:.1f} GiB"
        rows = [
            ("model", f"{model.path} ({model.architecture}, {model.num_params / 1e6:.1f}M parameters)"),
            ("backbone / engine", f"{self.backbone} / {self.engine} on {self.device}"),
            ("tasks per step", str(self.tasks_per_step)),
            ("episodes per step", str(self.episodes_per_step)),
            ("optimizer steps per step", str(self.optimizer_steps_per_step)),
            ("micro-batch token budget", str(self.micro_batch_token_budget)
             + "".join(f" ({r})" for r in self.resized if r.startswith("micro-batch"))),
            ("total steps", str(self.total_steps)),
            ("max_model_len", str(self.max_model_len)),
            *([("limits (cuts)", self.cuts)] if self.cuts else []),
            ("python tool sandbox", self.sandbox),
            (
                "memory estimate",
                f"{self.total_bytes / GIB:.1f} GiB (trainer {self.trainer_bytes / GIB:.1f}, engine "
                f"{self.engine_bytes / GIB:.1f}{' on GPUs of its own, not counted here' if self.engine_apart else ''}"
                f", KV cache {self.kv_cache_bytes / GIB:.1f} ({self.kv_sequences:.1f} "
                f"sequences of max_model_len){f' x {self.engines} engines' if self.engines > 1 else ''}, "
                f"reference {self.ref_bytes / GIB:.1f}, activations {self.activation_bytes / GIB:.1f}"
                f"{f', other models {self.others_bytes / GIB:.1f}' if self.others else ''}"
                f"{f', teacher {self.teacher[0] / GIB:.1f}' if self.teacher[1] else ''}); available {available}",
            ),
        ]
        rows[1:1] = [("other model", line) for line in self.others] + [("teacher", self.teacher[1])] * bool(
            self.teacher[1])
        rows += [("memory fit", note) for note in self.resized if not note.startswith("micro-batch")]
        width = max(len(k) for k, _ in rows)
        return "effective config:\n" + "\n".join(f"  {k.ljust(width)}  {v}" for k, v in rows)


def read_model_facts(model_path: str, key: str = "astuner.model.path") -> ModelFacts:
    """config.json alone: architecture, exact parameter count (built on the meta device), position limit."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    if (folder := Path(model_path)).is_dir() and not (folder / "config.json").is_file():
        models = checkpoint_models(folder)  # a checkpoint of several models holds a folder per model
        raise UserError(
            f"{key}: {model_path} has no config.json, so it is not a Hugging Face model folder. " + (
                f"It holds a checkpoint of several models: name one, e.g. {folder / models[0]} (its models: "
                f"{', '.join(models)})." if models else "Point it at the folder that holds config.json, the weights "
                "(*.safetensors) and the tokenizer files."))
    try:
        config = AutoConfig.from_pretrained(model_path)
    except (OSError, ValueError, KeyError) as exc:
        raise UserError(f"{key}: cannot read the model config of {model_path!r}: {' '.join(str(exc).split())}") from None
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    except (ValueError, KeyError) as exc:
        raise UserError(
            f"{key}: {model_path!r} is not a causal language model transformers can build "
            f"({' '.join(str(exc).split())[:300]})."
        ) from None
    num_params = sum(p.numel() for p in model.parameters())
    limit = getattr(config, "max_position_embeddings", None)
    return ModelFacts(str(model_path), type(model).__name__, num_params, int(limit) if limit else None,
                      ModelShape.from_config(config))


def resolve_max_model_len(configured: int | None, facts: ModelFacts, per_turn: int | None = None) -> int:
    """The configured context limit (null: the model's position limit), checked against the model and the
    per-turn cap."""
    limit = facts.max_position_embeddings
    if configured is None and limit is None:
        raise UserError(
            f"astuner.rollout.max_model_len is null (use the model's limit), but {facts.path} does not state "
            "max_position_embeddings; set astuner.rollout.max_model_len."
        )
    if configured is not None and limit is not None and configured > limit:
        raise UserError(
            f"astuner.rollout.max_model_len={configured} is longer than the model's position limit "
            f"(max_position_embeddings={limit} in {facts.path}/config.json): positions past it were never trained "
            f"and give garbage. Set it to {limit} or less, or null for the model's limit."
        )
    resolved = limit if configured is None else configured
    if per_turn is not None and per_turn >= resolved:
        raise UserError(
            f"astuner.rollout.max_response_length_in_one_turn={per_turn} leaves no room for a prompt in "
            f"max_model_len={resolved} (prompt + response of one call); make it smaller than max_model_len."
        )
    return resolved


def optimizer_steps_per_step(typed) -> int:
    """Optimizer steps one training step takes: ppo_epochs x mini_batch_num for RL, mini_batch_num for SFT and
    RFT, one for the preference losses."""
    tc = typed.astuner.trainer_common
    return algorithm(tc.algorithm.type).optimizer_steps(tc.mini_batch_num, tc.ppo_epochs)


def trainer_bytes(P: int, precision: str, lora: bool) -> int:
    if lora:  # frozen base weights only; adapters, their gradients and Adam states are a few % of them
        return int(_base_bytes(P, precision) * 1.05)
    return (18 if precision == "bf16" else 16) * P


def _base_bytes(P: int, precision: str) -> int:
    """A LoRA trainer's frozen base weights."""
    return (2 if precision == "bf16" else 4) * P


def make_plan(typed, backbone: str, facts: ModelFacts, max_model_len: int, total_steps: int,
              device_facts: DeviceFacts | None = None, others: dict[str, ModelFacts] | None = None,
              teacher: ModelFacts | None = None) -> RunPlan:
    """The run's plan for a trainer on `device_facts` (None: this process's device, `local_device`); `others`:
    the facts of astuner.models by name, whose trainers and engines it counts too; `teacher`: the facts of a
    model-folder distillation teacher, counted where the backbone loads it in its one process (`teacher_memory`)."""
    from astuner.tools.python_exec import describe_sandbox

    from astuner.config.backbones import backbone as backbone_record
    from astuner.config.derived import resolve_engine_name
    from astuner.trainer.precision import resolve_precision

    a, tc = typed.astuner, typed.astuner.trainer_common
    found = device_facts or local_device()
    device = found.type
    P = facts.num_params
    engine = resolve_engine_name(a.rollout.engine)
    # processes of this run that may share one host's memory; fsdp2 shards weights, gradients and AdamW state (and
    # the reference model) over the trainer workers, the policy's and other models' with groups of their own
    record = backbone_record(backbone)
    processes, shards, other_shards = _ray_placement(typed, record, device) if record.on_ray else (1, 1, {})
    engine_bytes = 4 * P
    kind = algorithm(tc.algorithm.type)
    offline = kind.offline
    if offline:
        engine, engine_bytes = "none (offline data)", 0
    elif engine == "vllm" and device == "cuda":  # its share of the card (unknown card: not counted)
        engine_bytes = int(a.rollout.gpu_memory_utilization * (found.total_bytes or 0))
    elif engine == "vllm":
        engine_bytes += VLLM_CPU_RUNTIME
    precision = resolve_precision(tc.precision, device)
    plan = RunPlan(
        backbone=backbone,
        engine=engine,
        tasks_per_step=a.data.train_batch_size,
        episodes_per_step=0 if offline else a.data.train_batch_size * a.rollout.num_repeat,
        optimizer_steps_per_step=optimizer_steps_per_step(typed),
        micro_batch_token_budget=tc.micro_batch_token_budget,
        total_steps=total_steps,
        max_model_len=max_model_len,
        trainer_bytes=trainer_bytes(P, precision, tc.lora.rank > 0) // shards,
        engine_bytes=engine_bytes,
        ref_bytes=4 * P // shards if tc.use_kl_loss or kind.needs_reference else 0,
        available_bytes=found.free_bytes if device == "cuda" else available_memory(device),
        device=device,
        sandbox=describe_sandbox(a.rollout.python_tool_unsandboxed).removeprefix("python tool sandbox: "),
        cuts="" if offline else _cuts_line(typed, max_model_len),
        # trinity's explorers run their engines on GPUs of their own (ray_worker.ENGINE_ALONE_GPU_SHARE): a trainer
        # rank's card holds its trainer only
        engine_apart=record.explorers and device == "cuda" and not offline,
    )
    if others:
        plan = replace(plan, **_other_models(typed, others, precision, engine_bytes, facts, other_shards))
    if teacher is not None and not record.on_ray:
        plan = replace(plan, teacher=teacher_memory(typed, teacher, device, max_model_len))
    return fit_memory(plan, facts.shape, typed, precision, processes)


def teacher_memory(typed, teacher: ModelFacts, device: str, max_model_len: int) -> tuple[int, str]:
    """(bytes, the plan's line) of a model-folder teacher (`teacher`: its facts) on its engine
    (config.derived.teacher_engine): the HF engine's fp32 weights (it loads fp32 everywhere); vLLM on CPU its fp32
    weights, runtime and its own KV cache (rollout.max_num_seqs full-length sequences, as an engine started outside
    the memory fit takes: `cpu_kv_cache_bytes`); vLLM on a GPU nothing more, since it takes its part of the run's
    share (distill.build_teacher)."""
    from astuner.config.derived import teacher_engine

    engine = teacher_engine(typed)
    held = 4 * teacher.num_params
    if engine == "vllm" and device == "cuda":
        held, where = 0, "its part of astuner.rollout.gpu_memory_utilization, split with the run's engines"
    elif engine == "vllm":
        kv = cpu_kv_cache_bytes(teacher.path, max_model_len, typed.astuner.rollout.max_num_seqs, "float32")
        held += VLLM_CPU_RUNTIME + kv
        where = f"fp32 weights, vLLM's runtime and a KV cache of {kv / GIB:.1f} GiB"
    else:
        where = "fp32 weights"
    return held, (f"{teacher.path} ({teacher.architecture}, {teacher.num_params / 1e6:.1f}M parameters) on {engine}: "
                  f"{held / GIB:.2f} GiB ({where})")


def cpu_kv_cache_bytes(model_path: str, max_model_len: int, max_num_seqs: int, dtype: str,
                       available: int | None = None) -> int:
    """The KV cache of an engine started outside a run's memory fit (`astuner eval`, the warm start): max_num_seqs
    sequences of max_model_len tokens (rounded up to whole GiB, at most 16 GiB), but at most half of what the
    model's weights leave of the available memory (`available`, default: what vLLM checks, the NUMA node's:
    memory.available_memory), and at least one full-length sequence (more wait their turn)."""
    import json
    from types import SimpleNamespace

    try:
        config = json.loads((Path(model_path) / "config.json").read_text())
        shape = ModelShape.from_config(SimpleNamespace(**config))
    except (OSError, ValueError, TypeError):
        config, shape = {}, None
    if shape is None:
        return 4 * 2**30
    per_seq = shape.kv_bytes_per_token(4 if dtype == "float32" else 2) * blocks_of(max_model_len)
    wanted = min(16 * 2**30, max(2**30, -(-per_seq * max_num_seqs // 2**30) * 2**30))
    available = available_memory("cpu") if available is None else available
    if available is None:
        return wanted
    stored = sum(f.stat().st_size for f in Path(model_path).glob("*.safetensors"))
    widen = 2 if dtype == "float32" and config.get("torch_dtype") in ("bfloat16", "float16") else 1
    room = (available - stored * widen) // 2
    kv = max(per_seq, min(wanted, room))
    if kv < wanted:
        log.info("vLLM KV cache %.2f GiB (%.1f of max_num_seqs=%d sequences of %d tokens): half of what the weights "
                 "leave of %.1f GiB available", kv / 2**30, kv / per_seq, max_num_seqs, max_model_len,
                 available / 2**30)
    return int(kv)


def _cuts_line(typed, max_model_len: int) -> str:
    """The three limits an episode may be cut by, and what training does with a cut (rollout.on_cut)."""
    a = typed.astuner
    return (f"turn cap {a.rollout.max_response_length_in_one_turn}, episode budget {a.data.max_response_length}, "
            f"window {max_model_len} tokens; rollout.on_cut {a.rollout.on_cut}: {ON_CUT[a.rollout.on_cut]}")


def _ray_placement(typed, backbone, device: str) -> tuple[int, int, dict[str, int]]:
    """(processes, the policy's shards, {model: shards} of models with trainer groups of their own) of a Ray
    backbone (its record); UserError for a strategy a group cannot take (fsdp2 with LoRA), naming the model."""
    from astuner.config.model_set import model_set
    from astuner.config.schema_models import shared_trainer_group, strategy_of
    from astuner.trainer.fsdp import resolve_strategy

    a, tc = typed.astuner, typed.astuner.trainer_common
    world = tc.nnodes * tc.n_gpus_per_node
    shared = shared_trainer_group(typed, backbone.name)
    groups = 1 if shared or not a.models else 1 + len(a.models)  # trinity's trainer_groups: per_model
    processes = world * groups + (tc.n_explorers if backbone.explorers else 0)
    who, other_shards = None, {}
    try:
        in_group = 1 + len(a.models) if shared else 1
        shards = world if resolve_strategy(strategy_of(typed, in_group), world, device,
                                           tc.lora.rank > 0) == "fsdp2" else 1
        models = model_set(typed)
        for who in a.models if not shared else ():  # a group each: its own strategy, with its own LoRA rank
            own = resolve_strategy(strategy_of(typed, 1), world, device, models[who].lora_rank > 0)
            other_shards[who] = world if own == "fsdp2" else 1
    except ValueError as exc:
        where = f" (model {who}, a trainer group of its own)" if who else ""
        raise UserError(f"astuner.trainer_common.strategy{where}: {exc}") from None
    return processes, shards, other_shards


def _other_models(typed, others: dict[str, ModelFacts], precision: str, policy_engine_bytes: int,
                  policy: ModelFacts, shards: dict[str, int] | None = None) -> dict:
    """RunPlan's `others_bytes` and `others` lines: each model's trainer (its own LoRA rank; divided by `shards`
    where its own trainer group shards it) and engine (on CPU, or HF, its weights as the policy's; on vLLM on a
    GPU none, since the run's engines split the policy's share: config.derived.gpu_share_per_engine). An adapter
    on the first model's LoRA base (ModelSpec.adapter) adds its adapter only: trainer and engine share the base."""
    from astuner.config.model_set import model_set

    models = model_set(typed).resolved(lambda spec: others[spec.name].path if spec.name in others else policy.path)
    total, lines, engines = 0, [], 0
    for name, f in others.items():
        lora, shared = models[name].lora_rank > 0, models[name].adapter
        trainer = trainer_bytes(f.num_params, precision, lora) // (shards or {}).get(name, 1)
        if shared:  # the frozen base is held once, in the policy's trainer and engine
            trainer, engine = trainer - _base_bytes(f.num_params, precision), 0
        elif policy_engine_bytes - 4 * policy.num_params in (0, VLLM_CPU_RUNTIME):  # on CPU: this model's
            engine = 4 * f.num_params + policy_engine_bytes - 4 * policy.num_params
        else:  # vLLM on a GPU: the policy's share holds every engine (or none, offline)
            engine = 0
        total += trainer + engine
        engines += not shared
        what = "LoRA adapter on the policy's base; " if shared else ""
        lines.append(f"{name}: {f.path} ({f.architecture}, {f.num_params / 1e6:.1f}M parameters; {what}trainer "
                     f"{trainer / GIB:.2f} GiB, engine {engine / GIB:.2f} GiB)")
    return {"others_bytes": total, "others": tuple(lines), "other_engines": engines}


def fit_memory(plan: RunPlan, shape: ModelShape | None, typed, precision: str, processes: int = 1) -> RunPlan:
    """The plan with activations and KV cache counted, vLLM's CPU KV cache sized and the micro-batch budget
    lowered to what memory holds (module docstring); UserError with the figures when one full-length sequence
    does not fit. `processes`: the run's processes that may share this host (Ray backbones)."""
    from astuner.algorithm.sampling_filter import is_filtered
    from astuner.trainer.fused_head import CHUNK_ROWS

    if shape is None:
        return plan
    a, tc = typed.astuner, typed.astuner.trainer_common
    L = plan.max_model_len
    value_bytes = 2 if precision == "bf16" else 4
    # The trainer's chunked head runs on CUDA, except for distillation's top-k term (the plain head's full logits).
    topk = algorithm(tc.algorithm.type).has_teacher and tc.algorithm.distill_topk > 0
    chunk_rows = CHUNK_ROWS if plan.device == "cuda" and not topk else None
    # What the head holds depends on the rollout's top-k / top-p and on whether the entropy is trained.
    filtered = is_filtered(a.rollout.top_k, a.rollout.top_p)
    entropy_grad = tc.entropy_coeff > 0
    step_tokens = (plan.episodes_per_step or plan.tasks_per_step) * L  # offline: conversations or pairs
    budget = plan.micro_batch_token_budget

    def act(tokens: int) -> int:
        return shape.activation_bytes(max(min(tokens, step_tokens), L), value_bytes, tc.gradient_checkpointing,
                                      chunk_rows, filtered, entropy_grad)

    per_seq = shape.kv_bytes_per_token(4 if plan.device == "cpu" else value_bytes) * blocks_of(L)
    cpu_vllm = plan.engine == "vllm" and plan.device == "cpu"
    kv = _wanted_kv_bytes(plan, a.rollout, per_seq, cpu_vllm)
    fixed = plan.weights_bytes
    resized: list[str] = []
    misfit = ""
    if plan.device == "cpu" and plan.available_bytes is not None \
            and os.environ.get("ASTUNER_SKIP_MEMORY_CHECK") != "1":
        room = plan.available_bytes // processes - RESERVE - fixed
        kv_least = per_seq if cpu_vllm else kv  # vLLM: one full-length sequence; HF: its cache grows to kv
        if act(L) + kv_least * plan.engines > room:
            misfit = _misfit_message(plan, processes, cpu_vllm, kv_least, act(L))
        else:
            if cpu_vllm:  # KV up to half of what is left, keeping room for one full-length micro-batch
                kv = max(per_seq, min(kv, room // (2 * plan.engines), (room - act(L)) // plan.engines))
            room -= kv * plan.engines
            if act(budget) > room:
                lo = _largest_fitting_budget(act, L, budget, room)
                resized.append(f"micro-batch budget lowered from {budget} to {lo} tokens to fit in memory "
                               f"(astuner.trainer_common.micro_batch_token_budget; the gradient is the same)")
                budget = lo
        if cpu_vllm and kv < a.rollout.max_num_seqs * per_seq:
            resized.append(f"vLLM KV cache sized to {kv / GIB:.1f} GiB from the memory left ({kv / per_seq:.1f} "
                           f"of max_num_seqs={a.rollout.max_num_seqs} full-length sequences; more wait their turn)")
    return replace(plan, micro_batch_token_budget=budget, activation_bytes=act(budget), kv_cache_bytes=kv,
                   kv_sequences=kv / per_seq if per_seq else 0.0, resized=tuple(resized), misfit=misfit)


def _wanted_kv_bytes(plan: RunPlan, rollout, per_seq: int, cpu_vllm: bool) -> int:
    """The engine's KV cache before any fit: the HF engine's for the episodes it serves at once, vLLM's on CPU
    for max_num_seqs full-length sequences; per_seq bytes each."""
    if plan.engine == "hf":
        return min(rollout.max_env_worker, plan.episodes_per_step) * per_seq
    if cpu_vllm:
        return rollout.max_num_seqs * per_seq
    return 0  # vLLM on a GPU: inside its gpu_memory_utilization share


def _misfit_message(plan: RunPlan, processes: int, cpu_vllm: bool, kv_least: int, act_bytes: int) -> str:
    """Why the run does not fit even with one full-length micro-batch (`act_bytes`) and the least KV cache, with
    the figures and what to change."""
    L = plan.max_model_len
    with_processes = " (with its processes)" if cpu_vllm else ""
    return (
        f"this run does not fit in {plan.available_bytes / GIB:.1f} GiB of memory"
        f"{f' shared by {processes} processes' if processes > 1 else ''}: weights, gradients and "
        f"optimizer states {(plan.trainer_bytes + plan.ref_bytes) / GIB:.1f} GiB, the engine's weights "
        f"{plan.engine_bytes / GIB:.1f} GiB{with_processes}, a KV cache for {'one sequence' if cpu_vllm else 'its sequences'} "
        f"of max_model_len={L} tokens {kv_least / GIB:.1f} GiB, and the activations of one {L}-token "
        f"micro-batch {act_bytes / GIB:.1f} GiB, beside {RESERVE / GIB:.0f} GiB for the process itself. Lower "
        "astuner.rollout.max_model_len, set astuner.trainer_common.gradient_checkpointing: true, use a "
        "smaller model or trainer_common.lora; or set ASTUNER_SKIP_MEMORY_CHECK=1 to try anyway.")


def _largest_fitting_budget(act, lo: int, hi: int, room: int) -> int:
    """The largest micro-batch token budget whose activations `act(budget)` fit in `room`, by bisection between
    `lo` (fits) and `hi` (does not)."""
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if act(mid) <= room else (lo, mid)
    return lo


def check_fits(plan: RunPlan, facts: ModelFacts) -> None:
    """Refuse, before loading, a run whose weights and optimizer alone cannot fit (ASTUNER_SKIP_MEMORY_CHECK=1 skips)."""
    if os.environ.get("ASTUNER_SKIP_MEMORY_CHECK") == "1" or plan.available_bytes is None:
        return
    if plan.weights_bytes > plan.available_bytes:
        need = math.ceil(plan.weights_bytes / GIB)
        raise UserError(
            f"{facts.path} has {facts.num_params / 1e9:.2f}B parameters: training it with AdamW on one "
            f"{plan.device} needs about {need} GiB for weights, gradients, optimizer states and the engine's copy "
            f"(before activations), but {plan.available_bytes / GIB:.1f} GiB is available. Use a smaller model "
            "(e.g. demo:smollm2-135m-instruct or a 0.5B model) or trainer_common.lora (the frozen base is all it "
            "holds in full) on this machine, or a GPU cluster backbone; set "
            "ASTUNER_SKIP_MEMORY_CHECK=1 to try anyway."
        )
    if plan.misfit:
        raise UserError(plan.misfit)
