"""The config sections of what an episode needs (`schema.py` re-exports them): the model, the task readers, the
data, the rollout and the task judge.
"""

from __future__ import annotations

from typing import Any, Literal, Optional

from pydantic import Field

from astuner.config.schema_keys import Section, key, section


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


class RgDatasetEntry(Section):
    name: str = Field(description="A reasoning-gym dataset name, e.g. chain_sum, basic_arithmetic, leg_counting.")
    weight: float = key(1.0, "Its share of the mix (reasoning-gym's composite weights; need not sum to 1).", gt=0)
    config: dict[str, Any] = key({}, "Its config class's fields, e.g. {min_terms: 2, max_terms: 2} for chain_sum.")


class ReasoningGymReader(Section):
    datasets: list[RgDatasetEntry] = key(
        [], "reasoning-gym datasets, mixed by weight: [{name: chain_sum, weight: 1.0, config: {max_digits: 1}}]. "
        "Their own score_answer is the reward (astuner/environments/reasoning_gym.py).")
    size: int = key(1000, "Training tasks (items 0..size-1 of the mix).", ge=1)
    validation_size: int = key(64, "Validation tasks, drawn under another seed; 0: no validation.", ge=0)
    seed: Optional[int] = key(None, "Seed of the generators; null: astuner.seed.")
    system_prompt: str = key(
        "default", "System prompt of the built-in workflow: a name from reasoning-gym's SYSTEM_PROMPTS (default | "
        "DeepSeekZero | simple | direct | chain_of_draft) or the text itself; \"\": none.")
    answer_from: Literal["tag", "last_number", "reply"] = key(
        "tag", "What of the reply the dataset's scorer gets: tag (the text inside the last "
        "<answer_tag>...</answer_tag>, reasoning-gym's convention; none: no answer) | last_number (the reply's "
        "last number, for models that do not write tags) | reply (the whole reply, stripped).")
    answer_tag: str = key("answer", "The tag of answer_from tag.")


class TextArenaReader(Section):
    env_id: str = key("GuessTheNumber-v0", "A TextArena game id, e.g. GuessTheNumber-v0, TowerOfHanoi-v0, "
                      "TicTacToe-v0 (its raw variant is played: astuner/environments/textarena.py).")
    env_kwargs: dict[str, Any] = key({}, "The game's constructor arguments, e.g. {min_number: 1, max_number: 50}.")
    opponent: Optional[str] = key(None, "The other seat of a two-player game: policy (the model itself, its calls "
                                  "never trained) | 'module->function' (observation text -> move); null: a "
                                  "one-player game.")
    size: int = key(256, "Training games (seeds seed .. seed + size - 1).", ge=1)
    validation_size: int = key(32, "Validation games, under other seeds; 0: no validation.", ge=0)
    seed: Optional[int] = key(None, "Seed of the first game; null: astuner.seed.")
    max_turns: int = key(30, "The model's moves after which a game still running stops unfinished (reward 0).",
                         ge=1)
    system_prompt: str = key("", "A system message before the game's own prompt; \"\": none.")


class OpenEnvReader(Section):
    app_dir: str = key(".", "The environment's package (relative: to the YAML's folder, then the working directory); "
                       "its app is imported from there.")
    app: Optional[str] = key(None, "The environment server's app, 'module:attribute' as uvicorn imports it (e.g. "
                             "server.app:app); null: the 'app:' line of app_dir/openenv.yaml.")
    reset_kwargs: dict[str, Any] = key({}, "Arguments of every reset besides the task's seed.")
    size: int = key(256, "Training episodes (reset seeds seed .. seed + size - 1).", ge=1)
    validation_size: int = key(32, "Validation episodes, under other seeds; 0: no validation.", ge=0)
    seed: Optional[int] = key(None, "Seed of the first episode; null: astuner.seed.")
    max_turns: int = key(16, "The model's turns after which an episode still running stops unfinished.", ge=1)
    action_field: Optional[str] = key(None, "null: the environment's MCP tools are the agent's tools (each tool call a "
                                      "step); a name: the model's whole reply is the action {name: reply}.")
    system_prompt: str = key("", "A system message before the environment's first observation; \"\": none.")
    servers: int = key(1, "Environment servers started per rollout process (subprocesses of 127.0.0.1).", ge=1)
    sessions_per_server: int = key(1, "Episodes one server holds at once: its app's max_concurrent_envs (1 unless "
                                   "its environment declares SUPPORTS_CONCURRENT_SESSIONS).", ge=1)


class VerifiersReader(Section):
    env_id: str = key("", "The taskset id verifiers loads: an importable module exporting one Taskset (verifiers' "
                      "own tasksets by name, or yours, with env_dir).")
    env_dir: Optional[str] = key(None, "A folder put on the import path first (relative: to the YAML's folder, then "
                                 "the working directory): where your taskset's module lives.")
    env_args: dict[str, Any] = key({}, "The taskset's config keys (verifiers' TasksetConfig of that taskset).")
    agent: dict[str, Any] = key({}, "The agent's config keys (verifiers' AgentConfig: harness, max_turns, token caps, "
                                "runtime; runtime is subprocess, on this machine, unless set).")
    size: Optional[int] = key(None, "Training tasks: the taskset's first `size`; null: all but the validation ones.",
                              ge=1)
    validation_size: int = key(16, "Validation tasks: the `validation_size` after the training ones; 0: none.", ge=0)


