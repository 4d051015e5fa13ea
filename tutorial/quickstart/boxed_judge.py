"""The quick-start judge: half the reward for answering inside \\boxed{}, half for the right number.

Success (what validation accuracy counts) needs both: the right number inside \\boxed{}. The 135M demo model
adds small numbers correctly about half the time but rarely boxes its answer, so the shaped reward gives GRPO
a signal from the first step, and the success rate shows the model learning the format.
"""

import re

from astuner.task_judge.base_judge import BaseJudge

BOXED = re.compile(r"\\boxed\{\s*(-?\d+)\s*\}")
NUMBER = re.compile(r"-?\d+")


class BoxedAnswerJudge(BaseJudge):
    def compute_reward(self, workflow_task, workflow_output):
        text = workflow_output.metadata.get("final_answer") or ""
        answer = str(workflow_task.task.metadata["answer"]).strip()
        boxed = BOXED.findall(text)
        numbers = NUMBER.findall(text)
        last_correct = bool(numbers) and numbers[-1] == answer
        success = bool(boxed) and boxed[-1] == answer
        reward = 0.5 * bool(boxed) + 0.5 * (success or (not boxed and last_correct))
        return reward, success
