"""The quick-start judge: success is the right number inside \\boxed{}.

Reward: 1.0 when the last boxed number is right; 0.3 for an answer in the asked form with a wrong sum, "a + b = X.
The answer is \\boxed{X}." (one box, holding the X the answer wrote for this task's a + b); 0.0 otherwise.

Why this credit (bench/quickstart_seeds.py, README): crediting any single wrong box let some seeds settle on a
bare "\\boxed{N}" guess, which never computes the sum; crediting any box at all let them scatter boxes. The form
credit pays only an attempt at the task's own sum, so the policy learns to compute and box together. It needs
the rollouts' temperature at 0.7 (quickstart.yaml): at 1.0 the 135M model writes the form too rarely in its first
steps for GRPO to have a signal.
"""

import re

from astuner.task_judge.base_judge import BaseJudge

BOXED = re.compile(r"\\boxed\{\s*(-?\d+)\s*\}")
ANY_BOX = re.compile(r"\\boxed\{")
QUESTION = re.compile(r"What is (\d+) \+ (\d+)\?")


class BoxedAnswerJudge(BaseJudge):
    def compute_reward(self, workflow_task, workflow_output):
        text = workflow_output.metadata.get("final_answer") or ""
        boxed = BOXED.findall(text)
        if not boxed:
            return 0.0, False
        if boxed[-1] == str(workflow_task.task.metadata["answer"]).strip():
            return 1.0, True
        a, b = QUESTION.match(workflow_task.task.main_query).groups()
        form = re.search(rf"\b{a}\s*\+\s*{b}\s*=\s*(-?\d+)", text)
        single = len(ANY_BOX.findall(text)) == 1
        return (0.3 if single and form is not None and form.group(1) == boxed[0] else 0.0), False
