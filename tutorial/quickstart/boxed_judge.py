"""The quick-start judge: success is the right number inside \\boxed{}.

Reward: 1.0 when the last boxed number is right; 0.3 for an answer in the requested form with a wrong sum
("a + b = X. The answer is \\boxed{X}": the task's own a and b, one box, holding the X the equation wrote);
0.0 otherwise. The partial credit rewards following the format (which the demo model rarely does at step 0)
without ever paying an unboxed answer. It asks for the whole form because cheaper forms were learned as reward
hacks on some seeds (bench/quickstart_seeds.py): with credit for any box, scattered boxed numbers
("\\boxed{2}. This answer is \\boxed{2}."); with credit for one box, a bare "\\boxed{N}" guess with no sum written.
"""

import re

from astuner.task_judge.base_judge import BaseJudge

BOXED = re.compile(r"\\boxed\{\s*(-?\d+)\s*\}")
ANY_BOX = re.compile(r"\\boxed\{")
OPERANDS = re.compile(r"(\d+)\s*\+\s*(\d+)")
EQUATION = re.compile(r"(\d+)\s*\+\s*(\d+)\s*=\s*(-?\d+)")


class BoxedAnswerJudge(BaseJudge):
    def compute_reward(self, workflow_task, workflow_output):
        text = workflow_output.metadata.get("final_answer") or ""
        boxed = BOXED.findall(text)
        if not boxed:
            return 0.0, False
        if boxed[-1] == str(workflow_task.task.metadata["answer"]).strip():
            return 1.0, True
        return (0.3 if _in_requested_form(workflow_task.task.main_query, text, boxed) else 0.0), False


def _in_requested_form(question: str, text: str, boxed: list[str]) -> bool:
    task = OPERANDS.search(question)
    if task is None or len(ANY_BOX.findall(text)) != 1:
        return False
    return any((a, b) == task.groups() and x == boxed[0] for a, b, x in EQUATION.findall(text))