class TaskReaderSection(Section):
    type: Literal["jsonl_dataset_file", "huggingface_dat_repo", "env_service", "reasoning_gym", "textarena",
                  "openenv", "verifiers"] = key(
        "jsonl_dataset_file",
        "Which reader builds the tasks: jsonl_dataset_file | huggingface_dat_repo | env_service | reasoning_gym | "
        "textarena | openenv | verifiers (the last four with their own workflow and judge unless you name yours: "
        "astuner/environments/)."
    )
    query_field: str = key("question", "Dataset field holding the question (becomes Task.main_query).")
    task_id_field: Optional[str] = key(None, 'Dataset field holding a stable task id; null: "<split>-<row index>".')
    jsonl_dataset_file: JsonlReader = section(JsonlReader)
    huggingface_dat_repo: HfReader = section(HfReader)
    env_service: EnvServiceReader = section(
        EnvServiceReader, "An HTTP environment service: tasks, instances, steps and evaluation (astuner/env_service.py)."
    )
    reasoning_gym: ReasoningGymReader = section(
        ReasoningGymReader, "reasoning-gym's procedural datasets, scored by their own score_answer "
        "(pip install 'astuner[reasoning-gym]')."
    )
    textarena: TextArenaReader = section(
        TextArenaReader, "TextArena's games, played turn by turn and scored by their own outcome "
        "(pip install 'astuner[textarena]')."
    )
    openenv: OpenEnvReader = section(
        OpenEnvReader, "An OpenEnv environment served from your package on this machine, its MCP tools the agent's, "
        "its rewards the episode's (pip install 'astuner[openenv]')."
    )
    verifiers: VerifiersReader = section(
        VerifiersReader, "A verifiers (v1) environment, its rollout run by verifiers against astuner's endpoint, its "
        "rewards the episode's (pip install 'astuner[verifiers]', in an environment without AgentScope 1.x)."
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
    train_max_samples: int = key(
        -1, "Training tasks used, as in verl: -1 all; N a subset of N (with shuffle, drawn with astuner.seed; "
        "without, the first N), for a quick run on part of a large dataset.", ge=-1)
    val_max_samples: int = key(
        -1, "Validation tasks used (every validation and `astuner eval`), as in verl: -1 all; N a subset of N as "
        "train_max_samples draws it, for a cheaper validation.", ge=-1)


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
    env_timeout: float = key(
        60.0,
        "Seconds one call of an environment others wrote (a game's step, a scorer, an environment service's "
        "request) may take; past it, as when the call raises, the episode's environment has failed: flagged "
        "env_failed, not trained on, not counted in its group, and run again (env_retries).",
        gt=0,
    )
    env_retries: int = key(
        2,
        "Times an episode whose environment failed is run again with a fresh environment (same task, same seed), "
        "counted as env/failed and env/retried. A batch in which more than half the episodes still fail stops the "
        "run with the environment's error.",
        ge=0,
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
    context_policy: Literal["none", "drop_tool_outputs", "summarize", "subagent"] = key(
        "none",
        "When a call's prompt leaves no room for a whole turn (max_response_length_in_one_turn) in max_model_len, "
        "what the model is shown: none: what fits (a cut labelled window) | drop_tool_outputs: the oldest tool "
        "results become a marker | summarize: the model writes a summary of the conversation so far in the same "
        "episode (trained with its reward) and sees the task, the summary and the latest turn | subagent: the oldest "
        "tool results are each read by a sub-agent in a fresh context (a call of the same episode, trained with its "
        "reward), whose report is shown in their place. The agent's own "
        "messages are never changed; each compaction starts a new segment (astuner/model_tuner/context.py).",
    )
    summary_max_tokens: int = key(
        256, "New tokens of a summary call (context_policy: summarize) or a sub-agent's report (subagent).", ge=1)
    on_cut: Literal["train", "mask", "drop"] = key(
        "train",
        "What training does with an episode a limit cut (the per-turn cap, the episode's token budget, the window; "
        "each labelled and counted as rollout/cut/<limit>): train: as sampled, an episode a limit ended with "
        "reward 0 | mask: the cut calls leave the loss, an episode a limit ended is not trained | drop: an episode "
        "with any cut is not trained.",
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
    if_success: bool = key(False, "Count this term only in episodes judged a success: a shape that breaks ties "
                           "among right answers (a shorter one wins) without pushing wrong ones the same way.")


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
        "SummaryLengthPenalty {target, alpha} (the tokens of context_policy=summarize's summaries), "
        "StepBonus {per_step, max_steps}, FormatReward {pattern}. E.g. [{judge: astuner.task_judge."
        "math_answer_as_judge->MathAnswerAsJudge, weight: 1.0}, {judge: astuner.task_judge.shaping->LengthPenalty, "
        "args: {target: 256, alpha: 0.001}}].",
    )
    timeout: float = key(
        300.0, "Seconds an episode's judging may take, all its judges together (the terms of combine share it). "
        "Past it the episode is flagged judge_timeout and left out of training, and the run goes on: an async "
        "judge is cancelled, a plain one's thread is abandoned.", gt=0)
