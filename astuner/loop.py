"""THE training loop. Every backbone calls `run_loop`; a backbone only decides where each stage runs.

    for each step (from the resumed one, if any):
        tasks    = next batch of training tasks
        episodes = stages.rollout(tasks)                 # workflow x num_repeat, judge, madness
                                                         # (filter_groups: drop equal-reward groups, roll out more)
        samples  = episodes_to_samples(episodes)         # one per LLM call, GRPO advantage per episode
        metrics  = stages.train(samples)                 # PPO-clip step(s) on the policy
        stages.sync_weights()                            # the engine samples from the new policy
        log, validate every test_freq, checkpoint (resumable) every save_freq

A backbone that rolls out ahead (trinity) is handed the next `stages.lookahead` batches early; every episode
carries the policy version that generated it, and the step logs its staleness.

A Ray worker lost mid-run (WorkerLost) stops the run; if the trainer still holds the last completed step, that
step is checkpointed first, so a resume continues from it.

Never silently idle: a step whose episodes all failed or timed out stops the run, and so do `max_idle_steps`
steps in a row without a sample that carries a gradient (no episode trained, or every group's rewards equal),
with a message quoting the first error seen.
"""

from __future__ import annotations

import collections
import logging
import math
import random
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterator, Protocol

from astuner.alarms import ToolUseAlarm
from astuner.algorithm.dynamic_sampling import informative_groups, keep_groups
from astuner.algorithm.registry import STD_NORMALISED
from astuner.algorithm.samples import episodes_to_samples, merge_ratio
from astuner.errors import TrainingStalled, WorkerLost
from astuner.evaluation.metrics import ks_for, summarize, task_results
from astuner.types import (
    FLAG_FAILED,
    FLAG_NONSENSE,
    FLAG_OVERFLOW,
    FLAG_TIMEOUT,
    FLAG_WRONG_TOOLCALL,
    Episode,
    Sample,
    Task,
)

log = logging.getLogger(__name__)


class Stages(Protocol):
    def rollout(self, tasks: list[Task], validation: bool, step: int = 0,
                sampled_repeats: int | None = None) -> list[Episode]: ...

    def train(self, samples: list[Sample], objective: str = "policy") -> dict[str, float]: ...

    def sync_weights(self) -> None: ...

    def save_checkpoint(self, step: int, run_state: dict) -> Path: ...

    # Optional, for stages that roll out ahead (the trinity backbone): `lookahead` batches after the current
    # one are handed to `prefetch(step, tasks)` before it is rolled out, and `step_metrics()` adds to a step's
    # log.


class MonitorLike(Protocol):
    def log_metrics(self, step: int, metrics: dict[str, float]) -> None: ...

    def save_episodes(self, step: int, episodes: list[Episode], tag: str,
                      samples: list[Sample] | None = None) -> None: ...

    def step_done(self, step: int, metrics: dict[str, float]) -> None: ...


