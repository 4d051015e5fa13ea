"""Typed records passed between the stages of the loop.

Shape legend used across `algorithm` and `trainer` (suffixes on tensor names):
  B  samples in a micro-batch     T  tokens of a (padded) sequence
  R  response tokens, flattened over a micro-batch
  E  episodes                     G  episodes of one group (one task, `num_repeat` of them)

Nothing here imports torch: these records cross process boundaries (Ray, later) as plain data.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

FinishReason = Literal["stop", "length"]

# Flags an LLM call or an episode can carry. Madness checks produce the first two.
FLAG_NONSENSE = "nonsense"
FLAG_WRONG_TOOLCALL = "wrong_toolcall"
FLAG_OVERFLOW = "overflow"  # a call refused for the episode's limits (which one: Episode.cut, astuner/cuts.py)
FLAG_FAILED = "failed"  # workflow raised
FLAG_TIMEOUT = "timeout"  # workflow exceeded rollout.episode_timeout
FLAG_JUDGE_TIMEOUT = "judge_timeout"  # judging exceeded task_judge.timeout (the episode also carries FLAG_FAILED)
# A tool's sandbox could not start (astuner/tools/failures.py); the episode also carries FLAG_FAILED.
FLAG_TOOL_INFRA_FAILED = "tool_infra_failed"
# The teacher could not score the episode (on-policy distillation, astuner/distill/); it also carries FLAG_FAILED.
FLAG_TEACHER_FAILED = "teacher_failed"
# The environment failed (a call raised or timed out: astuner/environments/failures.py), after its retries; the
# episode also carries FLAG_FAILED.
FLAG_ENV_FAILED = "env_failed"
# Not trained on for a cut (rollout.on_cut: mask or drop, astuner/cuts.py); not a failure.
FLAG_CUT_DROPPED = "cut_dropped"


@dataclass
class Task:
    """One row of the task dataset."""

    task_id: str
    main_query: str
    init_messages: list[dict[str, Any]] = field(default_factory=list)
    # Every field of the dataset row (ground truth included), untouched.
    metadata: dict[str, Any] = field(default_factory=dict)


@dataclass
class SamplingParams:
    temperature: float = 1.0  # 0 means greedy
    max_tokens: int = 256
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None
    top_p: float = 1.0  # nucleus sampling; 1.0: off (greedy calls ignore both)
    top_k: int = 0  # 0: off


@dataclass
class GenerateResult:
    token_ids: list[int]
    # log pi(token | prefix) under the sampling distribution, i.e. log_softmax(logits / temperature);
    # for greedy (temperature 0) the untempered distribution.
    logprobs: list[float]
    finish_reason: FinishReason


@dataclass
class PromptLogprobs:
    """A prompt scored by an engine: `values[i]` = log p(x_{i+1} | x_<=i), and with top-k, `topk[i]` the k likeliest
    tokens at that position as (token id, logprob), likeliest first."""

    values: list[float]
    topk: list[list[tuple[int, float]]] | None = None


@dataclass
class LLMCall:
    """One recorded model call: exactly the ids the engine saw and produced."""

    prompt_ids: list[int]
    response_ids: list[int]
    response_logprobs: list[float]
    finish_reason: FinishReason
    temperature: float
    response_text: str = ""
    flags: list[str] = field(default_factory=list)
    agent: str = ""  # ModelTuner.for_agent name; "" for the episode's main model
    trainable: bool = True  # False: served and recorded, never a training sample
    model: str = "policy"  # the model that served it (astuner.agents), the one its sample trains
    extends_previous: bool = False  # prompt = an earlier call's exact prompt + response ids + new messages
    tool_call_attempted: bool = False  # the output held a tool call (well-formed or not)
    tool_call_parse_failed: bool = False  # ... and the parser could not use some of it
    tools_offered: bool = False  # the request offered tools (the tool-use alarms watch these calls)
    tool_parser: str = ""  # the parser that read the response (rollout.tool_call_parser, as resolved)
    # One entry per parsed tool call that lacks a `required` argument of the offered schema: "name(arg, ...)".
    missing_tool_arguments: list[str] = field(default_factory=list)
    # The tool schemas the request offered, as shown to the model (`astuner warmstart` reads them from a dry run).
    tools: list[dict] | None = None
    # For the log viewer: the request's messages (only those after the call it extends, when it extends one)
    # and the assistant message handed back.
    messages: list[dict] | None = None
    reply: dict | None = None
    # The teacher's logprob of each response token in this exact context (on-policy distillation, astuner/distill/).
    teacher_logprobs: list[float] | None = None
    # With algorithm.distill_topk = k: the teacher's k likeliest tokens at each response position, as (token id,
    # logprob), likeliest first.
    teacher_topk: list[list[tuple[int, float]]] | None = None
    # The limit that cut the response short ("turn_cap", "budget", "window", "max_tokens"; astuner/cuts.py), or "".
    cut: str = ""
    # The context it was made in (rollout.context_policy, model_tuner/context.py): its agent's segment (0, then +1
    # at each compaction or context the agent started anew), and "summary" (a summary the policy asked for),
    # "subagent" (a sub-agent's report on a tool result, in a fresh context),
    # "compacted" (the first call shown a compacted context) or "reset" (a context the agent started anew).
    segment: int = 0
    context: str = ""


@dataclass
class Episode:
    """One run of a workflow on a task."""

    task: Task
    repeat_index: int
    episode_uid: str
    calls: list[LLMCall] = field(default_factory=list)
    reward: float = 0.0
    is_success: bool = False
    output_metadata: dict[str, Any] = field(default_factory=dict)
    flags: list[str] = field(default_factory=list)
    error: str | None = None  # traceback text when the workflow raised or timed out
    # One line in the error's own words ("ValueError: bad input (a note)"), and which part failed: "workflow" or
    # "judge"; what the console and a stopped run quote.
    error_summary: str | None = None
    error_source: str | None = None
    seconds: float = 0.0
    metrics: dict[str, float] = field(default_factory=dict)  # the workflow's and the judge's, logged per step
    # An agent's own reward (WorkflowOutput.agent_rewards): its calls take it in place of `reward`.
    agent_rewards: dict[str, float] = field(default_factory=dict)
    # Trainer steps behind the weights that generated it (0: the initial model); the trinity backbone's explorers
    # may run on older weights than the trainer's, and the step's staleness is trainer step - 1 - this.
    policy_version: int = 0
    # Threads of ended episodes still stuck in a blocking call in its rollout process when it ended, itself
    # included (daemon_threads); a step's rollout/abandoned_threads is the most of its episodes.
    abandoned_threads: int = 0
    # The limit that refused a call and so ended the episode ("budget", "window", "prompt"; astuner/cuts.py), or "".
    cut: str = ""
    # Attempts of this episode run again because their environment failed (rollout.env_retries) before this one.
    env_retries: int = 0

    @property
    def group_id(self) -> str:
        return self.task.task_id

    @property
    def trainable(self) -> bool:
        """Failed or timed-out episodes have no trustworthy reward and are not trained on; nor are those
        rollout.on_cut leaves out."""
        return not {FLAG_FAILED, FLAG_TIMEOUT, FLAG_CUT_DROPPED} & set(self.flags) and bool(self.calls)


@dataclass
class Sample:
    """One training sample: one recorded LLM call with its episode's advantage."""

    prompt_ids: list[int]
    response_ids: list[int]
    old_logprobs: list[float]
    advantage: float
    temperature: float
    episode_uid: str
    # 1 for generated tokens, 0 for tokens the model did not sample (tool results and turn markers joined in by
    # multi_turn.sample_mode=merge); None means every response token is trained on.
    loss_mask: list[int] | None = None
    call_indices: list[int] = field(default_factory=list)  # the episode's calls this sample holds, in order
    trainer_logprobs: list[float] | None = None  # the trainer's, before the update (set by the loop)
    # The engine's sampling logprobs when old_logprobs were recomputed by the trainer (old_logprobs: trainer).
    engine_logprobs: list[float] | None = None
    policy_version: int = 0  # its episode's (see Episode.policy_version)
    model: str = "policy"  # the model that trains on it (its call's)
    # On-policy distillation (algorithm/distillation.py): the teacher's logprob of each response token (0 where
    # loss_mask is 0), and the advantage of each token, which replaces `advantage` in the loss when set.
    teacher_logprobs: list[float] | None = None
    token_advantages: list[float] | None = None
    # With algorithm.distill_topk: the teacher's k likeliest tokens at each response position ([] where loss_mask
    # is 0), for the top-k term of the loss (algorithm/distillation.py).
    teacher_topk: list[list[tuple[int, float]]] | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.response_ids)

    @property
    def num_trained_tokens(self) -> int:
        return len(self.response_ids) if self.loss_mask is None else sum(self.loss_mask)


