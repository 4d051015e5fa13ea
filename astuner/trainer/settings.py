"""The trainer's settings: one typed, validated record (`Trainer(model_path, settings)`).

Defaults are those of `config/schema.py`; `trainer/build.py` fills the record from the composed config.
The record is checked when built, against the registries of `algorithm/loss.py`, before any model loads.
"""

from __future__ import annotations

from dataclasses import dataclass

from astuner.config.model_set import LoraSettings  # resolved with each model (config/model_set.py)


STRATEGIES = ("auto", "ddp", "fsdp2")  # the trainer group's: whole replicas (ddp) or shards (fsdp2, trainer/fsdp.py)


@dataclass(frozen=True)
class AdamStep:
    """One optimizer step's AdamW settings, given by the caller (the Tinker API's AdamParams) instead of the
    configured schedule. grad_clip None: no clipping."""

    lr: float
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-12
    weight_decay: float = 0.0
    grad_clip: float | None = None


@dataclass(frozen=True)
class TrainerSettings:
    # --- optimizer and schedule (step_plan.lr_at) ---
    lr: float = 1e-6
    weight_decay: float = 0.01
    lr_warmup_steps: int = 0
    lr_scheduler_type: str = "constant"
    min_lr_ratio: float = 0.0
    total_optimizer_steps: int = 1  # the schedule's length; at least 1 is used
    grad_clip: float | None = 1.0  # None: no clipping
    # --- batching (step_plan.split_mini_batches / split_micro_batches) ---
    max_token_len_per_micro_batch: int = 13000
    mini_batch_num: int = 1
    ppo_epochs: int = 1
    loss_agg_mode: str = "episode-mean-token-mean"
    norm_length: int = 1024  # seq-mean-token-sum-norm's constant: the rollout's max response length per turn
    # --- policy objective (algorithm/objectives.py: PolicyGradient) ---
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.28
    clip_ratio_c: float = 3.0
    loss_mode: str = "vanilla"
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.001
    kl_loss_type: str = "k3"
    entropy_coeff: float = 0.0
    old_logprobs: str = "engine"  # engine: the rollouts' sampling logprobs; trainer: recomputed before the update
    rollout_is_cap: float | None = None
    # On-policy distillation's top-k term (algorithm/distillation.py): the teacher's k likeliest tokens, its weight.
    distill_topk: int = 0
    distill_topk_coef: float = 0.0
    # --- pair objectives (algorithm/preference.py: DPO, ORPO) ---
    beta: float = 0.1
    # --- model ---
    reference_model: bool = False  # keep a frozen copy of the initial policy (DPO; implied by use_kl_loss)
    gradient_checkpointing: bool = False
    # Samples sharing at least this many leading tokens forward them once (trainer/forward.py); 0: never.
    shared_prefix_min_tokens: int = 16
    top_k: int = 0  # the rollouts' sampling filter: sampled calls' logprobs are those of the filtered distribution
    top_p: float = 1.0
    precision: str = "auto"
    lora: LoraSettings | None = None
    device: str | None = None  # None: cuda when available, else cpu
    seed: int = 0  # initialises weights a checkpoint lacks
    # --- data parallel (Trainer.join_group) ---
    strategy: str = "auto"  # STRATEGIES, resolved with group_size (fsdp.resolve_strategy)
    # Workers of the group this trainer will join. Sharded (fsdp2 over more than one), the whole model stays on the
    # host until join_group shards it, so that only each worker's share ever reaches its device.
    group_size: int = 1

    def __post_init__(self) -> None:
        from astuner.algorithm.loss import KL_ESTIMATORS, LOSS_AGG_MODES, POLICY_LOSS_MODES

        if self.loss_agg_mode not in LOSS_AGG_MODES:
            raise ValueError(f"unknown loss_agg_mode {self.loss_agg_mode!r}; available: {', '.join(LOSS_AGG_MODES)}")
        if self.use_kl_loss and self.kl_loss_type not in KL_ESTIMATORS:
            raise ValueError(f"unknown kl_loss_type {self.kl_loss_type!r}; available: {', '.join(KL_ESTIMATORS)}")
        if self.max_token_len_per_micro_batch < 1 or self.mini_batch_num < 1 or self.ppo_epochs < 1:
            raise ValueError("max_token_len_per_micro_batch, mini_batch_num and ppo_epochs must be >= 1")
        if self.old_logprobs not in ("engine", "trainer"):
            raise ValueError(f"old_logprobs must be engine or trainer, got {self.old_logprobs!r}")
        if self.rollout_is_cap is not None and self.old_logprobs != "trainer":
            raise ValueError("rollout_is_cap needs old_logprobs='trainer' (the weight is trainer/engine)")
        if self.strategy not in STRATEGIES:
            raise ValueError(f"unknown strategy {self.strategy!r}; available: {', '.join(STRATEGIES)}")
        if self.group_size < 1:
            raise ValueError(f"group_size must be >= 1 (the workers of the trainer group), got {self.group_size}")
        if self.loss_mode not in POLICY_LOSS_MODES:
            raise ValueError(
                f"unknown policy loss_mode {self.loss_mode!r}; available: {', '.join(POLICY_LOSS_MODES)}")

    @property
    def needs_reference(self) -> bool:
        """A frozen initial policy is kept: for the KL loss, or asked for (DPO)."""
        return self.use_kl_loss or self.reference_model
