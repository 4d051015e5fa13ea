"""The lookup task split between two agents, each its own model: a finder and a keeper.

The finder gets the question, calls `find_badge` and answers with the badge number inside \\boxed{}; the keeper
gets that badge, calls `lookup_code` and answers with the code inside \\boxed{}. Each agent runs on its own weights
(astuner.agents in two_agents.yaml), and each is rewarded for its own part (`agent_rewards`): the finder when its
badge is the person's, the keeper when its code is the one kept for the badge it was handed. The episode succeeds
when the final code is the person's (CodeJudge).

The one astuner-specific line per agent is where its client comes from: `model_tuner.for_agent(name)`.
"""

import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "agent_quickstart"))

from astuner import Workflow, WorkflowOutput  # noqa: E402
from lookup_task import BADGES, BOXED, CODES, find_badge, lookup_code  # noqa: E402
from openai_agent import answer as agent  # noqa: E402  the quick-start's tool loop, one tool per agent here

FINDER = ("You find badge numbers. Call find_badge with the person's full name, then give the badge number inside "
          "\\boxed{}. Never guess.")
KEEPER = ("You answer questions about access codes. Codes are kept by badge number: call lookup_code with the badge "
          "number, then give the code inside \\boxed{}. Never guess.")
MAX_TURNS = 3
KEPT = {number: CODES[person] for person, number in BADGES.items()}  # badge -> its code
BADGE = re.compile(r"\b(\d{4})\b")


def last_badge(text: str) -> str | None:
    found = BADGE.findall(text or "")
    return found[-1] if found else None


class FinderAndKeeper(Workflow):
    async def execute(self, workflow_task, model_tuner):
        name = workflow_task.task.metadata["name"]
        finder = model_tuner.for_agent("finder").get_openai_client()
        keeper = model_tuner.for_agent("keeper").get_openai_client()
        found = await agent(finder, workflow_task.task.main_query, FINDER, {"find_badge": find_badge}, MAX_TURNS)
        badge = last_badge(found)
        answer = await agent(keeper, f"What is the access code kept for badge {badge}?", KEEPER,
                             {"lookup_code": lookup_code}, MAX_TURNS) if badge else ""
        boxed = BOXED.findall(answer)
        finder_ok = float(badge == BADGES[name])
        keeper_ok = float(bool(boxed) and badge in KEPT and boxed[-1] == KEPT[badge])
        return WorkflowOutput(reward=None, metadata={"final_answer": answer, "badge": badge},
                              agent_rewards={"finder": finder_ok, "keeper": keeper_ok},
                              metrics={"finder_success": finder_ok, "keeper_success": keeper_ok})
