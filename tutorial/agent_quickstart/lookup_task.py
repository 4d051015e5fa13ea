"""The agent quick-start's task: find a person's access code with two tools, chained, then answer with it.

The tools, the prompt and the agent's loop are plain Python in lookup_agent.py (a remote client runs them without
astuner); this module adds the judge, CodeJudge: reward 1 when the boxed code is the person's.
"""

import re

from astuner.task_judge.base_judge import BaseJudge
from lookup_agent import (BADGES, CODES, LETTERS, MAX_TURNS, NAMES, QUESTION, SYSTEM, TOOL_SCHEMAS, TOOLS,  # noqa: F401
                          badge_of, code_of, find_badge, lookup_code, tool_schema)

BOXED = re.compile(r"\\boxed\{\s*([A-Z]{2}-\d{4})\s*\}")


class CodeJudge(BaseJudge):
    """Reward 1.0 when the last boxed code is the person's code, else 0.0: the outcome only, no shaping."""

    def compute_reward(self, workflow_task, workflow_output):
        boxed = BOXED.findall(str(workflow_output.metadata.get("final_answer") or ""))
        ok = bool(boxed) and boxed[-1] == workflow_task.task.metadata["answer"]
        return float(ok), ok
