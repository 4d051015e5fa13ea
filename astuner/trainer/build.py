"""The trainer built from the composed config: `trainer_settings` fills `TrainerSettings` (settings.py) from the
config's effective view (config/effective.py: keys that do nothing here read their neutral values) and the model's
own `ModelSpec`; `build_trainer` makes the `Trainer` over it."""

from __future__ import annotations

from astuner.config.effective import effective
from astuner.config.model_set import model_set as configured
from astuner.config.schema_models import strategy_of
from astuner.trainer.settings import TrainerSettings


def build_trainer(typed, kind, model_path: str, total_steps: int, micro_batch_tokens: int | None = None,
                  world: int = 1, spec=None, models_in_group: int = 1):
    """The trainer for the algorithm `kind` (RunFacts.algorithm); `micro_batch_tokens`: the memory fit's budget
    (preflight), else the configured one; `world`: the workers of the trainer group it will join (sharded, the
    model then reaches the device as shards only); `spec`: the model's `ModelSpec` (its LoRA rank, learning rate
    and sampling filter; None: the run's first model's); `models_in_group`: the models whose trainers each worker
    of the group holds (config/schema_models.strategy_of)."""
    from astuner.trainer.core import Trainer

    settings = trainer_settings(typed, kind, total_steps, micro_batch_tokens, world, spec, models_in_group)
    return Trainer(model_path, settings)


def trainer_settings(typed, kind, total_steps: int, micro_batch_tokens: int | None = None, world: int = 1,
                     spec=None, models_in_group: int = 1):
    """The TrainerSettings of `build_trainer`; `kind`: the run's algorithm record (RunFacts.algorithm)."""
    from astuner import preflight

    typed = effective(typed, kind)  # keys that do nothing here read their neutral values (config/effective.py)
    tc = typed.astuner.trainer_common
    # The model's settings read through `effective` too (a filter that does nothing here is off).
    spec = configured(typed).first if spec is None else configured(typed)[spec.name]
    return TrainerSettings(
        lr=spec.lr,
        weight_decay=tc.optim.weight_decay,
        lr_warmup_steps=tc.optim.lr_warmup_steps,
        lr_scheduler_type=tc.optim.lr_scheduler_type,
        min_lr_ratio=tc.optim.min_lr_ratio,
        total_optimizer_steps=total_steps * preflight.optimizer_steps_per_step(typed),
        ppo_epochs=tc.ppo_epochs,
        reference_model=kind.needs_reference,
        old_logprobs=tc.old_logprobs,
        gradient_checkpointing=tc.gradient_checkpointing,
        shared_prefix_min_tokens=tc.shared_prefix_min_tokens,
        precision=tc.precision,
        lora=spec.lora,
        # The sampling filter shapes the distribution rollouts were drawn from (offline data: no filter).
        top_k=spec.top_k,
        top_p=spec.top_p,
        # Read only where it acts (the start-up warning names it otherwise).
        rollout_is_cap=tc.rollout_is_cap if tc.old_logprobs == "trainer" else None,
        distill_topk=tc.algorithm.distill_topk,
        distill_topk_coef=tc.algorithm.distill_topk_coef,
        loss_mode=tc.policy_loss.loss_mode,
        entropy_coeff=tc.entropy_coeff,
        grad_clip=tc.optim.grad_clip,
        clip_ratio_low=tc.clip_ratio_low,
        clip_ratio_high=tc.clip_ratio_high,
        clip_ratio_c=tc.clip_ratio_c,
        use_kl_loss=tc.use_kl_loss,
        kl_loss_coef=tc.kl_loss_coef,
        kl_loss_type=tc.kl_loss_type,
        beta=tc.algorithm.beta,
        loss_agg_mode=tc.loss_agg_mode,
        norm_length=typed.astuner.rollout.max_response_length_in_one_turn,
        max_token_len_per_micro_batch=micro_batch_tokens or tc.micro_batch_token_budget,
        mini_batch_num=tc.mini_batch_num,
        seed=typed.astuner.seed,
        strategy=strategy_of(typed, models_in_group),
        group_size=world,
    )
