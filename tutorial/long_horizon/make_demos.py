"""Writes logs/demos.jsonl: the warm start's demonstrations (warm_start.yaml), on *twins* of the task.

A twin is a record read page by page with its own tool: a hotel journal (`read_journal`: check-ins `guest=<name>
room=<id>` on the first page, an `ALARM room=<id>` on the last, "whose room was it?"), a warehouse ledger (shift
starts and a FAULT) or a lab notebook (assignments and a SPILL). Same shape as the log task (log_task.py), none
of its words: other tools, names, lines and ids, so what GRPO then learns on the log is left to it.

Each demonstrated episode is the three kinds of call a summarizing run makes (rollout.context_policy: summarize),
rendered with astuner's own context functions so the rows are what the rollouts show:
  1. the reading before the window fills: pages 1, 2 and 3 read in order, and the call for page 4;
  2. the summary call: the summary request over pages 1-3, answered with the first page's entries and what is left
     to do;
  3. the reading after it: the task, the summary, page 4 (and 5), and the answer inside \\boxed{}.
"""

import json
import random
from dataclasses import dataclass
from pathlib import Path

from astuner.model_tuner.context import summarized_view, summary_cut, summary_request

NAMES = ["omar", "petra", "quinn", "rosa", "sven", "tara", "uma", "viktor", "wen", "xena", "yusuf", "zoe"]
LINES_PER_PAGE = 24  # as the log's pages: the window fills at the same page
PAGES_BEFORE_SUMMARY = 3  # the log task's window (2,048 tokens) holds three pages


@dataclass(frozen=True)
class Twin:
    """A kind of record read page by page: its tool, its words, and the formats of its lines. Three kinds, so the
    warm start learns the pattern (the line the system prompt names, the entries that map it to a name) rather
    than one kind's words."""
    tool: str
    record: str  # "journal"
    title: str  # the record's kind in the system prompt: "hotel journal"
    question: str
    entries: str  # what the entries are called in a summary: "Check-ins"
    key: str  # the line to find: "ALARM"
    role: str  # "guest"
    thing: str  # "room"
    prefix: str  # the ids' prefix: "R"
    units: tuple[str, ...]
    entry: str  # an entry line, from {name} and {id}
    event: str  # the key line, from {id}
    routine: str  # a routine line's end, from {n}

    @property
    def system(self) -> str:
        return (f"You investigate {self.title}s. The {self.title} has several pages; read them in order with "
                f"{self.tool}(page), starting at page 1. {self.entries} name the {self.role} of each {self.thing}. "
                f"When you find the {self.key} line, answer with the {self.role} whose {self.thing} it was, inside "
                "\\boxed{}.")

    def schema(self) -> dict:
        return {"type": "function", "function": {
            "name": self.tool, "description": f"One page of the {self.record}.",
            "parameters": {"type": "object", "required": ["page"], "properties": {
                "page": {"type": "integer", "description": "The page, from 1."}}}}}


TWINS = (
    Twin("read_journal", "journal", "hotel journal",
         "An alarm went off somewhere in this journal of {pages} pages. Whose room was it?", "Check-ins", "ALARM",
         "guest", "room", "R", ("hvac", "lift", "door", "boiler", "pool", "kitchen"), "desk-1 checkin guest={name} "
         "room={id}", "alarm-2 ALARM room={id} smoke detected", "ok reading level={n}%"),
    Twin("read_ledger", "ledger", "warehouse ledger",
         "A fault was logged somewhere in this ledger of {pages} pages. Whose bay was it?", "Shift starts", "FAULT",
         "worker", "bay", "B", ("belt", "crane", "scale", "dock", "forklift", "chiller"), "gate-2 shift start "
         "worker={name} bay={id}", "belt-3 FAULT bay={id} conveyor jammed", "ok load={n}kg"),
    Twin("read_notebook", "notebook", "lab notebook",
         "A spill was noted somewhere in this notebook of {pages} pages. Whose sample was it?", "Assignments",
         "SPILL", "technician", "sample", "X", ("fridge", "oven", "pump", "hood", "mixer", "scope"), "desk-3 assign "
         "technician={name} sample={id}", "bench-1 SPILL sample={id} contaminated", "ok temp={n}C"),
)


