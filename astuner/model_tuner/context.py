"""Context policies: what the model is shown when an agent's conversation no longer fits its window.

A call's prompt needs room for a whole turn: prompt + max_tokens_per_turn <= max_model_len. When it has not,
`rollout.context_policy` acts on what the model sees (the agent's own message list is never changed):
  none               the call runs in what room is left, or is refused: a cut labelled "window" (astuner/cuts.py);
  drop_tool_outputs  the oldest tool results become a one-line marker until the prompt fits (those after the
                     last assistant message, which the model has not answered yet, stay);
  summarize          the policy model, in the same episode, writes a summary of the conversation between the
                     task (the leading system and user messages) and the latest assistant turn; the model then
                     sees the task, the summary, and the conversation from that turn on. The summary call is
                     recorded and trained like any other, with the episode's advantage: writing a summary that
                     lets the episode succeed is learnt from the episode's reward;
  subagent           the oldest tool results, one at a time, are each read by a sub-agent: a call of the same
                     episode in a fresh context (the task's system messages and one user message with the task and
                     that result alone), whose report is shown in the result's place until the prompt fits. The
                     agent keeps its own conversation; a sub-agent's call is trained with the episode's advantage
                     like a summary, so reading a long output for what the task needs is learnt from the reward.
Each compaction starts a new segment: the calls after it carry `segment` + 1 (the summary call belongs to the
segment it closes, as do a sub-agent's calls). The agent's later calls see the same compaction (their messages start
with the ones it covered), so a segment's calls extend each other token-exactly and `merge` joins them as before. A
request that does not extend the agent's previous context (an agent framework that compacted its own history) starts
a new segment too, so a framework's compaction is a segment, never a broken prefix.

When even the compacted prompt leaves no room, the call proceeds as under `none` (cut or refused, labelled); a
summary that came back empty changes nothing. An agent's calls decide one at a time (a lock per agent): a call
that comes while its agent is being summarized waits and then sees the summary. A summary cut at
summary_max_tokens is labelled `summary_cap` (astuner/cuts.py), as is a sub-agent's report.
"""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from astuner.model_tuner.chat_format import canonical_messages, flatten_content

# Set while a summary or sub-agent call runs (in its task only): that call is neither compacted nor a new segment.
SUMMARIZING: contextvars.ContextVar[bool] = contextvars.ContextVar("astuner_summarizing", default=False)

if TYPE_CHECKING:
    from astuner.model_tuner.turn import CallOptions

POLICIES = ("none", "drop_tool_outputs", "summarize", "subagent")
DROPPED = "[tool output dropped to fit the context: {n} characters]"
SUMMARY_REQUEST = (
    "Your conversation is too long for your context. Summarize the conversation below for yourself: keep every "
    "fact, tool result and decision needed to finish the task, and what is left to do. Write only the summary."
)
SUMMARY_HEADER = "Summary of your work so far (the earlier conversation no longer fits your context):\n"
SUBAGENT_REQUEST = (
    "You are a sub-agent with a fresh context. A tool returned the output below, too long for the agent that called "
    "it. Read it for the task and report everything in it the task needs (names, numbers, facts, and what it does "
    "not contain). Write only the report."
)
SUBAGENT_HEADER = "A sub-agent read this tool output (too long for your context) and reports:\n"


@dataclass
class Compaction:
    """The agent's first messages (`covers`, canonical) are shown to the model as `shown`."""

    covers: list[str]
    shown: list[dict]
    segment: int  # the segment it starts


@dataclass
class ContextState:
    """One episode's compactions, per agent (several: an agent may hold several conversations), and the segment
    each agent's calls are in."""

    policy: str = "none"
    summary_max_tokens: int = 256
    compactions: dict[str, list[Compaction]] = field(default_factory=dict)
    segments: dict[str, int] = field(default_factory=dict)
    _locks: dict[str, asyncio.Lock] = field(default_factory=dict)

    def lock(self, agent: str) -> asyncio.Lock:
        """Held while a call of `agent` decides (and maybe writes) a compaction."""
        return self._locks.setdefault(agent, asyncio.Lock())

    def match(self, agent: str, messages: list[dict], reasoning_parser) -> Compaction | None:
        """The agent's compaction covering the longest start of `messages`, if any."""
        best = None
        for c in self.compactions.get(agent, ()):
            if len(messages) >= len(c.covers) and (best is None or len(c.covers) > len(best.covers)) and \
                    canonical_messages(messages[: len(c.covers)], reasoning_parser) == c.covers:
                best = c
        return best

    def view(self, agent: str, messages: list[dict], reasoning_parser) -> list[dict]:
        """What the model is shown of `messages`: the agent's compaction applied where they start with the
        messages it covered (another conversation of the agent is shown as it is)."""
        return shown_through(self.match(agent, messages, reasoning_parser), messages)

    def compact(self, agent: str, messages: list[dict], seen: Compaction | None, shown: list[dict],
                view_upto: int, reasoning_parser) -> Compaction:
        """Record that the agent's messages up to `view_upto` of their view through `seen` (the compaction they
        were shown through, if any) are shown as `shown`; the new compaction."""
        upto = view_upto if seen is None else view_upto - len(seen.shown) + len(seen.covers)
        self.segments[agent] = self.segments.get(agent, 0) + 1
        made = Compaction(canonical_messages(messages[:upto], reasoning_parser), shown, self.segments[agent])
        self.compactions.setdefault(agent, []).append(made)
        return made


def shown_through(c: Compaction | None, messages: list[dict]) -> list[dict]:
    """`messages` as the model sees them through compaction `c` (None: as they are)."""
    return messages if c is None else c.shown + messages[len(c.covers):]


