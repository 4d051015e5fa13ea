"""The quick-start judge: success is the right number inside \\boxed{}.

Reward: 1.0 for the right boxed number, 0.3 for a wrong boxed number, 0.0 without a boxed number. The partial
credit rewards following the format (which the demo model rarely does at step 0) without ever paying an
unboxed answer, so the policy cannot settle on the easier "a + b = c" without the box.
"""

import re

from astuner.task_judge.base_judge import BaseJudge

BOXED = re.compile(r"\\boxed\{\s*(-?\d+)\s*\}")


class BoxedAnswerJudge(BaseJudge):
    def compute_reward(self, workflow_task, workflow_output):
        boxed = BOXED.findall(workflow_output.metadata.get("final_answer") or "")
        if not boxed:
            return 0.0, False
        correct = boxed[-1] == str(workflow_task.task.metadata["answer"]).strip()
        return (1.0 if correct else 0.3), correct
