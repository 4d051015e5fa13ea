"""The metrics of a step and of a validation, assembled from what the stages returned; the warnings they raise.

    train/*      episodes rolled out this step (reward, success, lengths, tool use, madness, failures)
    actor/*      the trainer's own metrics (loss, clip fractions, grad norm, lr, ...); in a run of several models
                 (astuner.models) each model's as model/<name>/actor/*
    rollout/*    token-pipeline health and staleness (parse failures, prefix reuse, merge ratio, logprob gap)
    env/*        environments that failed (an attempt raised or timed out) and attempts run again
    time/*, perf/*  stage durations and rates
    val/*        validation: greedy accuracy, and pass@k when val_num_repeat > 1
"""

from __future__ import annotations

import logging
import math

from astuner.alarms import ToolUseAlarm
from astuner.algorithm.samples import merge_ratio
from astuner.algorithm.pass_at_k import ks_for, summarize, task_results
from astuner.cuts import context_metrics, cut_metrics
from astuner.environments.failures import env_metrics
from astuner.types import (
    FLAG_FAILED,
    FLAG_NONSENSE,
    FLAG_OVERFLOW,
    FLAG_TIMEOUT,
    FLAG_WRONG_TOOLCALL,
    Episode,
    Sample,
    tool_calls_received,
)

log = logging.getLogger(__name__)


def parse_failure_rate(calls) -> float:
    """The share of responses that tried a tool call and could not be parsed whole."""
    attempted = [c for c in calls if c.tool_call_attempted]
    return sum(c.tool_call_parse_failed for c in attempted) / len(attempted) if attempted else 0.0


def episode_metrics(episodes: list[Episode], prefix: str) -> dict[str, float]:
    n = max(len(episodes), 1)
    # Every episode with a reward of its own: cut ones left out of training (rollout.on_cut) count.
    rewards = [e.reward for e in episodes if e.calls and not {FLAG_FAILED, FLAG_TIMEOUT} & set(e.flags)] or [0.0]
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
        f"{prefix}/madness_rate":
            sum(any(f in e.flags for f in (FLAG_NONSENSE, FLAG_WRONG_TOOLCALL)) for e in episodes) / n,
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


def void_note(episodes: list[Episode]) -> str | None:
    """Why a set of episodes measures nothing: more than half of them failed or timed out (an accuracy over them
    would be a score of 0 for a model that was never measured), e.g. "32 of 32 timed out (episode timed out after
    600s; astuner.rollout.episode_timeout)". None when at least half ended normally."""
    n = len(episodes)
    timed = [e for e in episodes if FLAG_TIMEOUT in e.flags]
    failed = [e for e in episodes if FLAG_FAILED in e.flags and FLAG_TIMEOUT not in e.flags]
    if not n or 2 * (len(timed) + len(failed)) <= n:
        return None
    parts = []
    if timed:
        parts.append(f"{len(timed)} of {n} timed out ({timed[0].error_summary or 'episode timed out'}; "
                     "astuner.rollout.episode_timeout)")
    if failed:
        first = failed[0]
        parts.append(f"{len(failed)} of {n} failed (the first: {first.error_summary or 'no message'}, in the "
                     f"{first.error_source or 'workflow'})")
    return "; ".join(parts)


def validation_metrics(greedy: list[Episode], sampled: list[Episode], repeats: int) -> dict[str, float]:
    """`val/*` of the greedy episodes; `val/accuracy` is their success rate. With `repeats` > 1, pass@k for
    k in ks_for(repeats) over the sampled episodes (unbiased estimator, algorithm/pass_at_k.py). A void validation
    (`void_note`: most episodes failed or timed out) has `val/void` 1 and no accuracy: it measured nothing."""
    metrics = {**episode_metrics(greedy, "val"), **cut_metrics(greedy, "val"), **context_metrics(greedy, "val"),
               **env_metrics(greedy, "val/env")}
    if void_note(greedy):
        metrics["val/void"] = 1.0
        return metrics
    metrics["val/accuracy"] = metrics["val/success_rate"]
    if repeats > 1:
        ks = ks_for(repeats)
        report = summarize(task_results(greedy, sampled, ks), sampled, ks)
        metrics.update({f"val/{k.removeprefix('sampled/')}": v for k, v in report.items() if k.startswith("sampled/")})
    return metrics


# Past these, a step's log carries a warning: the token pipeline is probably broken (see rollout.preflight).
PIPELINE_WARN = {
    "rollout/tool_call_parse_failure_rate": 0.2,
    "rollout/logprob_abs_diff_mean": 0.05,
}


