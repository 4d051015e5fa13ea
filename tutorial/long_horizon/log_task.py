"""The long-horizon tutorial's task: a log longer than the model's window, read page by page with one tool.

Early pages hold the logins (`login user=<name> session=<id>`) among routine lines; the last page holds one
failure (`ERROR session=<id> ...`). The question: whose session failed? The answer needs a fact from the first
pages and one from the last, and the pages together do not fit in the window (2,048 tokens for the demo model):
without a context policy the episode is cut (labelled "window"); with `rollout.context_policy: summarize` the
agent writes a summary when the window fills, and what it kept decides the reward, which trains the summary too.

The log is made from the task's seed (no file); `answer()` is an ordinary tool loop on `openai.AsyncOpenAI`.
"""

import json
import random
import re

from astuner import Workflow, WorkflowOutput
from astuner.task_judge.base_judge import BaseJudge

USERS = ["alice", "bruno", "chen", "dana", "emil", "farah", "goran", "hana", "ivo", "jun", "kira", "lena"]
SERVICES = ["cache", "queue", "auth", "billing", "search", "mailer"]
LINES_PER_PAGE = 24
SYSTEM = ("You investigate logs. The log has several pages; read them in order with read_log(page), starting at "
          "page 1. Logins name the user of each session. When you find the ERROR line, answer with the user whose "
          "session failed, inside \\boxed{}.")
QUESTION = "A session failed somewhere in this log of {pages} pages. Whose session was it?"
MAX_TURNS = 8
READ_LOG = {"type": "function", "function": {
    "name": "read_log", "description": "One page of the log.",
    "parameters": {"type": "object", "properties": {"page": {"type": "integer", "description": "The page, from 1."}},
                   "required": ["page"]}}}
BOXED = re.compile(r"\\boxed\{\s*([a-z]+)\s*\}")


def make_log(seed: int, pages: int) -> tuple[list[str], str]:
    """The log's pages and the user whose session failed; the same seed makes the same log."""
    rng = random.Random(seed)
    users = rng.sample(USERS, 4)
    sessions = {u: f"S-{rng.randrange(1000, 10000)}" for u in users}
    failed = rng.choice(users)
    lines = []
    for p in range(pages):
        page = [f"{8 + p}:{m:02d}:{rng.randrange(60):02d} {rng.choice(SERVICES)}-{rng.randrange(1, 5)} ok "
                f"heartbeat latency={rng.randrange(3, 90)}ms" for m in range(LINES_PER_PAGE)]
        if p == 0:
            for i, u in enumerate(users):
                page[3 + 5 * i] = f"8:{3 + 5 * i:02d}:00 auth-1 login user={u} session={sessions[u]}"
        if p == pages - 1:
            page[rng.randrange(LINES_PER_PAGE)] = (f"{8 + p}:30:00 billing-2 ERROR session={sessions[failed]} "
                                                   "payment failed")
        lines.append("\n".join(page))
    return lines, failed


def read_log_tool(pages: list[str]):
    def read_log(page: int) -> str:
        try:
            n = int(page)
        except (TypeError, ValueError):
            return "Error: page must be a number."
        if not 1 <= n <= len(pages):
            return f"Error: the log has pages 1 to {len(pages)}."
        return f"Page {n} of {len(pages)}:\n{pages[n - 1]}"
    return read_log


async def answer(client, question: str, pages: list[str], max_turns: int = MAX_TURNS) -> str:
    """The agent's tool loop: ask, run the tool it calls, until it answers (or `max_turns` calls)."""
    read_log = read_log_tool(pages)
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    for _ in range(max_turns):
        response = await client.chat.completions.create(model="policy", messages=messages, tools=[READ_LOG])
        message = response.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            return message.content or ""
        for call in message.tool_calls:
            try:
                result = read_log(**json.loads(call.function.arguments or "{}")) if call.function.name == \
                    "read_log" else f"Error: no tool named {call.function.name!r}; the tool is read_log."
            except (TypeError, ValueError) as error:
                result = f"Error: {error}"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    return messages[-1].get("content") or ""


class LogAgent(Workflow):
    async def execute(self, workflow_task, model_tuner):
        meta = workflow_task.task.metadata
        pages, _ = make_log(int(meta["seed"]), int(meta["pages"]))
        final = await answer(model_tuner.get_openai_client(), workflow_task.task.main_query, pages)
        return WorkflowOutput(reward=None, metadata={"final_answer": final})


class UserJudge(BaseJudge):
    """Reward 1.0 when the last boxed name is the user whose session failed."""

    def compute_reward(self, workflow_task, workflow_output):
        boxed = BOXED.findall(str(workflow_output.metadata.get("final_answer") or "").lower())
        ok = bool(boxed) and boxed[-1] == workflow_task.task.metadata["answer"]
        return float(ok), ok
