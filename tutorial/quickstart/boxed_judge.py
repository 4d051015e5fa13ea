"""The quick-start judge: success is the right number inside \\boxed{}.

Reward: 1.0 when the last boxed number is right; 0.3 for exactly one boxed number that is wrong; 0.0 otherwise
(no box, or several boxes none of them last-and-right). The partial credit rewards following the format (which
the demo model rarely does at step 0) without ever paying an unboxed answer, so the policy cannot settle on the
easier "a + b = c" without the box. It is paid for one box only: with credit for any box, some seeds learned to
scatter boxed numbers ("\\boxed{2}. This answer is \\boxed{2}.") and stopped computing the sum
(bench/quickstart_seeds.py).
"""

import re

from astuner.task_judge.base_judge import BaseJudge

BOXED = re.compile(r"\\boxed\{\s*(-?\d+)\s*\}")
ANY_BOX = re.compile(r"\\boxed\{")


class BoxedAnswerJudge(BaseJudge):
    def compute_reward(self, workflow_task, workflow_output):
        text = workflow_output.metadata.get("final_answer") or ""
        boxed = BOXED.findall(text)
        if not boxed:
            return 0.0, False
        correct = boxed[-1] == str(workflow_task.task.metadata["answer"]).strip()
        if correct:
            return 1.0, True
        return (0.3 if len(ANY_BOX.findall(text)) == 1 else 0.0), False