def pipeline_metrics(episodes: list[Episode], train_metrics: dict[str, float]) -> dict[str, float]:
    """Token-pipeline health: parse failures among calls that tried a tool call, calls whose prompt extended an
    earlier call token-exactly, the share `merge` joins, model and tool calls per episode, tool calls missing a
    required argument, engine-trainer logprob gap, and per-agent counts."""
    calls = [c for e in episodes for c in e.calls]
    out = {
        "rollout/tool_call_parse_failure_rate": parse_failure_rate(calls),
        "rollout/prefix_reuse_rate": sum(c.extends_previous for c in calls) / max(len(calls), 1),
        "rollout/merge_ratio": merge_ratio(episodes),
        "rollout/calls_per_episode": len(calls) / max(len(episodes), 1),
        "rollout/tool_call_rate": tool_calls_received(calls) / max(len(episodes), 1),
        # Threads stuck in blocking calls of ended episodes, still running (the most any rollout process had).
        "rollout/abandoned_threads": float(max((e.abandoned_threads for e in episodes), default=0)),
        # Parsed tool calls lacking a required argument of the offered schema, of all parsed tool calls.
        "rollout/tool_call_missing_args_rate":
            sum(len(c.missing_tool_arguments) for c in calls) / max(tool_calls_received(calls), 1),
    }
    # The gap, also by context depth and how many deep bins drift (algorithm/mismatch.py); with several models
    # (their metrics named model/<name>/...) the worst model's.
    out.update(worst_gap(train_metrics))
    # Every cut by its limit, and what the context policy did instead (astuner/cuts.py).
    out.update({**cut_metrics(episodes, "rollout"), **context_metrics(episodes, "rollout")})
    out.update(env_metrics(episodes))  # env/failed, env/retried (astuner/environments/failures.py)
    agents = sorted({c.agent for c in calls if c.agent})
    for agent in agents:
        mine = [c for c in calls if c.agent == agent]
        out[f"agent/{agent}/calls_per_episode"] = len(mine) / max(len(episodes), 1)
        out[f"agent/{agent}/response_length"] = sum(len(c.response_ids) for c in mine) / len(mine)
        out[f"agent/{agent}/tool_calls_per_episode"] = tool_calls_received(mine) / max(len(episodes), 1)
    return out


def worst_gap(train_metrics: dict[str, float]) -> dict[str, float]:
    """rollout/<gap> for each engine-trainer gap figure of the trainer's metrics (logprob_abs_diff_mean/max,
    kl_engine_trainer_k3, the depth bins logprob_abs_diff/*), the largest over models (model/<name>/<gap>)."""
    out: dict[str, float] = {}
    for key, value in train_metrics.items():
        name = key.split("/", 2)[2] if key.startswith("model/") else key
        if name in ("logprob_abs_diff_mean", "logprob_abs_diff_max", "kl_engine_trainer_k3") or name.startswith(
                "logprob_abs_diff/"):
            out[f"rollout/{name}"] = max(out.get(f"rollout/{name}", value), value)
    return out


def actor_key(name: str) -> str:
    """The log name of a trainer metric: actor/<name>, or model/<model>/actor/<name> in a run of several models
    (astuner.models; the stages name each model's model/<model>/<name>: backbone/local_models.py)."""
    if name.startswith("model/"):
        _, model, rest = name.split("/", 2)
        return f"model/{model}/actor/{rest}"
    return f"actor/{name}"


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
    if metrics.get("rollout/logprob_abs_diff/depth_alarm", 0) > 0 and not metrics.get("rollout/staleness_max", 0):
        gaps = ", ".join(f"{k.rsplit('_', 1)[-1]} {v:.3g}" for k, v in metrics.items()
                         if k.startswith("rollout/logprob_abs_diff/depth_") and not k.endswith("alarm"))
        log.warning("step %d: engine and trainer logprobs drift apart with context depth (mean |gap| by position: "
                    "%s): a numeric defect that grows with position, such as RoPE buffers or a KV cache in a coarser "
                    "dtype than the trainer's; rollout/logprob_abs_diff/depth_* hold the bins", step, gaps)


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


class StepMetrics:
    """Assembles one training step's log and raises its warnings (pipeline thresholds, tool-use alarms)."""

    def __init__(self) -> None:
        self.tool_alarm = ToolUseAlarm()

    def of_step(self, step: int, episodes: list[Episode], samples: list[Sample], train_metrics: dict[str, float],
                seconds: dict[str, float], extra: dict[str, float]) -> dict[str, float]:
        """`seconds`: rollout/train/sync durations; `extra`: the stages' and the sample selection's figures."""
        metrics = episode_metrics(episodes, "train")
        metrics.update({actor_key(k): v for k, v in train_metrics.items()})
        metrics.update(pipeline_metrics(episodes, train_metrics))
        metrics.update(staleness_metrics(episodes, step))
        warn_pipeline(step, metrics)
        for warning in self.tool_alarm.observe(step, episodes, metrics.get("train/reward_mean", 0.0)):
            log.warning(warning)
        metrics.update({f"time/{name}_s": s for name, s in seconds.items()})
        metrics.update({
            "perf/rollout_tokens_per_s": metrics["train/generated_tokens"] / max(seconds["rollout"], 1e-9),
            "train/num_samples": float(len(samples)),
            "train/zero_adv_group_fraction": zero_adv_group_fraction(episodes),
        })
        metrics.update(extra)
        return metrics

    def standing_warnings(self) -> list[str]:
        """Warnings that still hold at the last step (tools never used), for the run's summary."""
        return [w for w in (self.tool_alarm.standing(),) if w]