@dataclass
class LoopSettings:
    train_batch_size: int
    total_epochs: int
    total_training_steps: int | None
    save_freq: int
    test_freq: int
    val_before_train: bool
    shuffle: bool
    seed: int
    adv_estimator: str
    norm_adv_by_std: bool
    adv_epsilon: float
    max_sample_per_task: int
    max_idle_steps: int = 5
    grad_without_advantage: bool = False  # the KL or entropy term gives zero-advantage samples a gradient too
    sample_mode: str = "per_call"
    filter_groups: bool = False
    filter_metric: str = "score"
    max_num_gen_batches: int = 0
    val_num_repeat: int = 1
    algorithm: str = "grpo"  # or "rft": SFT on the calls of episodes with reward >= rft_threshold
    rft_threshold: float = 1.0

    @classmethod
    def from_config(cls, typed) -> "LoopSettings":
        a, tc = typed.astuner, typed.astuner.trainer_common
        std = tc.algorithm.adv_estimator in STD_NORMALISED and tc.algorithm.norm_adv_by_std_in_grpo
        fg = tc.algorithm.filter_groups
        return cls(
            train_batch_size=a.data.train_batch_size,
            total_epochs=tc.total_epochs,
            total_training_steps=tc.total_training_steps,
            save_freq=tc.save_freq,
            test_freq=tc.test_freq,
            val_before_train=tc.val_before_train,
            shuffle=a.data.shuffle,
            seed=a.seed,
            adv_estimator=tc.algorithm.adv_estimator,
            # Read only where they act (the start-up warning names them otherwise).
            norm_adv_by_std=std,
            adv_epsilon=tc.algorithm.epsilon if std else 0.0,
            max_sample_per_task=a.rollout.multi_turn.max_sample_per_task,
            max_idle_steps=tc.max_idle_steps,
            grad_without_advantage=tc.use_kl_loss or tc.entropy_coeff > 0,
            sample_mode=a.rollout.multi_turn.sample_mode,
            filter_groups=fg.enable,
            filter_metric=fg.metric if fg.enable else "score",
            max_num_gen_batches=fg.max_num_gen_batches if fg.enable else 0,
            val_num_repeat=tc.val_num_repeat,
            algorithm=tc.algorithm.type,
            rft_threshold=tc.algorithm.rft_reward_threshold if tc.algorithm.type == "rft" else 1.0,
        )


@dataclass
class ResumeState:
    """Where a run stands after a step; saved with each checkpoint, plain JSON."""

    step: int = 0
    epoch: int = 0  # epoch of the next batch
    position: int = 0  # index of the next task in that epoch's (shuffled) order
    idle_steps: int = 0
    val_scores: dict[str, float] = field(default_factory=dict)
    first_error: str | None = None
    first_error_source: str = "workflow"  # the part that failed: "workflow" or "judge" (see _first_error)


@dataclass
class RunSummary:
    steps: int = 0
    seconds: float = 0.0
    val_scores: dict[int, float] = field(default_factory=dict)  # step -> validation accuracy
    last_checkpoint: Path | None = None

    def line(self, name: str) -> str:
        minutes, seconds = divmod(int(self.seconds), 60)
        text = f"{name}: {self.steps} steps in {minutes}m{seconds:02d}s"
        if self.val_scores:
            first, last = min(self.val_scores), max(self.val_scores)
            start, end = self.val_scores[first], self.val_scores[last]
            text += f"; validation accuracy {start:.3f} (step {first}) -> {end:.3f} (step {last}), {end - start:+.3f}"
        if self.last_checkpoint is not None:
            text += f"; checkpoint {self.last_checkpoint}"
        return text


def count_steps(num_tasks: int, settings: LoopSettings) -> int:
    total = math.ceil(num_tasks / settings.train_batch_size) * settings.total_epochs
    if settings.total_training_steps is not None:
        total = min(total, settings.total_training_steps)
    return total


def task_batches(
    tasks: list[Task], settings: LoopSettings, epoch: int = 0, position: int = 0
) -> Iterator[tuple[list[Task], int, int]]:
    """(batch, epoch, position after it) over epochs of (optionally shuffled) tasks, from (epoch, position).

    Epoch e's order is the e-th shuffle of one seeded generator, so a resumed run sees the same order; the last
    batch of an epoch may be smaller.
    """
    rng = random.Random(settings.seed)
    for e in range(settings.total_epochs):
        order = list(tasks)
        if settings.shuffle:
            rng.shuffle(order)
        if e < epoch:
            continue
        start = position if e == epoch else 0
        for begin in range(start, len(order), settings.train_batch_size):
            end = begin + settings.train_batch_size
            yield order[begin:end], e, min(end, len(order))


def tool_calls_received(calls) -> int:
    """Parsed tool calls handed to the agent (one response may hold several)."""
    return sum(len((c.reply or {}).get("tool_calls") or []) for c in calls)


def parse_failure_rate(calls) -> float:
    """The share of responses that tried a tool call and could not be parsed whole."""
    attempted = [c for c in calls if c.tool_call_attempted]
    return sum(c.tool_call_parse_failed for c in attempted) / len(attempted) if attempted else 0.0


