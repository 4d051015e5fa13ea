"""A strict judge for the quick-start: only an answer inside \\boxed{} counts."""

import re

from astuner.task_judge.base_judge import BaseJudge

BOXED = re.compile(r"\\boxed\{\s*(-?\d+)\s*\}")


class BoxedAnswerJudge(BaseJudge):
    def compute_reward(self, workflow_task, workflow_output):
        found = BOXED.findall(workflow_output.metadata.get("final_answer") or "")
        correct = bool(found) and found[-1] == str(workflow_task.task.metadata["answer"]).strip()
        return (1.0 if correct else 0.0), correct
