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