def episode_metrics(episodes: list[Episode], prefix: str) -> dict[str, float]:
    n = max(len(episodes), 1)
    rewards = [e.reward for e in episodes if e.trainable] or [0.0]
    mean = sum(rewards) / len(rewards)
    calls = [c for e in episodes for c in e.calls]
    return {
        f"{prefix}/reward_mean": mean,
        f"{prefix}/reward_std": math.sqrt(sum((r - mean) ** 2 for r in rewards) / len(rewards)),
        f"{prefix}/success_rate": sum(e.is_success for e in episodes) / n,
        f"{prefix}/response_length": sum(len(c.response_ids) for c in calls) / max(len(calls), 1),
        f"{prefix}/turns_per_episode": len(calls) / n,
        # Tool calls the agent received (parsed), per episode, and the share of attempted calls that did not parse.
        f"{prefix}/tool_calls_per_episode": tool_calls_received(calls) / n,
        f"{prefix}/tool_call_parse_failure_rate": parse_failure_rate(calls),
        f"{prefix}/madness_rate": sum(any(f in e.flags for f in (FLAG_NONSENSE, FLAG_WRONG_TOOLCALL)) for e in episodes) / n,
        f"{prefix}/failure_rate": sum(FLAG_FAILED in e.flags or FLAG_TIMEOUT in e.flags for e in episodes) / n,
        f"{prefix}/overflow_rate": sum(FLAG_OVERFLOW in e.flags for e in episodes) / n,
        f"{prefix}/generated_tokens": float(sum(len(c.response_ids) for c in calls)),
        **_mean_episode_metrics(episodes, prefix),
    }


def _mean_episode_metrics(episodes: list[Episode], prefix: str) -> dict[str, float]:
    """Each metric a workflow or judge reported (e.g. a reward term), averaged over the episodes reporting it."""
    values: dict[str, list[float]] = {}
    for e in episodes:
        for name, value in e.metrics.items():
            values.setdefault(name, []).append(value)
    return {f"{prefix}/metrics/{name}": sum(v) / len(v) for name, v in sorted(values.items())}


# Past these, a step's log carries a warning: the token pipeline is probably broken (see rollout.preflight).
PIPELINE_WARN = {
    "rollout/tool_call_parse_failure_rate": 0.2,
    "rollout/logprob_abs_diff_mean": 0.05,
}


def pipeline_metrics(episodes: list[Episode], train_metrics: dict[str, float]) -> dict[str, float]:
    """Token-pipeline health: parse failures among calls that tried a tool call, calls whose prompt extended an
    earlier call token-exactly, the share `merge` joins, model and tool calls per episode, engine-trainer
    logprob gap, and per-agent counts."""
    calls = [c for e in episodes for c in e.calls]
    out = {
        "rollout/tool_call_parse_failure_rate": parse_failure_rate(calls),
        "rollout/prefix_reuse_rate": sum(c.extends_previous for c in calls) / max(len(calls), 1),
        "rollout/merge_ratio": merge_ratio(episodes),
        "rollout/calls_per_episode": len(calls) / max(len(episodes), 1),
        "rollout/tool_call_rate": tool_calls_received(calls) / max(len(episodes), 1),
    }
    for name in ("logprob_abs_diff_mean", "logprob_abs_diff_max", "kl_engine_trainer_k3"):
        if name in train_metrics:
            out[f"rollout/{name}"] = train_metrics[name]
    agents = sorted({c.agent for c in calls if c.agent})
    for agent in agents:
        mine = [c for c in calls if c.agent == agent]
        out[f"agent/{agent}/calls_per_episode"] = len(mine) / max(len(episodes), 1)
        out[f"agent/{agent}/response_length"] = sum(len(c.response_ids) for c in mine) / len(mine)
    return out


def staleness_metrics(episodes: list[Episode], step: int) -> dict[str, float]:
    """Trainer steps between the weights that generated a step's episodes and the weights they train:
    (step - 1) - policy_version; 0 everywhere for the debug and verl backbones."""
    stale = [(step - 1) - e.policy_version for e in episodes] or [0]
    return {"rollout/staleness_mean": sum(stale) / len(stale), "rollout/staleness_max": float(max(stale)),
            "rollout/policy_version_min": float(min(e.policy_version for e in episodes) if episodes else 0)}


