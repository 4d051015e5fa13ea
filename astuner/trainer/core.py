"""The policy trainer: PyTorch + transformers only (no Ray, no vLLM, no rollouts).

A small client: losses are objects handed to it (`algorithm/objectives.py`), not branches inside it.
    forward_backward(batch, objective)  backward one mini-batch's loss into the gradients, micro-batch by micro-batch
    optim_step(adam=None)                grad-norm clip, AdamW step at the scheduled learning rate (or the caller's)
    forward_logprobs(samples)            the response tokens' logprobs (`trainer/forward.py`)
    state_dict() / load_state_dict()     weights, optimizer and step count (`trainer/checkpoint.py` writes them)
    train(samples, objective)            one whole step (`trainer/step.py`) -> TrainResult(metrics, trainer logprobs)

`forward_backward` on a mini-batch:
  1. token weights over the mini-batch (`algorithm.loss.token_weights`), so the mini-batch loss is a plain
     weighted token sum and gradient accumulation over micro-batches is exact;
  2. micro-batches by token budget: samples sorted by length (longest first), greedily packed while
     `max_len_in_micro_batch * n_samples <= max_token_len_per_micro_batch` (a sample over budget goes alone;
     `step_plan.py`);
     samples whose inputs share a prefix (a task's repeats) stay together, and the prefix is forwarded once
     (`step_plan.split_shared_micro_batches`, `trainer/forward.py`);
  3. per micro-batch: logprobs (and entropies) of the response tokens, the objective's loss, backward.
The learning rate of each optimizer step comes from `step_plan.lr_at` (linear warmup, then constant, cosine or
linear).

Not computed, on purpose: an old-logprob pass (old logprobs are the engine's sampling logprobs unless the objective
recomputes them), a reference forward unless the objective needs one. Samples whose advantage is exactly 0 are not
forwarded when the objective says their gradient is 0 (`trains_zero_advantage`); they still count in the token
weights, so the result is unchanged.

Precision (`astuner/trainer/precision.py`): fp32 on CPU; on CUDA bf16 weights and compute with fp32 master weights and
fp32 AdamW state. A worker of a trainer group (`join_group`) trains data-parallel, with a whole replica (ddp,
`trainer/data_parallel.py`) or sharded (fsdp2, `trainer/fsdp.py`). Built knowing it will shard (settings `strategy`, `group_size`),
the trainer keeps the whole fp32 model on the host until `join_group` shards it: only each worker's share reaches
its device, never the whole model and its fp32 masters (>= 8 bytes a parameter on every GPU).
The model stays in eval mode (no dropout), so that before any update the trainer's logprobs match the engine's.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Iterator

import torch
from torch import Tensor

from astuner.trainer import checkpoint, fsdp
from astuner.algorithm.objectives import TokenObjective, token_objective
from astuner.trainer.lora import apply_lora, merged_named_tensors, set_adapter_dropout
from astuner.trainer.precision import MasterWeights, cast_parameters, resolve_precision
from astuner.step_plan import PrefixGroup, lr_at, plan_micro_batches
from astuner.trainer.forward import active_dropout, check_fast_head, head_path, response_logprobs
from astuner.trainer.settings import AdamStep, TrainerSettings
from astuner.trainer.step import forward_backward, optimizer_step, train_step
from astuner.types import Sample, TrainResult


class Trainer:
    def __init__(self, model_path: str, settings: TrainerSettings | None = None, **fields):
        """`settings`, or its fields as keywords (`Trainer(path, lr=1e-6, ...)`)."""
        from transformers import AutoModelForCausalLM

        if settings is not None and fields:
            raise TypeError("give either a TrainerSettings or its fields as keywords, not both")
        self.settings = s = settings if settings is not None else TrainerSettings(**fields)
        self.model_path = str(model_path)
        self.device = torch.device(s.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.optimizer_steps = 0
        self.dp = None  # a data_parallel.DataParallel when this is one worker of a trainer group
        lora = s.lora is not None and s.lora.enabled
        # Sharded later: everything stays on the host (from_pretrained loads there) until join_group.
        self.shard_on_join = s.group_size > 1 and \
            fsdp.resolve_strategy(s.strategy, s.group_size, self.device.type, lora) == "fsdp2"

        # The seed only matters if the checkpoint lacks some weights (they are then initialised at random);
        # fork_rng keeps the caller's global RNG untouched.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(s.seed)
            model = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=torch.float32)
        self.precision = resolve_precision(s.precision, self.device.type)
        if lora and self.precision == "bf16" and not self.shard_on_join:
            # The frozen base is held in bf16 (MasterWeights casts it): cast it here, on the host, so the device
            # never holds an fp32 copy of it (4 bytes a parameter beside an awake engine, where 2 are planned).
            cast_parameters(model, torch.bfloat16)
        self.model = (model if self.shard_on_join else model.to(self.device)).eval()
        if s.gradient_checkpointing:
            # Hugging Face recomputes activations only in train mode; that mode must then compute what eval mode
            # does (no dropout), or the PPO ratio would not start at 1.
            active = active_dropout(self.model)
            if active:
                raise ValueError(f"gradient_checkpointing needs a model without dropout; {self.model_path} has "
                                 f"{', '.join(active)}: set them to 0 in its config.json")
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.peft = None  # the PEFT wrapper when LoRA is on (astuner/trainer/lora.py); self.model is its inner HF model
        if lora:
            # The adapters' random init from the seed alone, not from what the process drew before (a trinity
            # trainer worker builds no engine first, the debug process does): the same run on any backbone.
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(s.seed)
                self.peft = apply_lora(self.model, s.lora)
            self.model = self.peft.get_base_model()
        self._adamw = dict(lr=s.lr, weight_decay=s.weight_decay, fused=self.device.type == "cuda")
        self.master = self.params = self.optimizer = None
        if not self.shard_on_join:  # sharded, the fp32 shards are the masters (join_group)
            self._own_weights(self.precision)  # under bf16 the parameters become bf16 (trainer/precision.py)
        self.ref_model = None  # frozen initial policy: for the KL loss and for DPO
        if s.needs_reference:  # compute-dtype parameters, the model's buffers (precision.cast_parameters)
            self.ref_model = copy.deepcopy(self.model).eval().requires_grad_(False)
            cast_parameters(self.ref_model, self.compute_dtype)

        self.root = self._ref_root = None  # fsdp.Root units when the group shards the model (join_group)
        # Sharded, the fast-head check waits for the shards (join_group).
        self.head = head_path(self.model, self.device, s, fast=not self.shard_on_join and
                              check_fast_head(self.model, self.device))

    def _own_weights(self, precision: str) -> None:
        """The weights AdamW steps (fp32 always: the model's own, or masters of its bf16 parameters) and AdamW."""
        self.master = MasterWeights(self.model, precision)
        self.params = self.master.masters
        self.optimizer = torch.optim.AdamW(self.params, **self._adamw)

    # --- trainer group ---------------------------------------------------------------------------------------

    def join_group(self, dp, strategy: str | None = None) -> str:
        """Become one worker of a data-parallel group (`data_parallel.DataParallel`, its process group up); with
        strategy fsdp2 (None: the settings') shard the model, the reference model and the optimizer over it
        (`trainer/fsdp.py`). Call before any step or checkpoint load. Returns the strategy in force."""
        self.dp = dp
        strategy = self.settings.strategy if strategy is None else strategy
        sharded = dp.world > 1 and \
            fsdp.resolve_strategy(strategy, dp.world, self.device.type, self.peft is not None) == "fsdp2"
        if self.shard_on_join and not sharded:
            raise ValueError(f"this trainer was built to shard over {self.settings.group_size} workers (strategy "
                             f"{self.settings.strategy}) and joins {dp.world} with strategy {strategy}: build it "
                             "with the strategy and group_size of the group it joins")
        if not sharded:
            return "ddp"
        if not self.shard_on_join:  # built not knowing: the whole model is on the device already
            self.master.unify(self.model)  # the fp32 shards are the master weights from here on
        # fully_shard moves each unit's parameters to the device whole, then keeps its shard: a reference held
        # anywhere else (masters, optimizer) would keep every whole parameter alive there.
        self.master = self.params = self.optimizer = None
        self.head.shared_prefix = 0
        self.root = fsdp.shard(self.model, dp.world, self.device.type, self.compute_dtype)
        if self.ref_model is not None:
            self._ref_root = fsdp.shard(self.ref_model, dp.world, self.device.type, self.compute_dtype)
        self._own_weights("fp32")
        if self.shard_on_join:
            with torch.no_grad():  # a collective: every worker checks
                self.head.fast = self.root.run(check_fast_head, self.model, self.device)
        return "fsdp2"

    def check_joined(self) -> None:
        if self.shard_on_join and self.root is None:
            raise RuntimeError(f"this trainer shards over {self.settings.group_size} workers and its model is "
                               "still on the host: call join_group before any forward, step, sync or checkpoint")

    @property
    def sharded(self) -> bool:
        return self.root is not None

    @property
    def compute_dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.precision == "bf16" else torch.float32

    def micro_batches(self, samples: list[Sample], backward: bool = False, reference: bool = False,
                      paired: bool = False) -> Iterator[tuple[list[int], list[PrefixGroup] | None]]:
        """Indices of `samples` per micro-batch and how they are forwarded (`step_plan.plan_micro_batches`).
        Sharded, every forward is collective: after its own, a worker runs pad passes (a forward, with `reference`
        of the reference too, and with `backward` a backward) up to the busiest worker's count."""
        micro_batches = plan_micro_batches(samples, self.settings.max_token_len_per_micro_batch,
                                           self.head.shared_prefix, paired)
        # The count is agreed before any forward: a collective of its own, it must not interleave with theirs.
        pads = 0 if self.root is None else self.dp.max_int(len(micro_batches)) - len(micro_batches)
        yield from micro_batches
        for _ in range(pads):
            self._pad_pass(backward, reference)

    def _pad_pass(self, backward: bool, ref: bool) -> None:
        """A one-token forward (and a backward of 0 x its logprob) that joins the other workers' collectives."""
        dummy = Sample([self.head.pad_id], [self.head.pad_id], [0.0], 0.0, 1.0, "")
        if ref:
            with torch.no_grad():
                self.forward_logprobs([dummy], reference=True)
        logprobs_R = self.forward_logprobs([dummy])[0]
        if backward:
            (logprobs_R.sum() * 0.0).backward()

    # --- forward ---------------------------------------------------------------------------------------------

    def forward_logprobs(self, samples: list[Sample], *, reference: bool = False, with_entropy: bool = False,
                         entropy_grad: bool = False, topk: int = 0, groups: list[PrefixGroup] | None = None,
                         trained_only: bool = False) -> tuple[Tensor, Tensor | None, Tensor | None]:
        """Logprobs (and optionally entropies, with their gradient if `entropy_grad`) of the response tokens of
        `samples` under the policy (or the frozen reference), flattened to R, and with `topk` the raw logprobs of
        the samples' teacher top-k ids (`trainer/forward.py`); `groups` as `micro_batches` planned them;
        `trained_only`: computed at the trained tokens alone (`loss_mask` 1), 0 at the others."""
        self.check_joined()
        model, root = (self.ref_model, self._ref_root) if reference else (self.model, self.root)
        if root is None:
            return response_logprobs(self.head, model, samples, with_entropy, entropy_grad, topk, groups, trained_only)
        # Sharded: gathers the root's parameters around the call.
        return root.run(response_logprobs, self.head, model, samples, with_entropy, entropy_grad, topk, groups,
                        trained_only)

    @torch.no_grad()
    def compute_logprobs(self, prompt_ids: list[int], response_ids: list[int], temperature: float) -> list[float]:
        """log pi(response token | prefix) under log_softmax(logits / temperature), for engine/trainer checks."""
        if not response_ids:
            return []
        if not prompt_ids:
            raise ValueError("compute_logprobs needs at least one prompt token")
        sample = Sample(list(prompt_ids), list(response_ids), [0.0] * len(response_ids), 0.0, temperature, "")
        self.model.eval()
        return self.forward_logprobs([sample])[0].cpu().tolist()

    # --- training --------------------------------------------------------------------------------------------

    def forward_backward(self, samples: list[Sample], objective: str | TokenObjective = "policy",
                         logprobs_out: list | None = None, trained_only: bool = False) -> dict[str, float]:
        """Backward one mini-batch's loss, micro-batch by micro-batch, into `.grad` (no optimizer step); returns
        sums over the mini-batch (loss, response tokens, the objective's stats, counts). `logprobs_out` (a slot per
        sample) receives the forwarded samples' logprobs, for the log viewer; `trained_only`: the LM head at the
        trained tokens alone (the loss reads no other; their logprobs are 0 in `logprobs_out`)."""
        return forward_backward(self, samples, objective, logprobs_out, trained_only=trained_only)

    @torch.no_grad()
    def forward(self, samples: list[Sample], objective: str | TokenObjective = "policy",
                logprobs_out: list | None = None, trained_only: bool = False) -> dict[str, float]:
        """The sums `forward_backward` returns, without a gradient and in eval mode (validation losses)."""
        self.model.eval()
        return forward_backward(self, samples, objective, logprobs_out, backward=False, trained_only=trained_only)

    @property
    def current_lr(self) -> float:
        s = self.settings
        return lr_at(self.optimizer_steps, s.lr, s.lr_warmup_steps, max(1, s.total_optimizer_steps),
                     s.lr_scheduler_type, s.min_lr_ratio)

    def optim_step(self, adam: AdamStep | None = None) -> dict[str, float]:
        """Grad-norm clip and AdamW step on the accumulated gradients, then zero them: {grad_norm, lr}
        (`trainer/step.py`). `adam`: this step's settings from the caller, in place of the configured learning
        rate schedule, weight decay and clip."""
        return optimizer_step(self, adam)

    def zero_grad(self) -> None:
        self.check_joined()
        self.master.zero_grad()

    def train_mode(self, adapter_dropout: bool) -> None:
        """Train mode only to let HF recompute activations (gradient checkpointing, on a model checked to have no
        dropout), so the ratio is exactly 1 before the first update; LoRA's adapter dropout on or off."""
        self.model.train(self.settings.gradient_checkpointing)
        if self.peft is not None:
            set_adapter_dropout(self.model, adapter_dropout)

    def train(self, samples: list[Sample], objective: str | TokenObjective = "policy") -> TrainResult:
        """One training step (`trainer/step.py`): metrics and the trainer's logprobs; `samples` stay untouched.
        objective "sft": one pass of the SFT loss over the samples' assistant tokens (`loss_mask`)."""
        return train_step(self, samples, token_objective(objective, self.settings))

    def train_step(self, samples: list[Sample], objective: str | TokenObjective = "policy") -> dict[str, float]:
        """`train`, with the trainer's logprobs recorded on the samples for the log viewer; returns the metrics."""
        result = self.train(samples, objective)
        result.attach_to(samples)
        return result.metrics

    # --- weights and state -----------------------------------------------------------------------------------

    def named_parameters_for_sync(self) -> Iterator[tuple[str, Tensor]]:
        """(name, detached tensor) as in `model.named_parameters()`.

        With tied embeddings the LM head is the input embedding and appears once (under the embedding's name);
        an engine holding the same architecture ties it the same way.
        """
        self.check_joined()  # here, not at the first next(): a sync must fail before it wakes the engine
        if self.peft is not None:
            return merged_named_tensors(self.model)  # W + (alpha/r) B A under the base model's names
        return self._named_parameters_gathered()

    def _named_parameters_gathered(self) -> Iterator[tuple[str, Tensor]]:
        for name, param in self.model.named_parameters():
            # Sharded: gathered one parameter at a time (every worker iterates with this one), in compute dtype.
            yield name, param.detach() if self.root is None else fsdp.full(param.detach()).to(self.compute_dtype)

    def state_dict(self, optimizer: bool = True) -> dict:
        """{"model": the full weights (under bf16 the fp32 masters; None: the model's own parameters as they are),
        "optimizer": the full AdamW state (None unless asked), "optimizer_steps"}. Sharded, it gathers: every
        worker of the group calls it at once."""
        return checkpoint.full_state(self, optimizer)

    def load_state_dict(self, state: dict) -> None:
        """Restore what `state_dict` returned ("model": whole weights by name, adapters only with LoRA). Tied
        weights may be missing (saved once); anything else missing or unexpected is a ValueError. "optimizer" None:
        the weights alone, with a fresh optimizer state."""
        checkpoint.restore_state(self, state)

    def save_checkpoint(self, path: Path, tokenizer=None, run_state: dict | None = None, write: bool = True) -> None:
        """Hugging Face folder (or LoRA adapter) at `path`, atomically; see `trainer_checkpoint.save`."""
        checkpoint.save(self, Path(path), tokenizer, run_state, write)

    def load_checkpoint(self, path: Path) -> dict:
        """Weights, optimizer, step count and RNG from `path`; returns the run state (`trainer_checkpoint.load`)."""
        return checkpoint.load(self, Path(path))
