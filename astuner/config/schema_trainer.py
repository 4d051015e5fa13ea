"""The config sections of the trainer (`schema.py` re-exports them): the optimizer, the algorithm, the policy
loss, LoRA and `trainer_common`.
"""

from __future__ import annotations

from typing import Literal, Optional, Union

from astuner.config.schema_keys import Section, key, old_name, section

LOSS_AGG_MODES = ("episode-mean-token-mean", "token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")


class OptimSection(Section):
    lr: float = key(1.0e-6, "AdamW learning rate (peak, after warmup).", ge=0)
    weight_decay: float = key(0.01, "AdamW weight decay.", ge=0)
    lr_warmup_steps: int = key(0, "Linear warmup from 0 to lr over this many optimizer steps.", ge=0)
    lr_scheduler_type: Literal["constant", "cosine", "linear"] = key(
        "constant",
        "After warmup: constant | cosine | linear (both decay to min_lr_ratio * lr at the last optimizer step of "
        "the run).",
    )
    min_lr_ratio: float = key(0.0, "Final learning rate of the cosine or linear schedule, as a fraction of lr.",
                              ge=0, le=1)
    grad_clip: Optional[float] = key(1.0, "Clip the global gradient norm to this value; null: no clipping.", gt=0)


class FilterGroups(Section):
    enable: bool = key(
        False,
        "DAPO dynamic sampling: drop task groups whose episodes all got the same reward (no GRPO signal) and roll "
        "out further tasks until train_batch_size groups remain (extra groups are cut).",
    )
    metric: Literal["score", "acc"] = key("score", "What must differ within a group: score (reward) | acc (is_success).")
    max_num_gen_batches: int = key(
        5, "Most rollout batches one step may take to fill up; then it trains on the groups it has (0: no cap).", ge=0
    )


class AlgorithmSection(Section):
    type: Literal["grpo", "rft", "on_policy_distillation", "sft", "dpo", "orpo"] = key(
        "grpo",
        "grpo: RL on rollouts (adv_estimator picks the GRPO-family variant) | rft: rejection-sampling fine-tuning "
        "on rollouts (keep episodes with reward >= rft_reward_threshold, SFT on their calls) | "
        "on_policy_distillation: the student samples, astuner.teacher scores every sampled token (per-token reverse "
        "KL as the advantage) | sft | dpo | orpo: on astuner.offline_data (chat jsonl; no rollouts).",
    )
    beta: float = key(0.1, "dpo: the KL temperature beta | orpo: the weight (lambda) of the odds-ratio term.", gt=0)
    rft_reward_threshold: float = key(1.0, "rft: episodes whose reward is at least this are trained on.")
    distill_kl_coef: float = key(1.0, "on_policy_distillation: the weight of the teacher's signal, A_t = kl_coef * "
                                 "(teacher logprob - student logprob) of each sampled token.", ge=0)
    distill_reward_weight: float = key(0.0, "on_policy_distillation: the weight of the task reward's group "
                                       "advantage added to every token's (0: distillation alone).", ge=0)
    distill_topk: int = key(0, "on_policy_distillation: the teacher's k likeliest tokens at each position add a "
                            "forward-KL term on them (lifts tokens the student never samples; 0: off). At most 20, "
                            "what vLLM returns by default (a server teacher must allow k: vLLM's --max-logprobs).",
                            ge=0, le=20)
    distill_topk_coef: float = key(1.0, "on_policy_distillation with distill_topk: the weight of the top-k term.", gt=0)
    distill_teacher_temperature: float = key(
        1.0, "on_policy_distillation with distill_topk: the teacher's distribution sharpened, p_T^(1/tau) "
        "renormalised over its top k, in both terms: below 1 the student is drawn to the teacher's likeliest token "
        "where the teacher hesitates (1: the teacher as it is; above 1 is refused: renormalised over the top k, a "
        "flattened teacher would lose the tail it lifts).", gt=0, le=1)
    adv_estimator: Literal["grpo", "dr_grpo", "rloo"] = key(
        "grpo",
        "Advantage estimator: grpo | dr_grpo (r - mean, pair with loss_agg_mode seq-mean-token-sum-norm) | rloo "
        "(leave-one-out baseline). Formulas in astuner/algorithm/.",
    )
    norm_adv_by_std_in_grpo: bool = key(True, "GRPO: divide (r - mean) by (std + epsilon) within each group.")
    epsilon: float = key(1.0e-6, "Added to the group std before dividing (> 0).", gt=0)
    filter_groups: FilterGroups = section(
        FilterGroups, "DAPO dynamic sampling (formulas in astuner/algorithm/dynamic_sampling.py)."
    )