def warn_pipeline(step: int, metrics: dict[str, float]) -> None:
    for name, limit in PIPELINE_WARN.items():
        if name.startswith("rollout/logprob") and metrics.get("rollout/staleness_max", 0) > 0:
            continue  # stale samples: the gap includes the policy's own change (the trinity backbone corrects it)
        value = metrics.get(name)
        if value is not None and value > limit:
            log.warning("step %d: %s = %.3g is above %.3g: the token pipeline may be broken (a tool-call parser "
                        "that does not match the model's format, or engine and trainer disagreeing); see the "
                        "preflight table at start and rollout.tool_call_parser", step, name, value, limit)


def zero_adv_group_fraction(episodes: list[Episode]) -> float:
    """Share of task groups (trainable episodes of one task) whose rewards are all equal: GRPO learns nothing
    from them. A group with one trainable episode counts as equal; a group with none is not counted."""
    groups: dict[str, set[float]] = {}
    for e in episodes:
        if e.trainable:
            groups.setdefault(e.group_id, set()).add(e.reward)
    if not groups:
        return 1.0
    return sum(len(r) == 1 for r in groups.values()) / len(groups)


def _first_error(episodes: list[Episode]) -> tuple[str, str] | None:
    """(where, what) of the first failed episode: the part that failed ("workflow" or "judge") and a line
    quoting its error."""
    for e in episodes:
        if e.error:
            lines = e.error.strip().splitlines()
            what = e.error_summary or (lines[-1] if lines else e.error)
            return e.error_source or "workflow", f"episode {e.episode_uid}: {what}"
    return None


FIX_ADVICE = {
    "workflow": "Fix the workflow (run with --backbone debug and a breakpoint in it), or raise "
                "astuner.rollout.episode_timeout if the episodes are just slow.",
    "judge": "Fix the judge (astuner.task_judge.judge_protocol; run with --backbone debug and a breakpoint in "
             "compute_reward), or raise astuner.task_judge.timeout if it is just slow.",
}


def run_loop(
    settings: LoopSettings,
    stages: Stages,
    train_tasks: list[Task],
    val_tasks: list[Task],
    monitor: MonitorLike,
    resume: ResumeState | None = None,
) -> RunSummary:
    state = resume or ResumeState()
    summary = RunSummary(steps=state.step, val_scores={int(k): v for k, v in state.val_scores.items()})
    total_steps = count_steps(len(train_tasks), settings)
    started = time.perf_counter()

    def validate(step: int) -> None:
        if not val_tasks:
            return
        t0 = time.perf_counter()
        episodes = stages.rollout(val_tasks, validation=True, step=step)
        metrics = episode_metrics(episodes, "val")
        metrics["val/accuracy"] = metrics["val/success_rate"]
        if settings.val_num_repeat > 1:
            sampled = stages.rollout(val_tasks, validation=True, step=step, sampled_repeats=settings.val_num_repeat)
            ks = ks_for(settings.val_num_repeat)
            report = summarize(task_results(episodes, sampled, ks), sampled, ks)
            metrics.update({f"val/{k.removeprefix('sampled/')}": v for k, v in report.items()
                            if k.startswith("sampled/")})
            episodes = episodes + sampled
        metrics["time/validation_s"] = time.perf_counter() - t0
        summary.val_scores[step] = metrics["val/accuracy"]
        state.val_scores[str(step)] = metrics["val/accuracy"]
        monitor.log_metrics(step, metrics)
        monitor.save_episodes(step, episodes, "val")
        log.info("step %d validation accuracy %.3f over %d tasks", step, metrics["val/accuracy"], len(val_tasks))

    if settings.val_before_train and state.step == 0:
        validate(0)

    batches = _Peekable(task_batches(train_tasks, settings, state.epoch, state.position))
    saved = {"step": state.step}  # the last step with a checkpoint (or the resumed one)
    try:
        _run_steps(settings, stages, monitor, state, summary, batches, total_steps, validate, saved)
    except WorkerLost as exc:
        # Checkpoint the last completed step if the trainer still holds exactly it, so a resume continues there.
        if exc.trainer_ok and state.step > saved["step"] and not exc.trained_past_state:
            log.error("%s", exc)
            try:
                summary.last_checkpoint = stages.save_checkpoint(state.step, asdict(state))
                log.error("saved the last completed step as %s before stopping", summary.last_checkpoint)
            except Exception as save_exc:  # the trainer went too: the previous checkpoint stays the last one
                log.error("could not save step %d as well (%s)", state.step, save_exc)
        raise

    summary.seconds = time.perf_counter() - started
    return summary


