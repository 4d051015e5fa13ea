"""Reward shaping: small judges that each compute one term, and `CombinedJudge`, their weighted sum.

Configured by `astuner.task_judge.combine: [{judge, weight, name, args, success}, ...]`:
    reward     = sum_i  w_i * r_i
    is_success = is_success of the term marked `success: true` (default: the first term)
and each term r_i is logged as the episode metric `reward/<name>` (its mean per step: `train/metrics/reward/<name>`),
so a user sees which term moves.

Terms (L = tokens the episode generated, over all its calls; n = its LLM calls; T = the final text):
    LengthPenalty(target, alpha)     r = -alpha * max(0, L - target)
        with an accuracy term of weight 1 this is the usual  r_acc - alpha * max(0, L - target)
    StepBonus(per_step, max_steps)   r = per_step * min(n, max_steps)       (per_step < 0: a step penalty)
    FormatReward(pattern, value=1)   r = value if re.search(pattern, T) else 0
Accuracy is any correctness judge, e.g. MathAnswerAsJudge (math-verify) or ExactMatchJudge.
T is `metadata["final_answer"]`, else the text of `response` (an AgentScope Msg or a string).
"""

from __future__ import annotations

import inspect
import re
from typing import Any

from astuner.errors import UserError
from astuner.task_judge.base_judge import BaseJudge, FunctionJudge, call_judge
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
    def __init__(self, config: Any = None, target: int = 512, alpha: float = 0.001) -> None:
        super().__init__(config)
        self.target, self.alpha = int(target), float(alpha)

    def compute_reward(self, workflow_task: WorkflowTask, workflow_output: WorkflowOutput):
        return length_penalty(workflow_output.stats.get("response_tokens", 0), self.target, self.alpha), True


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


class CombinedJudge(BaseJudge):
    """The weighted sum of `terms`: [(name, weight, judge, decides_success)] (rules in the module docstring).
    The terms run one after another within the episode's one judge deadline (astuner.task_judge.timeout, set by
    the rollout): they share it, each getting what the terms before it left."""

    def __init__(self, terms: list[tuple[str, float, BaseJudge, bool]], config: Any = None) -> None:
        super().__init__(config)
        if not terms:
            raise UserError("astuner.task_judge.combine is empty; list at least one {judge, weight}")
        names = [t[0] for t in terms]
        if len(set(names)) != len(names):
            raise UserError(f"astuner.task_judge.combine: term names must differ, got {names}; set 'name'")
        self.terms = terms
        deciders = [i for i, t in enumerate(terms) if t[3]]
        if len(deciders) > 1:
            raise UserError("astuner.task_judge.combine: only one term may set success: true")
        self.success_index = deciders[0] if deciders else 0

    async def compute_reward(self, workflow_task: WorkflowTask, workflow_output: WorkflowOutput):
        total, success = 0.0, False
        for i, (name, weight, judge, _) in enumerate(self.terms):
            value, ok = await call_judge(judge.compute_reward, workflow_task, workflow_output)
            workflow_output.metrics[f"reward/{name}"] = float(value)
            total += weight * float(value)
            if i == self.success_index:
                success = bool(ok)
        return total, success


def build_combined_judge(items, cfg, load) -> CombinedJudge:
    """From the `combine` config items; `load(spec)` resolves a "module->Class" / "module->function" string."""
    terms = []
    for index, item in enumerate(items):
        target = load(item.judge, f"astuner.task_judge.combine[{index}].judge")
        if inspect.isfunction(target):
            judge, default_name = FunctionJudge(target, cfg), target.__name__
        else:
            try:
                judge = target(cfg, **dict(item.args))
            except TypeError as exc:
                raise UserError(f"astuner.task_judge.combine[{index}]: {target.__qualname__}(**{dict(item.args)}) "
                                f"failed: {exc}") from None
            default_name = target.__name__
        terms.append((item.name or default_name, float(item.weight), judge, bool(item.success)))
    return CombinedJudge(terms, cfg)
