"""The judge interface, and the lookups the built-in judges share.

A judge scores an episode when the workflow returned `reward=None`. It is named in the config by
`astuner.task_judge.judge_protocol: "pkg.module->Class"` and built once per run as `Class(config)`.
The rollout may call `compute_reward` from worker threads, so a judge must not rely on signals.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from astuner.errors import UserError
from astuner.workflow import WorkflowOutput, WorkflowTask

# Where the built-in judges look for the ground truth in `Task.metadata`, first present wins.
GROUND_TRUTH_KEYS = ("answer", "ground_truth", "solution")
# Where they look for the prediction in `WorkflowOutput.metadata`.
FINAL_ANSWER_KEY = "final_answer"


class BaseJudge(ABC):
    """Subclass and implement `compute_reward`. `config` is the whole run config (None in some tests)."""

    def __init__(self, config: Any = None) -> None:
        self.config = config

    @abstractmethod
    def compute_reward(self, workflow_task: WorkflowTask, workflow_output: WorkflowOutput) -> tuple[float, bool]:
        """Return (reward, is_success) for one episode."""


class FunctionJudge(BaseJudge):
    """A judge written as `async def judge(task: dict, response, auxiliary_models) -> JudgeOutput` (or a plain
    def, run in a worker thread); `response` is the workflow's `WorkflowOutput.response`."""

    def __init__(self, fn, config: Any = None) -> None:
        super().__init__(config)
        self.fn = fn

    async def compute_reward(self, workflow_task: WorkflowTask, workflow_output: WorkflowOutput):
        import asyncio
        import inspect

        from astuner.workflow import JudgeOutput, task_dict

        args = (task_dict(workflow_task.task), workflow_output.response, workflow_task.auxiliary_models)
        if inspect.iscoroutinefunction(self.fn):
            result = await self.fn(*args)
        else:
            result = await asyncio.to_thread(self.fn, *args)
        if not isinstance(result, JudgeOutput):
            raise UserError(f"judge function {getattr(self.fn, '__qualname__', self.fn)!r} returned "
                            f"{type(result).__name__}; it must return JudgeOutput(reward=...)")
        workflow_output.metrics.update(result.metrics)
        success = result.is_success if result.is_success is not None else result.reward > 0
        return float(result.reward), bool(success)


def final_answer_of(workflow_output: WorkflowOutput) -> str | None:
    """`workflow_output.metadata["final_answer"]` as stripped text; None when missing or empty."""
    value = (workflow_output.metadata or {}).get(FINAL_ANSWER_KEY)
    if value is None:
        return None
    text = str(value).strip()
    return text or None


def ground_truth_of(workflow_task: WorkflowTask) -> str:
    """The first non-empty of GROUND_TRUTH_KEYS in the task's metadata, as text.

    A GSM8K answer ("...reasoning...\\n#### 72") is reduced to the text after the last "####".
    """
    metadata = workflow_task.task.metadata or {}
    for key in GROUND_TRUTH_KEYS:
        value = metadata.get(key)
        if value is None or not str(value).strip():
            continue
        text = str(value).strip()
        if "####" in text:
            text = text.rsplit("####", 1)[1].strip()
        if text:
            return text
    raise UserError(
        f"task {workflow_task.task.task_id!r}: no ground truth for the judge; it looks for the first of "
        f"{', '.join(GROUND_TRUTH_KEYS)} in the dataset row, and the row has fields: "
        f"{', '.join(map(str, metadata)) or '(none)'}."
    )