class _Peekable:
    """An iterator whose next items can be looked at without taking them."""

    def __init__(self, it) -> None:
        self._it, self._ahead = it, collections.deque()

    def __iter__(self):
        return self

    def __next__(self):
        return self._ahead.popleft() if self._ahead else next(self._it)

    def peek(self, n: int) -> list:
        while len(self._ahead) < n:
            try:
                self._ahead.append(next(self._it))
            except StopIteration:
                break
        return list(self._ahead)[:n]


def _run_steps(settings, stages, monitor, state, summary, batches, total_steps, validate, saved: dict) -> None:
    tool_alarm = ToolUseAlarm()
    for step, (tasks, epoch, position) in enumerate(batches, start=state.step + 1):
        if step > total_steps:
            break
        for i, (upcoming, _, _) in enumerate(batches.peek(getattr(stages, "lookahead", 0)), start=1):
            if step + i <= total_steps:
                stages.prefetch(step + i, upcoming)
        t0 = time.perf_counter()
        episodes = stages.rollout(tasks, validation=False, step=step)
        trained = episodes
        if settings.filter_groups:
            trained, episodes, epoch, position, fill = fill_with_informative_groups(
                episodes, tasks, batches, stages, settings, step, epoch, position)
        t1 = time.perf_counter()
        if state.first_error is None and (found := _first_error(episodes)):
            state.first_error_source, state.first_error = found
        if not any(e.trainable for e in episodes):
            raise TrainingStalled(
                f"step {step}: all {len(episodes)} episodes failed or timed out, so there is nothing to train on. "
                f"First error: {state.first_error or 'none recorded'}. "
                f"{FIX_ADVICE.get(state.first_error_source, FIX_ADVICE['workflow'])}")
        rft = settings.algorithm == "rft"
        if rft:  # rejection sampling: only episodes that pass the threshold, learnt by SFT on their exact ids
            trained = [e for e in episodes if e.trainable and e.reward >= settings.rft_threshold]
        samples = episodes_to_samples(
            trained,
            adv_estimator=settings.adv_estimator,
            norm_by_std=settings.norm_adv_by_std,
            epsilon=settings.adv_epsilon,
            max_sample_per_task=settings.max_sample_per_task,
            sample_mode=settings.sample_mode,
            constant_advantage=1.0 if rft else None,
        )
        if not samples:
            train_metrics = {}
        else:
            train_metrics = stages.train(samples, objective="sft") if rft else stages.train(samples)
        t2 = time.perf_counter()
        try:
            stages.sync_weights()
        except WorkerLost as exc:
            exc.trained_past_state = True  # the trainer holds step `step`; `state` still says step - 1
            raise
        t3 = time.perf_counter()

        metrics = episode_metrics(episodes, "train")
        metrics.update({f"actor/{k}": v for k, v in train_metrics.items()})
        metrics.update(pipeline_metrics(episodes, train_metrics))
        metrics.update(staleness_metrics(episodes, step))
        warn_pipeline(step, metrics)
        for warning in tool_alarm.observe(step, episodes, metrics.get("train/reward_mean", 0.0)):
            log.warning(warning)
        zero_frac = zero_adv_group_fraction(episodes)
        metrics.update({
            "time/rollout_s": t1 - t0,
            "time/train_s": t2 - t1,
            "time/sync_s": t3 - t2,
            "perf/rollout_tokens_per_s": metrics["train/generated_tokens"] / max(t1 - t0, 1e-9),
            "train/num_samples": float(len(samples)),
            "train/zero_adv_group_fraction": zero_frac,
        })
        if hasattr(stages, "step_metrics"):
            metrics.update(stages.step_metrics())
        if settings.filter_groups:
            metrics.update({f"train/dynamic_sampling/{k}": float(v) for k, v in fill.items()})
        if rft:
            metrics["train/rft_kept_episode_fraction"] = len(trained) / max(len(episodes), 1)
        monitor.log_metrics(step, metrics)
        monitor.save_episodes(step, episodes, "train", samples)
        summary.steps = step
        state.step, state.epoch, state.position = step, epoch, position
        _check_idle(state, settings, samples, zero_frac, step)

        if step % settings.test_freq == 0 or step == total_steps:
            validate(step)
        if step % settings.save_freq == 0 or step == total_steps:
            summary.last_checkpoint = stages.save_checkpoint(step, asdict(state))
            saved["step"] = step
        monitor.step_done(step, metrics)


