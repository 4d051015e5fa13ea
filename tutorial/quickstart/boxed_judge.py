"""The quick-start judge: success is the right number inside \\boxed{}.

Reward: 1.0 when the last boxed number is right; 0.3 for one boxed number that is wrong in an answer that writes
this task's sum ("27 + 6 = ..."); 0.0 otherwise (no box, several boxes, or a box without the sum). The partial
credit rewards following the format (which the demo model rarely does at step 0) without ever paying an unboxed
answer. Cheaper forms were learned as reward hacks on some seeds (bench/quickstart_seeds.py): with credit for any
box, scattered boxed numbers ("\\boxed{2}. This answer is \\boxed{2}."); with credit for one box, a bare
"\\boxed{N}" guess with no sum written. Asking for more (the box equal to the sum the answer wrote) left too little
signal at step 0: on the vLLM engine 2 seeds in 3 did not gain 0.3 within 8 minutes.
"""

import re

from astuner.task_judge.base_judge import BaseJudge

BOXED = re.compile(r"\\boxed\{\s*(-?\d+)\s*\}")
ANY_BOX = re.compile(r"\\boxed\{")
OPERANDS = re.compile(r"(\d+)\s*\+\s*(\d+)")


class BoxedAnswerJudge(BaseJudge):
    def compute_reward(self, workflow_task, workflow_output):
        text = workflow_output.metadata.get("final_answer") or ""
        boxed = BOXED.findall(text)
        if not boxed:
            return 0.0, False
        if boxed[-1] == str(workflow_task.task.metadata["answer"]).strip():
            return 1.0, True
        task = OPERANDS.search(workflow_task.task.main_query)
        writes_the_sum = task is not None and task.groups() in OPERANDS.findall(text)
        return (0.3 if len(ANY_BOX.findall(text)) == 1 and writes_the_sum else 0.0), False
