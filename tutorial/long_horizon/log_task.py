"""The long-horizon tutorial's task: a log longer than the model's window, read page by page with one tool.

Early pages hold the logins (`login session=<id> user=<name>`) among routine lines; the last page holds one
failure (`<time> <service>-<n> ERROR session=<id> reason=<word>`). The question: whose session failed, and why?
The answer needs a fact from the first page and two from the last, and the pages together do not fit in the window
(2,048 tokens for the demo model), so no answer is right without reading to the end, and the tool serves the pages
in order (no skipping from page 1 to the last). A name taken from the first page alone earns half the reward at
most (UserJudge), where it earned all when the name alone was the answer.
Without a context policy the episode is cut (labelled "window"); with `rollout.context_policy: summarize` the
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
REASONS = ["timeout", "refused", "quota", "corrupt", "overload", "deadlock"]
LINES_PER_PAGE = 24
PAGES = 5  # one length: demonstrations of 4 and 5 pages left the model saying "pages 4 and 5" on 4-page logs
SYSTEM = ("You investigate logs. The log has several pages; read them in order with read_log(page), starting at "
          "page 1. Logins name the user of each session. When you find the ERROR line, answer with the user whose "
          "session it was and the reason on the ERROR line, inside \\boxed{}: \\boxed{name reason}.")
QUESTION = "A session failed somewhere in this log of {pages} pages. Whose session was it, and why did it fail?"
MAX_TURNS = 8
READ_LOG = {"type": "function", "function": {
    "name": "read_log", "description": "One page of the log.",
    "parameters": {"type": "object", "properties": {"page": {"type": "integer", "description": "The page, from 1."}},
                   "required": ["page"]}}}
BOXED = re.compile(r"\\boxed\{([^{}]*)\}")
ANSWER = re.compile(r"^\s*([a-z]+)[\s,]+(?:reason=)?([a-z]+)\s*$")  # "name reason" in a box


def make_log(seed: int, pages: int) -> tuple[list[str], str]:
    """The log's pages and the answer, "<user whose session failed> <reason of the failure>"; the same seed makes
    the same log. Each fact follows the one that finds it (`ERROR session=<id> reason=<word>`, `login session=<id>
    user=<name>`): the demo model copies what comes after a matched token well and what comes before it badly
    (with the failure's time, then its service, both before ERROR, 1 of 16 answers at step 0 copied the ERROR
    line; the others copied a heartbeat)."""
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
                page[3 + 5 * i] = f"8:{3 + 5 * i:02d}:00 auth-1 login session={sessions[u]} user={u}"
        if p == pages - 1:
            at, reason = rng.randrange(LINES_PER_PAGE), rng.choice(REASONS)
            page[at] = (f"{8 + p}:{at:02d}:{rng.randrange(60):02d} {rng.choice(SERVICES)}-{rng.randrange(1, 5)} ERROR "
                        f"session={sessions[failed]} reason={reason}")
            answer = f"{failed} {reason}"
        lines.append("\n".join(page))
    return lines, answer


def read_log_tool(pages: list[str]):
    """The tool: a page, in order. A page past the next unread one is refused, so the last page (the failure)
    comes after the middle ones and the window fills on the way: reading pages 1 and 5 alone would fit it."""
    read = [0]  # the furthest page read

    def read_log(page: int) -> str:
        try:
            n = int(page)
        except (TypeError, ValueError):
            return "Error: page must be a number."
        if not 1 <= n <= len(pages):
            return f"Error: the log has pages 1 to {len(pages)}."
        if n > read[0] + 1:
            return f"Error: the pages are read in order; read page {read[0] + 1} first."
        read[0] = max(read[0], n)
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


def parse_answer(text: str) -> str | None:
    """The last \\boxed{} of a reply as "<name> <reason>", or None."""
    boxed = BOXED.findall(str(text or "").lower())
    found = ANSWER.match(boxed[-1]) if boxed else None
    return f"{found.group(1)} {found.group(2)}" if found else None


class UserJudge(BaseJudge):
    """Half the reward for the user whose session failed, half for the failure's reason; a success is both. The
    reason is on the last page only, so an answer before it is a guess (a name 1 time in 4, a reason 1 in 6),
    while reading to the end earns the reason's half and what the summary kept earns the name's."""

    def compute_reward(self, workflow_task, workflow_output):
        got = (parse_answer(workflow_output.metadata.get("final_answer")) or " ").split(" ")
        want = workflow_task.task.metadata["answer"].split(" ")
        user, reason = got[0] == want[0], got[1] == want[1]
        return 0.5 * user + 0.5 * reason, user and reason