def make_record(twin: Twin, rng: random.Random, pages: int) -> tuple[list[str], dict[str, str], str]:
    """The record's pages, each name's id, and the name whose id the key line names."""
    names = rng.sample(NAMES, 4)
    ids = {name: f"{twin.prefix}-{rng.randrange(1000, 10000)}" for name in names}
    found = rng.choice(names)
    # The hour each page starts at, from a random first hour: a summary's page numbers cannot be copied from the
    # hours (with the hour tied to the page, a warm start wrote "I read pages 8 and 9" on the log, whose first
    # page starts at 8:00).
    start = rng.randrange(19)
    out = []
    for p in range(pages):
        page = [f"{start + p}:{m:02d}:{rng.randrange(60):02d} {rng.choice(twin.units)}-{rng.randrange(1, 5)} "
                + twin.routine.format(n=rng.randrange(3, 90)) for m in range(LINES_PER_PAGE)]
        if p == 0:
            for i, name in enumerate(names):
                page[2 + 5 * i] = f"{start}:{2 + 5 * i:02d}:00 " + twin.entry.format(name=name, id=ids[name])
        if p == pages - 1:
            page[rng.randrange(LINES_PER_PAGE)] = f"{start + p}:30:00 " + twin.event.format(id=ids[found])
        out.append("\n".join(page))
    return out, ids, found


def call(twin: Twin, n: int) -> dict:
    return {"role": "assistant", "content": "", "tool_calls": [{
        "id": f"call_{n}", "type": "function", "function": {"name": twin.tool, "arguments": json.dumps({"page": n})}}]}


def result(n: int, pages: list[str]) -> dict:
    return {"role": "tool", "tool_call_id": f"call_{n}", "content": f"Page {n} of {len(pages)}:\n{pages[n - 1]}"}


def episode(rng: random.Random, twin: Twin) -> list[dict]:
    """One demonstrated episode: its three rows (module docstring)."""
    pages, ids, found = make_record(twin, rng, rng.choice((4, 5)))
    tools = [twin.schema()]
    view = [{"role": "system", "content": twin.system},
            {"role": "user", "content": twin.question.format(pages=len(pages))}]
    for n in range(1, PAGES_BEFORE_SUMMARY + 2):
        view += [call(twin, n), result(n, pages)]
    reading = {"tools": tools, "messages": view[:-1]}  # ends with the call the window could not answer
    cut = summary_cut(view)
    rest = range(PAGES_BEFORE_SUMMARY + 1, len(pages) + 1)
    left = f"page {rest[0]}" if len(rest) == 1 else f"pages {' and '.join(map(str, rest))}"
    entries = ", ".join(f"{name} {twin.thing} {i}" for name, i in ids.items())
    summary = (f"I read pages 1 to {PAGES_BEFORE_SUMMARY} of {len(pages)}. {twin.entries}: {entries}. No {twin.key} "
               f"line yet. Left to do: read {left}, find the {twin.key} line and answer with the {twin.role} of its "
               f"{twin.thing}.")
    summarizing = {"messages": summary_request(view, cut, lambda request: True) + [
        {"role": "assistant", "content": summary}]}
    after, _ = summarized_view(view, cut, summary)
    for n in range(PAGES_BEFORE_SUMMARY + 2, len(pages) + 1):
        after += [call(twin, n), result(n, pages)]
    after.append({"role": "assistant", "content": f"The {twin.key} line names {twin.thing} {ids[found]}, the "
                                                  f"{twin.thing} of {found}. The answer is \\boxed{{{found}}}."})
    return [reading, summarizing, {"tools": tools, "messages": after}]


def demonstrations(count: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    return [row for i in range(count) for row in episode(rng, TWINS[i % len(TWINS)])]


if __name__ == "__main__":
    out = Path(__file__).parent / "logs" / "demos.jsonl"
    out.write_text("".join(json.dumps(row) + "\n" for row in demonstrations(32)))
    print(f"wrote {out} (32 episodes, 3 rows each)")
