"""The policy trainer: PyTorch + transformers only (no Ray, no vLLM, no rollouts).

One `train_step(samples)`, repeated `ppo_epochs` times over the same samples and old logprobs:
  1. split the samples into `mini_batch_num` mini-batches by episode (contiguous runs of episodes in order of
     first appearance; all samples of an episode stay together) -> one optimizer step each;
  2. token weights over the mini-batch (`algorithm.loss.token_weights`), so the mini-batch loss is a plain
     weighted token sum and gradient accumulation over micro-batches is exact;
  3. micro-batches by token budget: samples sorted by length (longest first), greedily packed while
     `max_len_in_micro_batch * n_samples <= max_token_len_per_micro_batch` (a sample over budget goes alone);
  4. per micro-batch: forward the decoder to hidden states, keep only the positions that predict response tokens
     (response token i of a sample is predicted at index len(prompt) + i - 1), apply the LM head to those alone,
     logprobs = log_softmax(logits / temperature)[token] (temperature 0 -> 1.0, as the engine logs greedy
     calls; sampled calls over the rollouts' top-k / top-p filtered distribution, `algorithm/sampling_filter.py`;
     on CUDA in row chunks, `fused_head.py`), loss = `algorithm.loss.policy_loss`, backward;
  5. grad-norm clip, AdamW step, learning rate from `lr_at` (linear warmup, then constant, cosine or linear).
The splitting (steps 1 and 3) and the schedule are pure functions in `astuner/step_plan.py`.

Metrics cover these tokens: `clip_fraction`, `clip_fraction_lower` every loss-weighted response token (a token with
advantage 0 is never clipped, so the skipped ones count as unclipped, exactly); `entropy`, `ratio_mean`,
`approx_kl_old`, `kl_ref` the tokens forwarded (advantage != 0, or all with the KL or entropy term on);
`forwarded_token_fraction` says what share of the weighted tokens that is.

Not computed, on purpose: logits at prompt positions, an old-logprob pass (old logprobs are the engine's sampling
logprobs), a reference forward unless the KL loss is on. Without the KL loss and the entropy term, samples whose
advantage is exactly 0 are not forwarded at all: their loss and gradient are exactly 0, yet they still count in
the token weights, so the result is unchanged.

Precision (`astuner/precision.py`): fp32 on CPU; on CUDA bf16 weights and compute with fp32 master weights and
fp32 AdamW state. A worker of a trainer group (`join_group`) trains data-parallel, with a whole replica (ddp,
`data_parallel.py`) or sharded (fsdp2, `fsdp.py`).
The model stays in eval mode (no dropout), so that before any update the trainer's logprobs match the engine's.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import time
from pathlib import Path
from typing import Iterator

import torch
from torch import Tensor

from astuner.fused_head import head_logprobs, plain_linear_head
from astuner import fsdp, trainer_checkpoint
from astuner.lora import LoraSettings, apply_lora, merged_named_tensors, set_adapter_dropout
from astuner.precision import MasterWeights, resolve_precision
from astuner.algorithm.loss import (KL_ESTIMATORS, LOSS_AGG_MODES, POLICY_LOSS_MODES, policy_loss, sft_loss,
                                    token_weights)
from astuner.algorithm.sampling_filter import filter_logits, is_filtered
from astuner.algorithm.mismatch import mismatch_sums, truncated_is_weights
from astuner.step_plan import lr_at, offsets, split_micro_batches, split_mini_batches
from astuner.types import Sample

log = logging.getLogger(__name__)


def _greedy_as_one(temperature: float) -> float:
    # Temperature 0 means greedy decoding; its logprobs are those of the untempered distribution.
    return temperature if temperature > 0 else 1.0


def _active_dropout(model) -> list[str]:
    """Dropout that train mode would switch on: config probabilities and nn.Dropout modules above 0."""
    found = [f"{k}={v}" for k, v in model.config.to_dict().items()
             if "dropout" in k and isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0]
    found += [f"{name} (p={m.p})" for name, m in model.named_modules()
              if isinstance(m, torch.nn.Dropout) and m.p > 0][:3]
    return found


class Trainer:
    def __init__(
        self,
        model_path: str,
        *,
        lr: float,
        weight_decay: float,
        lr_warmup_steps: int,
        grad_clip: float | None,
        clip_ratio_low: float,
        clip_ratio_high: float,
        use_kl_loss: bool,
        kl_loss_coef: float,
        kl_loss_type: str,
        loss_agg_mode: str,
        norm_length: int,
        max_token_len_per_micro_batch: int,
        mini_batch_num: int = 1,
        clip_ratio_c: float = 3.0,
        lr_scheduler_type: str = "constant",
        min_lr_ratio: float = 0.0,
        total_optimizer_steps: int = 1,
        ppo_epochs: int = 1,
        loss_mode: str = "vanilla",
        entropy_coeff: float = 0.0,
        reference_model: bool = False,
        old_logprobs: str = "engine",
        rollout_is_cap: float | None = None,
        gradient_checkpointing: bool = False,
        top_k: int = 0,
        top_p: float = 1.0,
        precision: str = "auto",
        lora: LoraSettings | None = None,
        device: str | None = None,
        seed: int = 0,
    ):
        from transformers import AutoModelForCausalLM

        if loss_agg_mode not in LOSS_AGG_MODES:
            raise ValueError(f"unknown loss_agg_mode {loss_agg_mode!r}; available: {', '.join(LOSS_AGG_MODES)}")
        if use_kl_loss and kl_loss_type not in KL_ESTIMATORS:
            raise ValueError(f"unknown kl_loss_type {kl_loss_type!r}; available: {', '.join(KL_ESTIMATORS)}")
        if max_token_len_per_micro_batch < 1 or mini_batch_num < 1 or ppo_epochs < 1:
            raise ValueError("max_token_len_per_micro_batch, mini_batch_num and ppo_epochs must be >= 1")
        if old_logprobs not in ("engine", "trainer"):
            raise ValueError(f"old_logprobs must be engine or trainer, got {old_logprobs!r}")
        if rollout_is_cap is not None and old_logprobs != "trainer":
            raise ValueError("rollout_is_cap needs old_logprobs='trainer' (the weight is trainer/engine)")
        if loss_mode not in POLICY_LOSS_MODES:
            raise ValueError(f"unknown policy loss_mode {loss_mode!r}; available: {', '.join(POLICY_LOSS_MODES)}")

        self.model_path = str(model_path)
        # The rollouts' top-k / top-p: sampled calls' logprobs are those of the filtered distribution.
        self.top_k, self.top_p = int(top_k), float(top_p)
        self.lr = lr
        self.lr_warmup_steps = lr_warmup_steps
        self.grad_clip = grad_clip
        self.clip_ratio_low = clip_ratio_low
        self.clip_ratio_high = clip_ratio_high
        self.clip_ratio_c = clip_ratio_c
        self.lr_scheduler_type = lr_scheduler_type
        self.min_lr_ratio = min_lr_ratio
        self.total_optimizer_steps = max(1, total_optimizer_steps)
        self.use_kl_loss = use_kl_loss
        self.kl_loss_coef = kl_loss_coef
        self.kl_loss_type = kl_loss_type
        self.loss_agg_mode = loss_agg_mode
        self.norm_length = norm_length
        self.max_token_len_per_micro_batch = max_token_len_per_micro_batch
        self.mini_batch_num = mini_batch_num
        self.ppo_epochs = ppo_epochs
        self.loss_mode = loss_mode
        self.entropy_coeff = entropy_coeff
        self.old_logprobs = old_logprobs
        self.rollout_is_cap = rollout_is_cap
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.optimizer_steps = 0
        self.dp = None  # a data_parallel.DataParallel when this is one worker of a trainer group

        # The seed only matters if the checkpoint lacks some weights (they are then initialised at random);
        # fork_rng keeps the caller's global RNG untouched.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = AutoModelForCausalLM.from_pretrained(self.model_path, dtype=torch.float32)
        self.model = model.to(self.device).eval()
        self.precision = resolve_precision(precision, self.device.type)
        self.gradient_checkpointing = gradient_checkpointing
        if gradient_checkpointing:
            # Hugging Face recomputes activations only in train mode; that mode must then compute what eval mode
            # does (no dropout), or the PPO ratio would not start at 1.
            active = _active_dropout(self.model)
            if active:
                raise ValueError(f"gradient_checkpointing needs a model without dropout; {self.model_path} has "
                                 f"{', '.join(active)}: set them to 0 in its config.json")
            self.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self._peft = None  # the PEFT wrapper when LoRA is on (astuner/lora.py); self.model is its inner HF model
        if lora is not None and lora.enabled:
            self._peft = apply_lora(self.model, lora)
            self.model = self._peft.get_base_model()
        self._master = MasterWeights(self.model, self.precision)  # trainable params only; casts to bf16 under bf16
        self.ref_model = None  # frozen initial policy: for the KL loss and for DPO
        if use_kl_loss or reference_model:
            self.ref_model = copy.deepcopy(self.model).eval().requires_grad_(False)

        self._params = self._master.masters  # what AdamW steps: fp32 always
        self._adamw = dict(lr=lr, weight_decay=weight_decay, fused=self.device.type == "cuda")
        self.optimizer = torch.optim.AdamW(self._params, **self._adamw)
        self._root = self._ref_root = None  # fsdp.Root units when the group shards the model (join_group)
        self._pad_id = 0  # right padding after every real token: causal attention never lets a real token see it
        self._fast_head = self._check_fast_head()
        # On CUDA the LM head's log-softmax runs in row chunks (memory-bound there); on CPU, where the extra head
        # matmul of the chunked backward costs more than the memory traffic it saves, the plain path.
        self.chunked_head = self.device.type == "cuda"

    # --- trainer group ---------------------------------------------------------------------------------------

    def join_group(self, dp, strategy: str = "ddp") -> str:
        """Become one worker of a data-parallel group (`data_parallel.DataParallel`, its process group up); with
        strategy fsdp2 shard the model, the reference model and the optimizer over it (`fsdp.py`). Call before
        any step or checkpoint load. Returns the strategy in force."""
        self.dp = dp
        if fsdp.resolve_strategy(strategy, dp.world, self.device.type, self._peft is not None) != "fsdp2" \
                or dp.world == 1:
            return "ddp"
        self._master.unify(self.model)  # the fp32 shards are the master weights from here on
        self._root = fsdp.shard(self.model, dp.world, self.device.type, self.compute_dtype)
        if self.ref_model is not None:
            self._ref_root = fsdp.shard(self.ref_model, dp.world, self.device.type, self.compute_dtype)
        self._master = MasterWeights(self.model, "fp32")
        self._params = self._master.masters
        self.optimizer = torch.optim.AdamW(self._params, **self._adamw)
        return "fsdp2"

    @property
    def sharded(self) -> bool:
        return self._root is not None

    @property
    def compute_dtype(self) -> torch.dtype:
        return torch.bfloat16 if self.precision == "bf16" else torch.float32

    def _lockstep(self, micro_batches: list) -> list:
        """Sharded, every forward is collective: pad with None (a `_pad_pass`) to the busiest worker's count."""
        if self._root is None:
            return micro_batches
        return micro_batches + [None] * (self.dp.max_int(len(micro_batches)) - len(micro_batches))

    def _pad_pass(self, backward: bool, ref: bool) -> None:
        """A one-token forward (and a backward of 0 x its logprob) that joins the other workers' collectives."""
        dummy = Sample([self._pad_id], [self._pad_id], [0.0], 0.0, 1.0, "")
        if ref:
            with torch.no_grad():
                self._forward_logprobs(self.ref_model, [dummy], with_entropy=False)
        logprobs_R, _ = self._forward_logprobs(self.model, [dummy], with_entropy=False)
        if backward:
            (logprobs_R.sum() * 0.0).backward()

    # --- forward ---------------------------------------------------------------------------------------------

    def _head_logits(self, model, hidden_N_H: Tensor) -> Tensor:
        """LM head on selected hidden states, plus the output transforms some families apply after it."""
        logits = model.get_output_embeddings()(hidden_N_H).float()
        config = model.config
        if getattr(config, "logits_scaling", None):  # Granite
            logits = logits / config.logits_scaling
        if getattr(model, "logit_scale", None) is not None:  # Cohere
            logits = logits * model.logit_scale
        if getattr(config, "final_logit_softcapping", None):  # Gemma 2/3
            cap = config.final_logit_softcapping
            logits = torch.tanh(logits / cap) * cap
        return logits

    def _check_fast_head(self) -> bool:
        """True when decoder + LM head on selected positions reproduces the model's own logits.

        Guards the fast path against architectures that post-process logits in ways `_head_logits` does not know;
        those fall back to a full-logits forward (correct, slower). Checked once, in fp32, on 8 tokens.
        """
        vocab = self.model.get_output_embeddings().weight.shape[0]
        ids = (torch.arange(8, device=self.device) * 997 % vocab).unsqueeze(0)
        with torch.no_grad():
            try:
                full = self.model(input_ids=ids, use_cache=False).logits[0].float()
                hidden = self.model.base_model(input_ids=ids, use_cache=False)[0][0]
                fast = self._head_logits(self.model, hidden)
                ok = fast.shape == full.shape and torch.allclose(fast, full, rtol=1e-3, atol=1e-3)
            except Exception as exc:  # any mismatch of interfaces: take the safe path
                log.warning("fast LM-head path unavailable (%s)", exc)
                ok = False
        if not ok:
            log.warning("trainer: full-logits forward for %s (slower, same result)", type(self.model).__name__)
        return ok

    def _forward_logprobs(self, model, samples: list[Sample], with_entropy: bool,
                          entropy_grad: bool = False) -> tuple[Tensor, Tensor | None]:
        """Logprobs (and optionally entropies, with their gradient if `entropy_grad`) of the response tokens of
        `samples`, flattened to R."""
        root = self._root if model is self.model else self._ref_root
        if root is None:
            return self._logprobs(model, samples, with_entropy, entropy_grad)
        return root.run(self._logprobs, model, samples, with_entropy, entropy_grad)  # sharded: gathers the root

    def _logprobs(self, model, samples: list[Sample], with_entropy: bool,
                  entropy_grad: bool) -> tuple[Tensor, Tensor | None]:
        # The last token of each sequence predicts nothing we train on, so it is not fed.
        inputs = [s.prompt_ids + s.response_ids[:-1] for s in samples]
        T = max(len(x) for x in inputs)
        input_ids_B_T = torch.full((len(samples), T), self._pad_id, dtype=torch.long)
        batch_idx, pos_idx, targets, temps, sampled = [], [], [], [], []
        for b, (s, x) in enumerate(zip(samples, inputs)):
            input_ids_B_T[b, : len(x)] = torch.tensor(x, dtype=torch.long)
            P, L = len(s.prompt_ids), len(s.response_ids)
            batch_idx += [b] * L
            pos_idx += range(P - 1, P + L - 1)
            targets += s.response_ids
            temps += [_greedy_as_one(s.temperature)] * L
            sampled += [s.temperature > 0] * L
        dev = self.device
        input_ids_B_T = input_ids_B_T.to(dev)
        batch_idx_R = torch.tensor(batch_idx, device=dev)
        pos_idx_R = torch.tensor(pos_idx, device=dev)
        targets_R = torch.tensor(targets, device=dev)
        temps_R = torch.tensor(temps, device=dev, dtype=torch.float32)

        # No attention mask: with right padding, causal attention already hides the pads from real tokens,
        # and leaving it out keeps SDPA on its fused causal path.
        # Precision is the parameters' dtype (astuner/precision.py): no autocast.
        filtered = is_filtered(self.top_k, self.top_p) and any(sampled)
        if self._fast_head:
            hidden_B_T_H = model.base_model(input_ids=input_ids_B_T, use_cache=False)[0]
            weight = plain_linear_head(model) if self.chunked_head else None
            if weight is not None and not entropy_grad and not filtered:
                # Never holds R x V logits (astuner/fused_head.py); the same numbers as below.
                return head_logprobs(hidden_B_T_H[batch_idx_R, pos_idx_R], weight, targets_R, temps_R, with_entropy)
            logits_R_V = self._head_logits(model, hidden_B_T_H[batch_idx_R, pos_idx_R])
        else:
            logits_R_V = model(input_ids=input_ids_B_T, use_cache=False).logits[batch_idx_R, pos_idx_R].float()
        if any(t != 1.0 for t in temps):  # a full pass over R x V floats (and its backward) saved when all are 1
            logits_R_V = logits_R_V / temps_R[:, None]
        if filtered:
            # Greedy calls were not filtered by the engine (and are never trained); sampled ones were.
            sampled_R = torch.tensor(sampled, device=dev)
            logits_R_V = torch.where(sampled_R[:, None], filter_logits(logits_R_V, self.top_k, self.top_p),
                                     logits_R_V)
        logz_R = torch.logsumexp(logits_R_V, dim=-1)
        logprobs_R = logits_R_V.gather(-1, targets_R[:, None]).squeeze(-1) - logz_R
        entropy_R = None
        if with_entropy:
            with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
                probs_R_V = torch.softmax(logits_R_V, dim=-1)
                # Filtered tokens have p = 0 and z = -inf: their term is 0, not nan.
                plogits_R_V = torch.where(probs_R_V > 0, probs_R_V * logits_R_V, torch.zeros_like(probs_R_V))
                entropy_R = logz_R - plogits_R_V.sum(-1)
        return logprobs_R, entropy_R

    @torch.no_grad()
    def compute_logprobs(self, prompt_ids: list[int], response_ids: list[int], temperature: float) -> list[float]:
        """log pi(response token | prefix) under log_softmax(logits / temperature), for engine/trainer checks."""
        if not response_ids:
            return []
        if not prompt_ids:
            raise ValueError("compute_logprobs needs at least one prompt token")
        sample = Sample(list(prompt_ids), list(response_ids), [0.0] * len(response_ids), 0.0, temperature, "")
        self.model.eval()
        logprobs_R, _ = self._forward_logprobs(self.model, [sample], with_entropy=False)
        return logprobs_R.cpu().tolist()

    # --- training --------------------------------------------------------------------------------------------

    def accumulate_gradients(self, samples: list[Sample], record_logprobs: bool = False,
                             objective: str = "policy") -> dict[str, float]:
        """Backward the loss of one mini-batch, micro-batch by micro-batch, into `.grad` (no optimizer step).
        objective "policy": `policy_loss`; "sft": `sft_loss` (advantages and old logprobs unused).

        Returns sums over the mini-batch: loss, response tokens, token-summed stats, tokens processed, counts.
        """
        for s in samples:
            if len(s.old_logprobs) != len(s.response_ids):
                raise ValueError(f"sample of episode {s.episode_uid}: old_logprobs and response_ids lengths differ")
            if s.response_ids and not s.prompt_ids:
                raise ValueError(f"sample of episode {s.episode_uid}: empty prompt")
        # Lengths count trained tokens only: a merged sample (loss_mask) weighs its tokens as the separate
        # calls it joins would.
        weights_B = token_weights(
            [s.num_trained_tokens for s in samples], [s.episode_uid for s in samples], self.loss_agg_mode,
            self.norm_length,
        )
        # Zero-weight samples contribute nothing; zero-advantage ones nothing either unless the KL or the entropy
        # term is on.
        every_token_counts = self.use_kl_loss or self.entropy_coeff > 0 or objective == "sft"
        keep = [
            i for i, s in enumerate(samples)
            if weights_B[i] > 0 and (every_token_counts or s.advantage != 0.0)
        ]
        if self.dp is not None:  # a worker of a group backwards the episodes it owns (data_parallel.py)
            keep = [i for i in keep if self.dp.mine(samples[i])]
        kept = [samples[i] for i in keep]
        dev = self.device
        sums = {k: torch.zeros((), device=dev) for k in ("loss", "clip_fraction", "clip_fraction_lower",
                                                         "approx_kl_old", "ratio_mean", "kl_ref", "entropy",
                                                         "logprob_abs_diff", "logprob_abs_diff_max", "nll",
                                                         "kl_engine_trainer_k3", "is_weight_mean")}
        n_tokens_R = 0
        micro_batches = split_micro_batches([s.num_tokens for s in kept], self.max_token_len_per_micro_batch)
        for idx in self._lockstep(micro_batches):
            if idx is None:
                self._pad_pass(backward=True, ref=self.use_kl_loss and objective == "policy")
                continue
            mb = [kept[i] for i in idx]
            mb_weights = [weights_B[keep[i]] for i in idx]
            lengths = [len(s.response_ids) for s in mb]
            old_R = torch.tensor([x for s in mb for x in s.old_logprobs], device=dev, dtype=torch.float32)
            adv_R = torch.tensor([s.advantage for s, n in zip(mb, lengths) for _ in range(n)], device=dev)
            mask_R = torch.tensor([m for s in mb for m in (s.loss_mask or [1] * len(s.response_ids))],
                                  device=dev, dtype=torch.float32)
            w_R = torch.tensor([w for w, n in zip(mb_weights, lengths) for _ in range(n)], device=dev) * mask_R

            ref_R = None
            if self.use_kl_loss and objective == "policy":
                with torch.no_grad():
                    ref_R, _ = self._forward_logprobs(self.ref_model, mb, with_entropy=False)
            is_w_R = None
            if self.rollout_is_cap is not None and objective == "policy":
                engine_R = torch.tensor([x for s in mb for x in s.engine_logprobs], device=dev, dtype=torch.float32)
                is_w_R = truncated_is_weights(old_R, engine_R, self.rollout_is_cap)
            logprobs_R, entropy_R = self._forward_logprobs(self.model, mb, with_entropy=True,
                                                           entropy_grad=self.entropy_coeff > 0
                                                           and objective == "policy")
            seq_index_R = torch.tensor([b for b, n in enumerate(lengths) for _ in range(n)], device=dev)
            if record_logprobs:  # before any update: the trainer's view of what the engine sampled (log viewer)
                flat = logprobs_R.detach().cpu().tolist()
                for s, start, n in zip(mb, offsets(lengths), lengths):
                    s.trainer_logprobs = flat[start : start + n]
            if objective == "sft":
                loss, stats = sft_loss(logprobs_R, w_R, mask_R)
            else:
                loss, stats = policy_loss(
                    logprobs_R, old_R, adv_R, w_R, self.clip_ratio_low, self.clip_ratio_high, self.clip_ratio_c,
                    ref_logprobs_R=ref_R, kl_coef=self.kl_loss_coef, kl_kind=self.kl_loss_type, mask_R=mask_R,
                    loss_mode=self.loss_mode, seq_index_R=seq_index_R, entropy_R=entropy_R,
                    entropy_coeff=self.entropy_coeff, is_weights_R=is_w_R,
                )
            loss.backward()

            n_tokens_R += int(mask_R.sum().item())
            sums["loss"] += loss.detach()
            if entropy_R is not None:
                sums["entropy"] += (entropy_R.detach() * mask_R).sum()
            for k, v in stats.items():
                if k == "logprob_abs_diff_max":
                    sums[k] = torch.maximum(sums[k], v)
                else:
                    sums[k] += v  # token sums, so micro-batches combine exactly
        out = {k: v.item() for k, v in sums.items()}  # one device sync per mini-batch
        out.update(
            response_tokens=n_tokens_R,
            train_tokens=sum(s.num_tokens for s in kept),
            num_micro_batches=len(micro_batches),
            num_forwarded_samples=len(kept),
        )
        if self.dp is not None:
            out = self.dp.reduce_sums(out, max_keys=("logprob_abs_diff_max",))
        out["weighted_tokens"] = sum(s.num_trained_tokens for s, w in zip(samples, weights_B) if w > 0)
        return out

    def _current_lr(self) -> float:
        return lr_at(self.optimizer_steps, self.lr, self.lr_warmup_steps, self.total_optimizer_steps,
                     self.lr_scheduler_type, self.min_lr_ratio)

    def _optimizer_step(self) -> tuple[float, float]:
        lr = self._current_lr()
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        max_norm = self.grad_clip if self.grad_clip is not None else float("inf")
        if self.dp is not None and self._root is None:  # sharded: reduce-scattered in the backward already
            self.dp.all_reduce_grads(self._master.model_params)
        self._master.grads_to_masters()
        grad_norm = fsdp.full(torch.nn.utils.clip_grad_norm_(self._params, max_norm)).item()
        if torch.isfinite(torch.tensor(grad_norm)):
            self.optimizer.step()
            self._master.masters_to_model()
            self.optimizer_steps += 1
        else:
            # A non-finite gradient would poison the Adam moments for good: drop this update.
            log.warning("non-finite grad norm (%s): optimizer step skipped", grad_norm)
        self._master.zero_grad()
        return grad_norm, lr

    def train_step(self, samples: list[Sample], objective: str = "policy") -> dict[str, float]:
        """One training step: `ppo_epochs` passes over `samples`, each `mini_batch_num` optimizer steps (see the
        module docstring). Every pass uses the same old logprobs (the engine's, or with old_logprobs "trainer"
        the trainer's recomputed before the first update), so from the second optimizer step on the ratio moves
        away from 1 and the clip acts. objective "sft": one pass of the SFT loss (the
        samples' assistant tokens, `loss_mask`), aggregated by `loss_agg_mode` like the policy loss."""
        if objective not in ("policy", "sft"):
            raise ValueError(f"unknown objective {objective!r}; available: policy, sft")
        start = time.perf_counter()
        if self.dp is not None:
            self.dp.assign(samples, self.mini_batch_num)
        # No dropout: the ratio is exactly 1 before the first update (train mode only to let HF recompute
        # activations, on a model checked to have no dropout).
        self.model.train(self.gradient_checkpointing)
        if self._peft is not None:
            set_adapter_dropout(self.model, False)  # no dropout while old logprobs are recomputed
        metrics: dict[str, float] = {"num_samples": float(len(samples)), "lr": self._current_lr()}
        recompute = objective == "policy" and self.old_logprobs == "trainer"
        if recompute:
            samples, mismatch = self.recompute_old_logprobs(samples)
            metrics.update(mismatch)
        if self._peft is not None:
            set_adapter_dropout(self.model, True)  # trainer_common.lora.dropout acts in the update passes only
        reported = (("clip_fraction", "clip_fraction_lower", "approx_kl_old", "ratio_mean", "kl_ref", "entropy")
                    if objective == "policy" else ("nll", "entropy"))
        if self.rollout_is_cap is not None and objective == "policy":
            reported += ("is_weight_mean",)
        totals = {k: 0.0 for k in reported}
        losses, grad_norms = [], []
        n_tokens_R = n_weighted = train_tokens = n_micro = n_skipped = 0
        epochs = self.ppo_epochs if objective == "policy" else 1
        passes = [mb for _ in range(epochs) for mb in split_mini_batches(samples, self.mini_batch_num)]
        for mini_batch in passes:
            first = not losses and objective == "policy" and not recompute
            sums = self.accumulate_gradients(mini_batch, record_logprobs=first, objective=objective)
            n_micro += sums["num_micro_batches"]
            n_skipped += len(mini_batch) - sums["num_forwarded_samples"]
            if sums["response_tokens"] == 0:
                self._master.zero_grad()
                continue  # nothing carries a gradient: no step (weight decay alone is not a reason to move)
            if first:
                # Only the first mini-batch is forwarded before any update: there trainer and engine logprobs
                # of the sampled tokens should agree (fp32 on CPU: ~1e-6); a gap means a broken sync or pipeline.
                # (old_logprobs: trainer measures every sample, in recompute_old_logprobs.)
                metrics["logprob_abs_diff_mean"] = sums["logprob_abs_diff"] / sums["response_tokens"]
                metrics["logprob_abs_diff_max"] = sums["logprob_abs_diff_max"]
                metrics["kl_engine_trainer_k3"] = sums["kl_engine_trainer_k3"] / sums["response_tokens"]
            grad_norm, lr = self._optimizer_step()
            losses.append(sums["loss"])
            grad_norms.append(grad_norm)
            metrics["lr"] = lr
            n_tokens_R += sums["response_tokens"]
            n_weighted += sums["weighted_tokens"]
            train_tokens += sums["train_tokens"]
            for k in totals:
                totals[k] += sums[k]
        seconds = time.perf_counter() - start

        if losses:
            metrics["policy_loss" if objective == "policy" else "sft_loss"] = sum(losses) / len(losses)
            metrics["grad_norm"] = sum(grad_norms) / len(grad_norms)
            for k, v in totals.items():
                if k != "kl_ref" or self.use_kl_loss:
                    # Clip counts cover every weighted token (see the module docstring); the rest, those forwarded.
                    metrics[k] = v / (n_weighted if k.startswith("clip_fraction") else n_tokens_R)
            metrics["forwarded_token_fraction"] = n_tokens_R / max(n_weighted, 1)
        metrics.update(
            train_tokens=float(train_tokens),
            train_tokens_per_s=train_tokens / seconds if seconds > 0 else 0.0,
            num_micro_batches=float(n_micro),
            num_optimizer_steps=float(len(losses)),
            num_samples_skipped_zero_adv=float(n_skipped / epochs),
        )
        return metrics

    @torch.no_grad()
    def recompute_old_logprobs(self, samples: list[Sample]) -> tuple[list[Sample], dict[str, float]]:
        """old_logprobs: trainer. Copies of `samples` whose old logprobs are the trainer's (before any update)
        and whose engine_logprobs keep the engine's, and the mismatch metrics over every trained token
        (algorithm/mismatch.py). The originals get `trainer_logprobs` (log viewer)."""
        out = list(samples)
        sums = {"logprob_abs_diff": 0.0, "logprob_abs_diff_max": 0.0, "kl_engine_trainer_k3": 0.0}
        tokens = 0.0
        todo = [i for i, s in enumerate(samples) if s.response_ids and (self.dp is None or self.dp.mine(s))]
        for idx in self._lockstep(split_micro_batches([samples[i].num_tokens for i in todo],
                                                      self.max_token_len_per_micro_batch)):
            if idx is None:
                self._pad_pass(backward=False, ref=False)
                continue
            mb = [samples[todo[i]] for i in idx]
            lengths = [len(s.response_ids) for s in mb]
            logprobs_R, _ = self._forward_logprobs(self.model, mb, with_entropy=False)
            engine_R = torch.tensor([x for s in mb for x in s.old_logprobs], device=self.device)
            mask_R = torch.tensor([m for s in mb for m in (s.loss_mask or [1] * len(s.response_ids))],
                                  device=self.device, dtype=torch.float32)
            for k, v in mismatch_sums(logprobs_R, engine_R, mask_R).items():
                sums[k] = max(sums[k], v.item()) if k.endswith("_max") else sums[k] + v.item()
            tokens += mask_R.sum().item()
            flat = logprobs_R.cpu().tolist()
            for i, start, n in zip(idx, offsets(lengths), lengths):
                original = samples[todo[i]]
                original.trainer_logprobs = flat[start : start + n]
                out[todo[i]] = dataclasses.replace(original, old_logprobs=original.trainer_logprobs,
                                                   engine_logprobs=list(original.old_logprobs))
        if self.dp is not None:
            sums = self.dp.reduce_sums({**sums, "tokens": tokens}, max_keys=("logprob_abs_diff_max",))
            tokens = sums["tokens"]
        tokens = max(tokens, 1.0)
        return out, {"logprob_abs_diff_mean": sums["logprob_abs_diff"] / tokens,
                     "logprob_abs_diff_max": sums["logprob_abs_diff_max"],
                     "kl_engine_trainer_k3": sums["kl_engine_trainer_k3"] / tokens}

    # --- weights out -----------------------------------------------------------------------------------------

    def named_parameters_for_sync(self) -> Iterator[tuple[str, Tensor]]:
        """(name, detached tensor) as in `model.named_parameters()`.

        With tied embeddings the LM head is the input embedding and appears once (under the embedding's name);
        an engine holding the same architecture ties it the same way.
        """
        if self._peft is not None:
            yield from merged_named_tensors(self.model)  # W + (alpha/r) B A under the base model's names
            return
        for name, param in self.model.named_parameters():
            # Sharded: gathered one parameter at a time (every worker iterates with this one), in compute dtype.
            yield name, param.detach() if self._root is None else fsdp.full(param.detach()).to(self.compute_dtype)

    def save_checkpoint(self, path: Path, tokenizer=None, run_state: dict | None = None, write: bool = True) -> None:
        """Hugging Face folder (or LoRA adapter) at `path`, atomically; see `trainer_checkpoint.save`."""
        trainer_checkpoint.save(self, Path(path), tokenizer, run_state, write)

    def load_checkpoint(self, path: Path) -> dict:
        """Weights, optimizer, step count and RNG from `path`; returns the run state (`trainer_checkpoint.load`)."""
        return trainer_checkpoint.load(self, Path(path))