def fill_with_informative_groups(episodes, tasks, batches, stages, settings, step, epoch, position):
    """DAPO dynamic sampling (algorithm/dynamic_sampling.py): roll out further batches of `batches` until
    `train_batch_size` groups carry a signal, or `max_num_gen_batches` batches were rolled out, or the data ends.

    Returns (episodes to train on, every episode rolled out, epoch and position after the last batch used,
    counts for the log). Tasks already in this step (a batch that crosses an epoch) are skipped."""
    want = settings.train_batch_size
    kept = informative_groups(episodes, settings.filter_metric)
    generated, seen = 1, {t.task_id for t in tasks}
    while len(kept) < want and (settings.max_num_gen_batches == 0 or generated < settings.max_num_gen_batches):
        try:
            more, epoch, position = next(batches)
        except StopIteration:
            break
        more = [t for t in more if t.task_id not in seen]
        seen.update(t.task_id for t in more)
        if not more:
            continue
        extra = stages.rollout(more, validation=False, step=step)
        generated += 1
        episodes = episodes + extra
        kept += informative_groups(extra, settings.filter_metric)
    if len(kept) < want:
        log.warning("step %d: dynamic sampling found %d of %d groups with differing rewards in %d rollout batches "
                    "(cap filter_groups.max_num_gen_batches = %d, or the data ran out); training on those",
                    step, len(kept), want, generated, settings.max_num_gen_batches)
    kept = kept[:want]
    groups = len({e.group_id for e in episodes})
    counts = {"gen_batches": generated, "kept_groups": len(kept), "dropped_groups": groups - len(kept)}
    return keep_groups(episodes, kept), episodes, epoch, position, counts


def _check_idle(state: ResumeState, settings: LoopSettings, samples: list[Sample], zero_frac: float, step: int) -> None:
    learning = any(s.advantage != 0.0 for s in samples) or (settings.grad_without_advantage and bool(samples))
    if learning:
        state.idle_steps = 0
        return
    state.idle_steps += 1
    why = (
        f"no episode reached algorithm.rft_reward_threshold = {settings.rft_threshold:g}"
        if settings.algorithm == "rft" else
        "every task's episodes got the same reward (train/zero_adv_group_fraction = 1.0), so every GRPO advantage "
        "is 0" if zero_frac == 1.0 else "no episode produced a trainable sample"
    )
    log.warning("step %d trained on nothing: %s (%d of %d idle steps allowed in a row)", step, why,
                state.idle_steps, settings.max_idle_steps)
    if state.idle_steps >= settings.max_idle_steps:
        raise TrainingStalled(
            f"stopped after {state.idle_steps} steps in a row without a learning signal (step {step}): {why}. "
            f"First error: {state.first_error or 'none'}. Check the judge's rewards in the trajectories folder; "
            "the task may be too hard (all 0) or too easy (all 1) for this model, or raise "
            "astuner.trainer_common.max_idle_steps."
        )
