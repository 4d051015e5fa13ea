"""The config schema: every key's type, range, default and documentation, in one place.

The packaged default YAMLs (`default_config/*.yaml`) are generated from these models (`python -m
astuner.config.default_yaml --write`; a test fails when they drift), so the Hydra defaults, the validator and the
typed object each stage receives cannot disagree. After composing, `RunConfig.model_validate(tree)` checks types
strictly (`2.5` is not an int, `"abc"` is not a number, `true` is not an int) and ranges, and the stages read the
resulting frozen objects: `loaded.typed.astuner.rollout.num_repeat` is an int >= 1, no casting anywhere.
A renamed key keeps its old name as an `old_name` field, so configs written for it still load.

Imports only pydantic, so `astuner --help` stays fast.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

LOSS_AGG_MODES = ("episode-mean-token-mean", "token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")


def key(default: Any, doc: str, refused: str | None = None, **bounds: Any) -> Any:
    """A config key: its default, its documentation (a comment above it in the YAML), optional ge/gt/le bounds.
    `refused`: why a value outside the allowed ones is refused, added to the error (e.g. a value another
    trainer accepts that this one does not implement)."""
    extra = {"refused": refused} if refused else None
    return Field(default=default, description=doc, json_schema_extra=extra, **bounds)


def old_name(new_key: str, default: Any, **bounds: Any) -> Any:
    """A key's old name, kept so that configs written for it still load. Loading moves a value set here to
    `new_key` (with one notice) and keeps both equal, so user code reading either sees the same value."""
    doc = (f"Old name of {new_key}: a value set here goes there (with one notice at start), and this key always "
           "holds the same value. Set the new name instead.")
    return Field(default=default, description=doc, json_schema_extra={"old_name_of": new_key}, **bounds)


def section(cls: type, doc: str = "") -> Any:
    return Field(default_factory=cls, description=doc)


class Section(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)


# --- astuner ------------------------------------------------------------------------------------------------


class ModelSection(Section):
    path: str = key(
        "demo:smollm2-135m-instruct",
        'Policy model: a local Hugging Face folder, a hub id already in the local HF cache, or '
        '"demo:smollm2-135m-instruct" (the embedded demo model; converted and cached on first use).',
    )


class JsonlFile(Section):
    file_path: Optional[str] = key(None, "Local .jsonl, .json (a list of objects) or .parquet file.")


class JsonlValidation(Section):
    file_path: Optional[str] = key(None, "null: no validation.")


class JsonlReader(Section):
    training: JsonlFile = section(JsonlFile)
    validation: JsonlValidation = section(JsonlValidation)


class HfReader(Section):
    dataset_path: Optional[str] = key(
        None,
        "A `datasets.load_dataset` path: a local dataset folder (e.g. my_dataset/ with train.jsonl) or a hub id "
        "already in the local HF cache (there is no hub access at run time on offline machines).",
    )
    dataset_name: Optional[str] = key(
        None, 'Dataset configuration name passed to load_dataset (e.g. "main" for gsm8k); null: none.'
    )
    training_split: str = key("train", "Split to train on.")
    validation_split: Optional[str] = key(None, "null: no validation.")


class EnvServiceReader(Section):
    env_url: Optional[str] = key(None, "Base URL of the environment service (protocol: astuner/env_service.py).")
    env_type: str = key("default", "Environment type the service should create (sent with every request).")
    training_split: str = key("train", "Split to train on.")
    validation_split: Optional[str] = key(None, "null: no validation.")
    request_timeout: float = key(30.0, "Seconds one request may take before it is retried.", gt=0)
    retries: int = key(3, "Retries of a failed request with backoff: a request that never reached the service, a "
                       "GET after a timeout or 5xx, and a sent POST only when the service honours Idempotency-Key "
                       "(tutorial/env_service/README.md).", ge=0)


class TaskReaderSection(Section):
    type: Literal["jsonl_dataset_file", "huggingface_dat_repo", "env_service"] = key(
        "jsonl_dataset_file", "Which reader builds the tasks: jsonl_dataset_file | huggingface_dat_repo | env_service"
    )
    query_field: str = key("question", "Dataset field holding the question (becomes Task.main_query).")
    task_id_field: Optional[str] = key(None, 'Dataset field holding a stable task id; null: "<split>-<row index>".')
    jsonl_dataset_file: JsonlReader = section(JsonlReader)
    huggingface_dat_repo: HfReader = section(HfReader)
    env_service: EnvServiceReader = section(
        EnvServiceReader, "An HTTP environment service: tasks, instances, steps and evaluation (astuner/env_service.py)."
    )


class DataSection(Section):
    train_batch_size: int = key(32, "Tasks per training step (each is rolled out rollout.num_repeat times).", ge=1)
    max_prompt_length: int = key(
        3000, 'Episodes whose first prompt is longer than this many tokens end at once, flagged "overflow".', ge=1
    )
    max_response_length: int = key(
        10000,
        'Budget of generated tokens over all LLM calls of one episode; once spent, the episode ends ("overflow").',
        ge=1,
    )
    shuffle: bool = key(True, "Shuffle training tasks each epoch (seeded by astuner.seed).")


class MultiTurn(Section):
    sample_mode: Literal["per_call", "merge"] = key(
        "per_call",
        "per_call: one training sample per LLM call | merge: consecutive calls of one agent whose prompt extends "
        "the previous prompt + response token-exactly become one sample, the loss masked to generated tokens "
        "(fewer, longer samples, same gradient; rollout/merge_ratio says how many calls joined).",
    )
    max_sample_per_task: int = key(
        4,
        "Most training samples (LLM calls) kept per episode. When an episode made more calls, the last call and "
        "evenly spaced earlier ones are kept (deterministic); the episode's weight in the loss is unchanged.",
        ge=1,
    )


class RolloutSection(Section):
    agentscope_workflow: Optional[str] = key(
        None,
        'The user\'s workflow: "pkg.module->Class" or "path/to/file.py->Class" (relative to the YAML\'s folder, then '
        "the working directory), a Workflow subclass, or a function 'async def f(task: dict, model, "
        "auxiliary_models) -> WorkflowOutput'. Any framework works; the name is kept from the AgentScope-first API.",
    )
    engine: Literal["auto", "vllm", "hf"] = key(
        "auto",
        "Inference engine: auto (vllm when it can be imported, else hf; the log says which) | vllm (vLLM's async "
        "engine in its own process: continuous batching, prefix caching, in-place weight sync) | hf (in-process "
        "transformers, the reference implementation).",
    )
    temperature: float = key(1.0, "Sampling temperature for training rollouts (> 0). Validation is always greedy.", gt=0)
    top_p: float = key(
        1.0,
        "Nucleus sampling for training rollouts (1.0: off). The recorded logprobs are those of the filtered "
        "distribution actually sampled from, and the trainer computes the same one.",
        gt=0,
        le=1,
    )
    top_k: int = key(0, "Top-k sampling for training rollouts (0: off); filtered as top_p is.", ge=0)
    max_env_worker: int = key(
        64, "Episodes run concurrently (asyncio); also the most requests the hf engine batches together.", ge=1
    )
    num_repeat: int = key(
        4, "Episodes per task; GRPO advantages are computed within these groups (1: no baseline, no learning).", ge=1
    )
    episode_timeout: float = key(
        600.0,
        "Seconds before an episode is stopped and flagged timeout (not trained on), whatever the workflow does "
        "after: its pending LLM requests are aborted and its later LLM calls fail at once.",
        gt=0,
    )
    agent_madness_reward: float = key(
        0.0, "Reward given to an episode in which a check from compute_madness_checklist fired."
    )
    compute_madness_checklist: list[Literal["nonsense", "wrong_toolcall"]] = key(
        ["nonsense", "wrong_toolcall"],
        "Madness checks: nonsense (garbled or looping text, leaked special tokens) | wrong_toolcall.",
    )
    max_response_length_in_one_turn: int = key(1024, "Max new tokens of one LLM call.", ge=1)
    max_model_len: Optional[int] = key(
        None,
        "Context window: prompt + response of one call; null: the model's own limit (max_position_embeddings). "
        'A prompt that leaves no room ends the episode ("overflow"). Checked against the model before it loads.',
        ge=1,
    )
    python_tool_unsandboxed: bool = key(
        False, "Only where bubblewrap cannot run: true runs model-written Python (execute_python_code) in a process "
        "sandbox that reaches the network, loopback services included, and, for a user other than root, runs as "
        "you: the code can kill the run and, without Landlock, read your files (as root: uid 65534, or root where "
        "that uid cannot run the interpreter); false refuses the tool, saying how to get bubblewrap.")
    tool_prompt: Literal["auto", "template", "builtin"] = key(
        "auto",
        "How tools reach the model: auto (the chat template if it renders tools, else the built-in tool prompt) | "
        "template | builtin.",
    )
    tool_call_parser: Literal["auto", "hermes", "qwen3_coder", "llama3_json", "mistral", "gemma4"] = key(
        "auto",
        "Parser for tool calls in model output: auto (detected from the chat template; hermes with the built-in "
        "tool prompt) | hermes (<tool_call>{json}</tool_call>: Hermes, Qwen2.5, Qwen3) | qwen3_coder "
        "(<function=name><parameter=p>) | llama3_json | mistral ([TOOL_CALLS]) | gemma4 "
        "(<|tool_call>call:name{...}).",
    )
    reasoning_parser: Literal["auto", "none", "think", "channel"] = key(
        "auto",
        "auto (from the chat template's markers) | none | think: <think>...</think> | channel: Gemma 4's "
        "<|channel>thought...<channel|>. Reasoning is kept out of the content the agent sees (returned as "
        "reasoning_content) and kept in the trained tokens.",
    )
    preflight: Literal["strict", "warn", "off"] = key(
        "strict",
        "Token-pipeline check before training: a golden conversation through the chat template and the parsers "
        "(the parser recovers the template's own tool call, each turn's prompt extends the last) and engine vs "
        "trainer logprobs on a short sequence. strict: stop with a message when a check fails | warn | off.",
    )
    tensor_model_parallel_size: int = key(1, "Tensor-parallel degree of each vLLM engine.", ge=1)
    max_num_seqs: int = key(64, "Max concurrent sequences in one vLLM engine.", ge=1)
    gpu_memory_utilization: float = key(0.6, "Fraction of accelerator memory vLLM may take.", gt=0, le=1)
    multi_turn: MultiTurn = section(MultiTurn)


class CombineItem(Section):
    judge: str = Field(description='"pkg.module->Class" (a BaseJudge, built as Class(config, **args)) or '
                       '"module->function".')
    weight: float = key(1.0, "Weight of this term in the reward.")
    name: Optional[str] = key(None, "Metric name of the term (reward/<name>); null: the judge's class name.")
    args: dict[str, Any] = key({}, "Keyword arguments of the judge class, e.g. {target: 256, alpha: 0.001}.")
    success: bool = key(False, "Whether this term decides is_success (default: the first term).")


class TaskJudgeSection(Section):
    judge_protocol: str = key(
        "astuner.task_judge.math_answer_as_judge->MathAnswerAsJudge",
        'Scores an episode when the workflow returns reward=None: "pkg.module->Class" subclassing '
        "astuner.task_judge.base_judge.BaseJudge, or a function 'async def judge(task: dict, response, "
        "auxiliary_models) -> JudgeOutput'. compute_reward may be a plain or an async def; a plain one runs "
        "in a worker thread, so a slow judge does not stall the episodes still running.",
    )
    combine: list[CombineItem] = key(
        [],
        "Reward as a weighted sum of judges, each logged as its own metric (reward/<name>); when set, "
        "judge_protocol is not used. Shapes in astuner.task_judge.shaping: LengthPenalty {target, alpha}, "
        "StepBonus {per_step, max_steps}, FormatReward {pattern}. E.g. [{judge: astuner.task_judge."
        "math_answer_as_judge->MathAnswerAsJudge, weight: 1.0}, {judge: astuner.task_judge.shaping->LengthPenalty, "
        "args: {target: 256, alpha: 0.001}}].",
    )
    timeout: float = key(
        300.0, "Seconds an episode's judging may take, all its judges together (the terms of combine share it). "
        "Past it the episode is flagged judge_timeout and left out of training, and the run goes on: an async "
        "judge is cancelled, a plain one's thread is abandoned.", gt=0)


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
    type: Literal["grpo", "rft", "sft", "dpo", "orpo"] = key(
        "grpo",
        "grpo: RL on rollouts (adv_estimator picks the GRPO-family variant) | rft: rejection-sampling fine-tuning "
        "on rollouts (keep episodes with reward >= rft_reward_threshold, SFT on their calls) | sft | dpo | orpo: "
        "on astuner.offline_data (chat jsonl; no rollouts).",
    )
    beta: float = key(0.1, "dpo: the KL temperature beta | orpo: the weight (lambda) of the odds-ratio term.", gt=0)
    rft_reward_threshold: float = key(1.0, "rft: episodes whose reward is at least this are trained on.")
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


class AuxiliaryModelSection(Section):
    model_path: Optional[str] = key(None, "Served by astuner: a local model folder (a second engine, frozen).")
    base_url: Optional[str] = key(None, "Or an OpenAI-compatible endpoint, e.g. http://127.0.0.1:8000/v1.")
    api_key_env: Optional[str] = key(None, "Environment variable holding the endpoint's key (never logged or saved).")
    model_name: Optional[str] = key(None, "Model name sent to the endpoint; null: the key of this entry.")
    temperature: float = key(0.0, "Sampling temperature of its calls (0: greedy).", ge=0)
    max_tokens: int = key(512, "Max new tokens of one call.", ge=1)
    timeout: float = key(120.0, "Seconds one endpoint call may take (with retries inside it).", gt=0)


class OfflineDataSection(Section):
    train_file: Optional[str] = key(
        None,
        'For algorithm.type sft, dpo, orpo: a .jsonl of conversations. sft: {"messages": [...], "tools": [...]} '
        '(OpenAI chat messages, tool calls and tool results included; loss on assistant tokens only). dpo, orpo: '
        '{"prompt": [...], "chosen": [...], "rejected": [...]} (message lists, as in TRL).',
    )
    val_file: Optional[str] = key(None, "Same format; its loss is logged every test_freq steps (val/loss).")


class LogviewSection(Section):
    port: int = key(
        0, "Port of the log viewer that --with-logview starts on 127.0.0.1; 0: any free port (the URL is printed).",
        ge=0, le=65535,
    )


class AstunerSection(Section):
    project_name: str = key("astuner_project", "Name of the run, shown in logs, tensorboard and the summary.")
    experiment_dir: Optional[str] = key(
        None, "Output folder. null: launcher_record/<name of the YAML file without .yaml>, relative to the working "
        "directory."
    )
    seed: int = key(42, "Seed for data order, sampling and model init of anything random.")
    model: ModelSection = section(ModelSection)
    task_reader: TaskReaderSection = section(TaskReaderSection)
    data: DataSection = section(DataSection)
    rollout: RolloutSection = section(RolloutSection)
    task_judge: TaskJudgeSection = section(TaskJudgeSection)
    trainer_common: TrainerCommonSection = section(TrainerCommonSection)
    auxiliary_models: dict[str, AuxiliaryModelSection] = key(
        {},
        "Frozen models the workflow and judge may call (e.g. an LLM judge), by name: {judge: {model_path: ...}} "
        "or {judge: {base_url: ..., api_key_env: OPENAI_API_KEY, model_name: ...}}. Function workflows and judges "
        "get them as `auxiliary_models`, class workflows as `model_tuner.auxiliary_models`; never trained, their "
        "calls are logged as aux/<name>/... metrics.",
    )
    offline_data: OfflineDataSection = section(
        OfflineDataSection, "Demonstrations or preference pairs for algorithm.type sft, dpo, orpo (no rollouts)."
    )
    logview: LogviewSection = section(
        LogviewSection, "The trajectory and metrics viewer (--with-logview; `astuner logview PATH` for a finished run)."
    )


# --- trinity / verl -----------------------------------------------------------------------------------------


class TrinityTrainer(Section):
    max_token_len_per_gpu: int = old_name("astuner.trainer_common.micro_batch_token_budget", 13000, ge=1)


class TrinitySynchronizer(Section):
    sync_interval: int = key(
        1, "Trainer steps between weight syncs to the explorers (fixed style). 1 with sync_offset 0: on-policy, "
        "the same steps as the debug and verl backbones.", ge=1)
    sync_offset: int = key(
        0, "Extra batches the explorers may roll out ahead of the trainer, on older weights (1 with sync_interval "
        "1: one-step off-policy; rollout of step s+1 overlaps training of step s).", ge=0)
    sync_style: Literal["fixed", "dynamic_by_explorer"] = key(
        "fixed", "fixed: sync after every sync_interval-th trainer step | dynamic_by_explorer: sync only when an "
        "explorer's next batch would be staler than max_staleness.")
    sync_timeout: float = key(1200.0, "Deadline (seconds) of one weight sync to an explorer.", gt=0)
    sync_method: Literal["object_store"] = key(
        "object_store", "How weights reach the explorers: object_store, the only method implemented, sends them "
        "through Ray's object store (shared memory on a node, Ray's transfer between nodes).",
        refused="only object_store is implemented (it sends the trainer's weights to the explorers through Ray's "
        "object store: shared memory on a node, Ray's transfer between nodes); Trinity-RFT's nccl, checkpoint and "
        "memory are not, so set object_store or remove the key")
    max_staleness: Optional[int] = key(
        None, "Bound on a sample's staleness (trainer step - 1 - the policy version that generated it); an "
        "explorer waits for new weights rather than exceed it. null: sync_interval - 1 + sync_offset.", ge=0)


class TrinitySection(Section):
    trainer: TrinityTrainer = section(TrinityTrainer)
    synchronizer: TrinitySynchronizer = section(
        TrinitySynchronizer, "When the trinity backbone's explorers get new weights. Samples rolled out on older "
        "weights than the trainer's are corrected: old logprobs recomputed by the trainer, each token weighted by "
        "min(pi_old / pi_behaviour, rollout_is_cap).")


class VerlSection(Section):
    pass


class RunConfig(Section):
    astuner: AstunerSection = section(AstunerSection)
    trinity: TrinitySection = section(TrinitySection)
    verl: VerlSection = section(VerlSection)


@lru_cache(maxsize=1)
def old_names() -> dict[str, str]:
    """{old dotted key: the key it now names}, read from the schema's `old_name` fields. Do not mutate."""
    out: dict[str, str] = {}

    def walk(cls: type[Section], prefix: str) -> None:
        for name, info in cls.model_fields.items():
            path = f"{prefix}.{name}" if prefix else name
            if isinstance(info.annotation, type) and issubclass(info.annotation, Section):
                walk(info.annotation, path)
            elif isinstance(info.json_schema_extra, dict) and "old_name_of" in info.json_schema_extra:
                out[path] = str(info.json_schema_extra["old_name_of"])

    walk(RunConfig, "")
    return out