@dataclass
class TrainResult:
    """What a training step returns: its metrics, and per sample (in the order given) the trainer's logprobs of its
    response tokens before any update (None for a sample this worker did not forward before the first update)."""

    metrics: dict[str, float]
    trainer_logprobs: list[list[float] | None]

    def attach_to(self, samples: list[Sample]) -> None:
        """Record the trainer's logprobs on the samples, where the log viewer reads them (`Sample.trainer_logprobs`)."""
        for s, logprobs in zip(samples, self.trainer_logprobs):
            if logprobs is not None:
                s.trainer_logprobs = logprobs


@dataclass
class SyncReport:
    """What a weight sync did (`InferenceEngine.load_weights` returns it): whether the engine was checked to serve
    exactly the trainer's weights (engine/fingerprint.py) and how long the parts took. None: not measured."""

    write_s: float | None = None  # vLLM: the weights into the shared-memory file
    load_s: float | None = None  # vLLM: its worker's load from that file
    total_s: float | None = None  # vLLM: the whole sync, wake-up included
    verified: float | None = None  # 1.0: checked and equal; 0.0: not every tensor could be compared
    verify_s: float | None = None
    engine_load_s: float | None = None  # a Ray worker's whole load_weights call, timed by the worker

    def figures(self) -> dict[str, float]:
        """The measured fields by name (the doctor prints them)."""
        return {k: v for k, v in self.__dict__.items() if v is not None}

    def metrics(self) -> dict[str, float]:
        """What a step logs of it: sync/verified, time/sync_verify_s and (Ray workers) time/engine_load_s."""
        out = {} if self.engine_load_s is None else {"time/engine_load_s": self.engine_load_s}
        if self.verified is not None:
            out.update({"sync/verified": self.verified, "time/sync_verify_s": self.verify_s or 0.0})
        return out

    @staticmethod
    def worst(reports: list[SyncReport]) -> SyncReport:
        """One report for several engines' syncs: verified only if every engine was, the slowest times."""

        def pick(name: str, combine):
            values = [getattr(r, name) for r in reports if getattr(r, name) is not None]
            return combine(values) if values else None

        return SyncReport(**{name: pick(name, min if name == "verified" else max)
                             for name in ("write_s", "load_s", "total_s", "verified", "verify_s", "engine_load_s")})


def tool_calls_received(calls) -> int:
    """Parsed tool calls handed to the agent over `calls` (LLMCall records; one response may hold several)."""
    return sum(len((c.reply or {}).get("tool_calls") or []) for c in calls)
