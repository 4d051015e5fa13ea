"""The evaluation math, pure Python: `astuner eval` (evaluation/runner.py) and validation during training.

Unbiased pass@k (Chen et al. 2021, "Evaluating Large Language Models Trained on Code"): with n sampled episodes
of a task of which c succeeded, the chance that at least one of k drawn without replacement succeeds is

    pass@k = 1 - C(n - c, k) / C(n, k)  =  1 - prod_{i = n - c + 1}^{n} (1 - k / i)      (1 if n - c < k)

averaged over tasks. pass@1 = c / n.

Difference of two models on the same tasks: per task d_i = y_i - x_i (paired), reported as the mean of d with a
95% percentile bootstrap interval (resampling tasks with replacement, 2,000 times, seeded): no normality
assumption, which matters for 0/1 outcomes on a few dozen tasks.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Sequence

from astuner.types import FLAG_FAILED, FLAG_OVERFLOW, FLAG_TIMEOUT, Episode, tool_calls_received


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one task (formula in the module docstring)."""
    if not 0 <= c <= n or k < 1:
        raise ValueError(f"pass_at_k needs 0 <= c <= n and k >= 1, got n={n}, c={c}, k={k}")
    if k > n:
        raise ValueError(f"pass@{k} needs at least {k} samples per task, got {n}")
    if n - c < k:
        return 1.0
    prob_all_fail = 1.0
    for i in range(n - c + 1, n + 1):
        prob_all_fail *= 1.0 - k / i
    return 1.0 - prob_all_fail


def ks_for(n: int) -> list[int]:
    """The k reported for n samples per task: 1, 2, 4, ... up to n, and n itself."""
    ks, k = [], 1
    while k <= n:
        ks.append(k)
        k *= 2
    if ks[-1] != n:
        ks.append(n)
    return ks


def paired_difference(x: Sequence[float], y: Sequence[float], resamples: int = 2000, seed: int = 0,
                      level: float = 0.95) -> tuple[float, float, float]:
    """(mean of y_i - x_i, low, high): the paired difference and its bootstrap interval (module docstring)."""
    if len(x) != len(y):
        raise ValueError(f"paired difference needs the same tasks: {len(x)} vs {len(y)} values")
    if not x:
        return 0.0, 0.0, 0.0
    d = [b - a for a, b in zip(x, y)]
    n = len(d)
    mean = sum(d) / n
    rng = random.Random(seed)
    means = sorted(sum(d[rng.randrange(n)] for _ in range(n)) / n for _ in range(resamples))
    tail = (1.0 - level) / 2
    low = means[int(tail * (resamples - 1))]
    high = means[int(round((1.0 - tail) * (resamples - 1)))]
    return mean, low, high


@dataclass
class TaskResult:
    task_id: str
    greedy_reward: float
    greedy_success: bool
    samples: int = 0
    successes: int = 0
    sampled_reward_mean: float = 0.0
    tokens_per_episode: float = 0.0
    pass_at: dict[int, float] = field(default_factory=dict)


def task_results(greedy: list[Episode], sampled: list[Episode], ks: list[int]) -> list[TaskResult]:
    """One TaskResult per task, in the order of the greedy episodes."""
    by_task: dict[str, list[Episode]] = {}
    for e in sampled:
        by_task.setdefault(e.task.task_id, []).append(e)
    out = []
    for g in greedy:
        mine = by_task.get(g.task.task_id, [])
        n, c = len(mine), sum(bool(e.is_success) for e in mine)
        every = [g, *mine]
        out.append(TaskResult(
            task_id=g.task.task_id, greedy_reward=float(g.reward), greedy_success=bool(g.is_success), samples=n,
            successes=c, sampled_reward_mean=sum(float(e.reward) for e in mine) / n if n else 0.0,
            tokens_per_episode=sum(len(x.response_ids) for e in every for x in e.calls) / len(every),
            pass_at={k: pass_at_k(n, c, k) for k in ks if n >= k},
        ))
    return out


def summarize(results: list[TaskResult], episodes: list[Episode], ks: list[int]) -> dict[str, float]:
    n_tasks, n_eps = max(len(results), 1), max(len(episodes), 1)
    out = {
        "tasks": float(len(results)),
        "greedy/reward_mean": sum(r.greedy_reward for r in results) / n_tasks,
        "greedy/success_rate": sum(r.greedy_success for r in results) / n_tasks,
        "tokens_per_episode": sum(len(c.response_ids) for e in episodes for c in e.calls) / n_eps,
        "failure_rate": sum(FLAG_FAILED in e.flags or FLAG_TIMEOUT in e.flags for e in episodes) / n_eps,
        "overflow_rate": sum(FLAG_OVERFLOW in e.flags for e in episodes) / n_eps,
        # Tool use: parsed calls handed to the agent per episode, and the share of episodes with at least one.
        "tool_calls_per_episode": sum(tool_calls_received(e.calls) for e in episodes) / n_eps,
        "episodes_with_a_tool_call": sum(tool_calls_received(e.calls) > 0 for e in episodes) / n_eps,
    }
    if any(r.samples for r in results):
        out["sampled/reward_mean"] = sum(r.sampled_reward_mean for r in results) / n_tasks
        for k in ks:
            out[f"sampled/pass@{k}"] = sum(r.pass_at.get(k, 0.0) for r in results) / n_tasks
    return out
