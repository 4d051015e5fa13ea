"""Reward shaping: small judges that each compute one term, and `CombinedJudge`, their weighted sum.

Configured by `astuner.task_judge.combine: [{judge, weight, name, args, success, if_success}, ...]`:
    reward     = sum_i  w_i * c_i * r_i,   c_i = is_success if the term sets `if_success: true`, else 1
    is_success = is_success of the term marked `success: true` (default: the first term)
and each term as counted, c_i * r_i, is logged as the episode metric `reward/<name>` (its mean per step:
`train/metrics/reward/<name>`), so a user sees which term moves. `if_success` makes a shape a tie-breaker among
right answers (as Kimi k1.5's length reward is for correct ones): a wrong answer is not pushed to be shorter. For
that, its largest value, alpha * (the most tokens an episode can have - target), must stay below the gap between a
success's reward and the best failure's (else a long right answer scores under a half-right one).

Terms (L = tokens the episode generated, over all its calls; n = its LLM calls; T = the final text;
S = tokens of the summaries rollout.context_policy=summarize had the policy write, all its summary calls together):
    LengthPenalty(target, alpha)     r = -alpha * max(0, L - target)
        with an accuracy term of weight 1 this is the usual  r_acc - alpha * max(0, L - target)
    SummaryLengthPenalty(target, alpha)  r = -alpha * max(0, S - target)    (0 for an episode without a summary)
    StepBonus(per_step, max_steps)   r = per_step * min(n, max_steps)       (per_step < 0: a step penalty)
    FormatReward(pattern, value=1)   r = value if re.search(pattern, T) else 0
Accuracy is any correctness judge, e.g. MathAnswerAsJudge (math-verify) or ExactMatchJudge.
T is `metadata["final_answer"]`, else the text of `response` (an AgentScope Msg or a string).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from astuner.errors import UserError
from astuner.task_judge.base_judge import BaseJudge, call_judge
from astuner.workflow import WorkflowOutput, WorkflowTask


def length_penalty(length: int, target: int, alpha: float) -> float:
    return -alpha * max(0, length - target)


def step_bonus(calls: int, per_step: float, max_steps: int) -> float:
    return per_step * min(calls, max_steps)


def format_reward(text: str, pattern: str, value: float = 1.0) -> float:
    return value if re.search(pattern, text or "") else 0.0


def final_text(output: WorkflowOutput) -> str:
    answer = (output.metadata or {}).get("final_answer")
    if answer is not None:
        return str(answer)
    response = output.response
    if hasattr(response, "get_text_content"):
        return response.get_text_content() or ""
    return "" if response is None else str(response)


class LengthPenalty(BaseJudge):
    counted = "response_tokens"  # the WorkflowOutput.stats entry it charges

    def __init__(self, config: Any = None, target: int = 512, alpha: float = 0.001) -> None:
        super().__init__(config)
        self.target, self.alpha = int(target), float(alpha)

    def compute_reward(self, workflow_task: WorkflowTask, workflow_output: WorkflowOutput):
        return length_penalty(workflow_output.stats.get(self.counted, 0), self.target, self.alpha), True


class SummaryLengthPenalty(LengthPenalty):
    """LengthPenalty on the summaries alone; with `if_success: true`, among right answers the shorter summary wins."""

    counted = "summary_tokens"

    def __init__(self, config: Any = None, target: int = 64, alpha: float = 0.002) -> None:
        super().__init__(config, target, alpha)


class StepBonus(BaseJudge):
    def __init__(self, config: Any = None, per_step: float = 0.1, max_steps: int = 5) -> None:
        super().__init__(config)
        self.per_step, self.max_steps = float(per_step), int(max_steps)

    def compute_reward(self, workflow_task: WorkflowTask, workflow_output: WorkflowOutput):
        return step_bonus(workflow_output.stats.get("calls", 0), self.per_step, self.max_steps), True


class FormatReward(BaseJudge):
    def __init__(self, config: Any = None, pattern: str = r"\\boxed\{.+\}", value: float = 1.0) -> None:
        super().__init__(config)
        try:
            re.compile(pattern)
        except re.error as exc:
            raise UserError(f"FormatReward: pattern {pattern!r} is not a valid regular expression ({exc})") from None
        self.pattern, self.value = pattern, float(value)

    def compute_reward(self, workflow_task: WorkflowTask, workflow_output: WorkflowOutput):
        value = format_reward(final_text(workflow_output), self.pattern, self.value)
        return value, value > 0


@dataclass(frozen=True)
class Term:
    """One term of CombinedJudge: its metric name, weight and judge; whether it decides success, and whether it
    counts only in an episode that succeeded."""

    name: str
    weight: float
    judge: BaseJudge
    success: bool = False
    if_success: bool = False


class CombinedJudge(BaseJudge):
    """The weighted sum of `terms` (Terms, or tuples of their fields; rules in the module docstring).
    The terms run one after another within the episode's one judge deadline (astuner.task_judge.timeout, set by
    the rollout): they share it, each getting what the terms before it left."""

    def __init__(self, terms: list, config: Any = None) -> None:
        super().__init__(config)
        if not terms:
            raise UserError("astuner.task_judge.combine is empty; list at least one {judge, weight}")
        self.terms = [t if isinstance(t, Term) else Term(*t) for t in terms]
        names = [t.name for t in self.terms]
        if len(set(names)) != len(names):
            raise UserError(f"astuner.task_judge.combine: term names must differ, got {names}; set 'name'")
        deciders = [i for i, t in enumerate(self.terms) if t.success]
        if len(deciders) > 1:
            raise UserError("astuner.task_judge.combine: only one term may set success: true")
        self.success_index = deciders[0] if deciders else 0
        if self.terms[self.success_index].if_success:
            raise UserError("astuner.task_judge.combine: the term that decides success cannot set if_success")

    async def compute_reward(self, workflow_task: WorkflowTask, workflow_output: WorkflowOutput):
        values, success = [], False
        for i, term in enumerate(self.terms):
            value, ok = await call_judge(term.judge.compute_reward, workflow_task, workflow_output)
            values.append(float(value))
            if i == self.success_index:
                success = bool(ok)
        total = 0.0
        for term, value in zip(self.terms, values):
            counted = value if success or not term.if_success else 0.0
            workflow_output.metrics[f"reward/{term.name}"] = counted
            total += term.weight * counted
        return total, success


def build_combined_judge(items, cfg, judge) -> CombinedJudge:
    """From the `combine` config items; `judge(spec, key, args)` builds one term's judge from its "module->Class" /
    "module->function" string and gives its default name (task_judge/loading.py)."""
    terms = []
    for index, item in enumerate(items):
        built, default_name = judge(item.judge, f"astuner.task_judge.combine[{index}].judge", dict(item.args))
        terms.append(Term(item.name or default_name, float(item.weight), built, bool(item.success),
                          bool(item.if_success)))
    return CombinedJudge(terms, cfg)