class PolicyLossSection(Section):
    loss_mode: Literal["vanilla", "gspo"] = key(
        "vanilla",
        "vanilla: token-level PPO-clip ratio | gspo: one ratio per sequence, exp(mean token log-ratio), clipped "
        "(GSPO; use small clip ratios, e.g. 3e-4 / 4e-4). Formulas in astuner/algorithm/loss.py and gspo.py.",
    )


class LoraSection(Section):
    rank: int = key(0, "LoRA rank r (0: off, full fine-tuning). Only the adapters train and sit in the optimizer.",
                    ge=0)
    alpha: float = key(16.0, "LoRA alpha: the update is (alpha / r) * B A.", gt=0)
    dropout: float = key(0.0, "Dropout on the adapters' input during the update passes (never while sampling or "
                         "recomputing old logprobs).", ge=0, lt=1)
    target_modules: Union[str, list[str]] = key(
        "all-linear", 'Modules that get adapters: "all-linear" (every linear but the LM head) or names such as '
        "[q_proj, k_proj, v_proj, o_proj].")


class TrainerCommonSection(Section):
    save_freq: int = key(
        99999, "Save a checkpoint (global_step_N/, resumable) every this many steps; one is always saved at the end.",
        ge=1,
    )
    test_freq: int = key(99999, "Validate every this many steps; validation also runs at the end.", ge=1)
    val_before_train: bool = key(True, 'Validate before the first step (gives the "start" score in the summary).')
    val_num_repeat: int = key(
        1,
        "Validation runs one greedy episode per task (val/accuracy); above 1 it also samples this many per task at "
        "rollout.temperature and logs val/pass@1 ... val/pass@k (unbiased).",
        ge=1,
    )
    total_epochs: int = key(1, "Passes over the training tasks.", ge=1)
    total_training_steps: Optional[int] = key(
        None, "Stop after this many steps even if epochs remain; null: no cap.", ge=1
    )
    resume_mode: str = key(
        "auto",
        "auto: continue from the latest complete checkpoint in experiment_dir (or start fresh there, or in a new "
        "folder if it holds a run without one) | disable: never resume; a folder holding a run is left alone and "
        "the run goes to a new folder | <path to a global_step_N folder>: continue from that checkpoint.",
    )
    max_idle_steps: int = key(
        5,
        "Stop the run when this many steps in a row gave no sample with a gradient (every episode failed, or every "
        "group's rewards were equal); the message quotes the first error.",
        ge=1,
    )
    watchdog_factor: float = key(
        3.0, "A step running longer than this many times the median step (once 2 steps are done) is reported: the "
        "log and the progress bar name its stage, the oldest pending item (episode, model call, tool, judge, "
        "environment-service request, actor) and how long each has waited.", gt=1)
    stage_timeout_s: Optional[float] = key(
        21600.0, "A stage of a step (rollout, train, sync, checkpoint, validation) running longer stops the run "
        "with the watchdog's report of what it waited on, instead of hanging (a last resort: episodes, judges "
        "and Ray waits have their own deadlines); null: no deadline.", gt=0)
    n_explorers: int = key(
        1, "Explorer actors of the trinity backbone, each with its own engine (rollout.engine: vllm or hf; "
        "tensor_model_parallel_size GPUs on a GPU cluster, cpus_per_worker CPUs otherwise) and rollout workers.",
        ge=1)
    trinity_only__n_vllm_engine: int = old_name("astuner.trainer_common.n_explorers", 1, ge=1)
    nnodes: int = key(1, "Nodes the trainer workers of the verl and trinity backbones spread over (as in verl).", ge=1)
    n_gpus_per_node: int = key(
        1, "Trainer workers per node for the verl and trinity backbones (as in verl): one per GPU on a GPU cluster; "
        "on a CPU-only cluster, processes of cpus_per_worker CPUs each. Above 1 in all they train data-parallel "
        "(torch.distributed: NCCL on GPU, gloo on CPU), each on its share of a step's episodes.", ge=1)
    strategy: Literal["auto", "ddp", "fsdp2"] = key(
        "auto", "How trainer workers of the verl and trinity backbones share the model when there are several (as "
        "verl's actor strategy): ddp (a whole replica each, gradients all-reduced) | fsdp2 (parameters, gradients "
        "and AdamW state sharded over the workers with torch FSDP2: 16/world bytes per parameter each, plus one "
        "gathered layer) | auto (fsdp2 for full fine-tuning on GPU, ddp on CPU and with LoRA). Both give the same "
        "updates.")
    trainer_groups: Literal["one", "per_model"] = key(
        "one", "Where the trinity backbone trains several models (astuner.models): one (every trainer worker holds "
        "every model's trainer, and they train in turn; strategy ddp) | per_model (each model gets a trainer group "
        "of its own, nnodes x n_gpus_per_node workers, and the models train at the same time; each group may use "
        "fsdp2). verl colocates every model in each worker.")
    cpus_per_worker: float = key(
        1.0, "CPUs Ray reserves for each trainer worker and explorer of the verl and trinity backbones (fractions "
        "allowed).", gt=0)
    actor_timeout_s: float = key(
        3600.0, "Deadline of each wait on a Ray actor in the verl and trinity backbones (a rollout batch, a train "
        "step, a checkpoint, placing the actors): on expiry the run stops and says who waited for whom.", gt=0)
    mini_batch_num: int = key(
        1, "Optimizer steps per training step: the step's episodes are split into this many mini-batches.", ge=1
    )
    micro_batch_token_budget: int = key(
        13000,
        "Token budget of one training micro-batch (padded prompt + response tokens), for every backbone's trainer; "
        "a single sample longer than this forms its own micro-batch. Activation memory grows with it (fp32, 135M "
        "demo model: about 1.7 MB per token).",
        ge=1,
    )
    ppo_epochs: int = key(1, "Passes over each step's samples (each pass: mini_batch_num optimizer steps).", ge=1)
    optim: OptimSection = section(OptimSection)
    algorithm: AlgorithmSection = section(AlgorithmSection)
    policy_loss: PolicyLossSection = section(PolicyLossSection, "The policy-gradient loss (verl's actor.policy_loss).")
    lora: LoraSection = section(
        LoraSection, "LoRA adapters (PEFT). The engine gets merged weights W + (alpha/r) B A each sync; checkpoints "
        "hold the adapter; astuner export CHECKPOINT --out DIR writes a merged model folder.")
    gradient_checkpointing: bool = key(
        False,
        "Recompute each decoder layer's activations in the backward pass instead of keeping them: less memory per "
        "micro-batch token (demo model: 5.0 -> 0.9 GiB kept for 2400 tokens, +10% step time; bench/). Needs a model "
        "without dropout.",
    )
    shared_prefix_min_tokens: int = key(
        16,
        "Samples of a micro-batch whose inputs share at least this many leading tokens (a task's repeats: its system "
        "prompt, tool schemas and question) forward that prefix once; each sample's own tokens attend to it through "
        "a copy of its cache, and the gradient flows back through it (the agent quick-start's shape: forward and "
        "backward 2.7x faster, the same gradient to 6e-5; bench/shared_prefix.py). Full-attention decoders, checked at start; the plain path "
        "under gradient_checkpointing or fsdp2. 0: never.",
        ge=0,
    )
    precision: Literal["auto", "fp32", "bf16"] = key(
        "auto",
        "Trainer precision: auto (bf16 on CUDA, fp32 on CPU) | fp32 | bf16 (bf16 weights and compute, fp32 master "
        "weights and AdamW state; checkpoints hold the fp32 masters).",
    )
    old_logprobs: Literal["engine", "trainer"] = key(
        "engine",
        "The PPO ratio's denominator: engine (the sampling logprobs the rollout recorded; no extra pass) | trainer "
        "(recomputed by the trainer before the first update, one more forward pass; the engine's stay for "
        "rollout_is_cap). Formulas in astuner/algorithm/mismatch.py.",
    )
    rollout_is_cap: Optional[float] = key(
        None,
        "Truncated importance sampling on the engine/trainer ratio: each token's policy-gradient term is "
        "multiplied by min(exp(trainer - engine logprob), cap). null: off (on CPU in fp32 the two agree to ~1e-6; "
        "use it when rollout/kl_engine_trainer_k3 is large, e.g. bf16 vLLM; 2 is common).",
        ge=1,
    )
    entropy_coeff: float = key(
        0.0, "Subtract entropy_coeff * (token entropy, aggregated like the loss) from the loss; 0: off.", ge=0
    )
    clip_ratio_low: float = key(0.2, "PPO clip range: ratio is clipped to [1 - clip_ratio_low, 1 + clip_ratio_high].",
                                ge=0, lt=1)
    clip_ratio_high: float = key(0.28, "Upper side of the PPO clip range.", ge=0)
    clip_ratio_c: float = key(
        3.0, "Dual-clip (verl): for tokens with a negative advantage the loss is capped at -A * clip_ratio_c (> 1).",
        gt=1,
    )
    use_kl_loss: bool = key(False, "Add kl_loss_coef * KL(policy || frozen initial policy) per token to the loss.")
    kl_loss_coef: float = key(0.001, "Weight of the KL term.", ge=0)
    kl_loss_type: Literal["k1", "k3"] = key("k3", "KL estimator: k1 (log ratio) | k3 (low-variance, >= 0, clamped).")
    loss_agg_mode: Literal[LOSS_AGG_MODES] = key(  # type: ignore[valid-type]
        "episode-mean-token-mean",
        "episode-mean-token-mean (every episode weighs the same, however many calls or tokens) | token-mean "
        "(verl/DAPO: every token of the mini-batch weighs the same) | seq-mean-token-mean | seq-mean-token-sum-norm "
        "(formulas in astuner/algorithm/loss.py).",
    )