def drop_tool_outputs(view: list[dict], fits) -> tuple[list[dict], int]:
    """The view with its oldest tool results replaced by a marker, oldest first, until `fits` (or all are, when it
    never does: the most room there is); and the index just past the last one replaced (0: none was). Results the
    model has not answered yet (after the last assistant message) are never dropped."""
    out = list(view)
    last = max((i for i, m in enumerate(out) if m.get("role") == "assistant"), default=-1)
    tools = [i for i, m in enumerate(out[:last]) if m.get("role") == "tool" and not _dropped(m)]
    upto = 0
    for i in tools:
        n = len(flatten_content(out[i].get("content")))
        out[i], upto = {**out[i], "content": DROPPED.format(n=n)}, i + 1
        if fits(out):
            break
    return out, upto


def _dropped(message: dict) -> bool:
    text = flatten_content(message.get("content"))
    return text.startswith(DROPPED.split("{", 1)[0])


def delegable(view: list[dict]) -> list[int]:
    """The tool results of `view` after the task that a sub-agent may read in the model's place, oldest first (one
    a sub-agent already read is not read again)."""
    return [i for i in range(task_head(view), len(view)) if view[i].get("role") == "tool"
            and not flatten_content(view[i].get("content")).startswith(SUBAGENT_HEADER)]


def subagent_request(view: list[dict], i: int, fits) -> list[dict] | None:
    """The messages of a sub-agent's call on the tool result view[i]: the task's system messages, then one user
    message with the request, the task and the result (its start and end, shortened until `fits`). None when even
    a short one does not fit."""
    text = flatten_content(view[i].get("content"))
    return side_request(view, lambda task, limit: f"{SUBAGENT_REQUEST}\n\nThe task:\n{task}\n\nThe tool output:\n"
                        f"{shortened(text, limit)}", len(text) + 1, fits)


def delegated(message: dict, report: str) -> dict:
    """The tool result `message` as the model is shown it once a sub-agent read it: the sub-agent's report."""
    return {**message, "content": SUBAGENT_HEADER + report.strip()}


def task_head(view: list[dict]) -> int:
    """Messages that state the task: the leading system messages and the first user message."""
    i = 0
    while i < len(view) and view[i].get("role") == "system":
        i += 1
    return i + 1 if i < len(view) and view[i].get("role") == "user" else i


def summary_cut(view: list[dict]) -> int | None:
    """Where the kept tail starts: the latest assistant message after the task. None: nothing to summarize."""
    head = task_head(view)
    for i in range(len(view) - 1, head, -1):
        if view[i].get("role") == "assistant":
            return i
    return None


def transcript(messages: list[dict], limit: int) -> str:
    """The messages as text for the summary request, each at most `limit` characters (its start and end)."""
    lines = []
    for m in messages:
        text = flatten_content(m.get("content"))
        calls = [c.get("function", c) for c in m.get("tool_calls") or []]
        if calls:
            text += "\n" + json.dumps(calls, ensure_ascii=False)
        lines.append(f"{m.get('role')}: {shortened(text, limit)}")
    return "\n\n".join(lines)


def shortened(text: str, limit: int) -> str:
    """`text`, or its start and end when longer than `limit` characters."""
    return text if len(text) <= limit else text[: limit // 2] + " [...] " + text[-limit // 2:]


def side_request(view: list[dict], body, limit: int, fits) -> list[dict] | None:
    """A context policy's call (a summary, a sub-agent's report): the task's system messages, then one user message
    `body(task, limit)` (`task`: the task's user message), `limit` halved until the request `fits`.
    None when it does not fit even at 128 characters."""
    head = task_head(view)
    system = [m for m in view[:head] if m.get("role") == "system"]
    task = next((flatten_content(m.get("content")) for m in view[:head] if m.get("role") == "user"), "")
    while True:
        request = system + [{"role": "user", "content": body(task, limit)}]
        if fits(request):
            return request
        if limit < 128:
            return None
        limit //= 2


def summary_request(view: list[dict], cut: int, fits) -> list[dict] | None:
    """The messages of the summary call: the task's system messages, then one user message asking for a summary
    of view[head:cut], its messages shortened until `fits`. None when even short ones do not fit."""
    head = task_head(view)
    return side_request(view, lambda task, limit: f"{SUMMARY_REQUEST}\n\nThe task:\n{task}\n\nThe conversation:\n"
                        + transcript(view[head:cut], limit),
                        len(transcript(view[head:cut], 10**9)) + 1, fits)  # the first try: every message whole


def summarized_view(view: list[dict], cut: int, summary: str) -> tuple[list[dict], int]:
    """The task, the summary as a user message, then the view from `cut`; and how many messages stand for
    view[:cut] (the task and the summary)."""
    head = task_head(view)
    shown = view[:head] + [{"role": "user", "content": SUMMARY_HEADER + summary.strip()}]
    return shown + view[cut:], len(shown)


def state_of(policy: str, summary_max_tokens: int) -> ContextState:
    if policy not in POLICIES:
        raise ValueError(f"rollout.context_policy must be one of {POLICIES}, got {policy!r}")
    return ContextState(policy=policy, summary_max_tokens=summary_max_tokens)


def summary_options(options: CallOptions, max_tokens: int) -> CallOptions:
    """The summary call's options: the agent's, without its tools, stops or prefill, at most `max_tokens`."""
    return dataclasses.replace(options, max_tokens=max_tokens, stop=(), tool_choice=None, prefill="")
