"""`ExactMatchJudge`: reward 1.0 when the episode's final answer equals the ground truth as text.

What it reads:
  workflow_output.metadata["final_answer"]  the prediction. Missing or empty: (0.0, False).
  workflow_task.task.metadata               the ground truth: the first present of "answer", "ground_truth",
      "solution". A GSM8K answer ("...reasoning...\\n#### 72") counts from after "####". None present: UserError.
Both sides are normalised before comparing: surrounding whitespace stripped, case folded, inner whitespace runs
collapsed to one space, and one trailing period dropped. Nothing else (no \\boxed{} extraction, no number parsing;
use MathAnswerAsJudge for that). Returns (1.0, True) on a match, else (0.0, False).
"""

from __future__ import annotations

import re

from astuner.task_judge.base_judge import BaseJudge, final_answer_of, ground_truth_of
from astuner.workflow import WorkflowOutput, WorkflowTask

_SPACES = re.compile(r"\s+")


def normalize(text: str) -> str:
    text = _SPACES.sub(" ", text.strip().casefold())
    if text.endswith("."):
        text = text[:-1].rstrip()
    return text


class ExactMatchJudge(BaseJudge):
    def compute_reward(self, workflow_task: WorkflowTask, workflow_output: WorkflowOutput) -> tuple[float, bool]:
        gold = ground_truth_of(workflow_task)
        prediction = final_answer_of(workflow_output)
        if prediction is None:
            return 0.0, False
        correct = normalize(prediction) == normalize(gold)
        return (1.0 if correct else 0.0), correct
