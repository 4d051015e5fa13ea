"""Writes logs/demos.jsonl: the warm start's demonstrations (warm_start.yaml): 8 episodes of the log task itself,
on logs no task uses (seeds from 5000), and 24 of six *twins* of it.

A twin is a record read page by page with its own tool: a hotel journal (`read_journal`: check-ins `room=<id>
guest=<name>` on the first page, an `ALARM room=<id> cause=<word>` on the last, "whose room was it, and what set it
off?"), a warehouse ledger (shift starts and a FAULT), a lab notebook (assignments and a SPILL), a parking register
(arrivals and a TOW), a ship manifest (boardings and a LEAK) or a library roster (loans and a LOST). Same shape as the log task
(log_task.py), none of its words: other tools, names, lines and ids. Twins alone did not carry to the log: warm
starts on them summarized logs without a login in 16 of 16 validation episodes (README.md), so a quarter of the
episodes are the log's, and the twins teach the pattern apart from one kind's words.

Each demonstrated episode is the three kinds of call a summarizing run makes (rollout.context_policy: summarize),
rendered with astuner's own context functions so the rows are what the rollouts show:
  1. the reading before the window fills: pages 1, 2 and 3 read in order, and the call for page 4;
  2. the summary call: the summary request over pages 1-3, answered with the first page's entries, copied as
     written, and what is left to do;
  3. the reading after it: the task, the summary, pages 4 and 5, and the answer, each fact copied from after what
     finds it (the key line from its key word on, then the id's entry), inside \\boxed{}: the name and the word
     the key line gives (the failure's reason on the log).
"""

import json
import random
import re
from dataclasses import dataclass
from pathlib import Path

import log_task
from astuner.model_tuner.context import summarized_view, summary_cut, summary_request

NAMES = ["omar", "petra", "quinn", "rosa", "sven", "tara", "uma", "viktor", "wen", "xena", "yusuf", "zoe"]
LINES_PER_PAGE = log_task.LINES_PER_PAGE  # the window fills at the same page
PAGES = log_task.PAGES
PAGES_BEFORE_SUMMARY = 3  # the log task's window (2,048 tokens) holds three pages


@dataclass(frozen=True)
class Twin:
    """A kind of record read page by page: its tool, its words, and the formats of its lines. Six kinds, so the
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
    attr: str  # what the key line says besides the id, the answer's second word: "cause" (key line `ALARM
    # room=<id> cause=<value>`); after the id, as the name after the id in an entry: each fact follows what finds it
    values: tuple[str, ...]  # its values: "smoke", ...
    units: tuple[str, ...]  # the units of the lines' prefix: "hvac", ...
    entry: str  # an entry line, from {name} and {id}
    routine: str  # a routine line's end, from {n}

    @property
    def system(self) -> str:
        return (f"You investigate {self.title}s. The {self.title} has several pages; read them in order with "
                f"{self.tool}(page), starting at page 1. {self.entries} name the {self.role} of each {self.thing}. "
                f"When you find the {self.key} line, answer with the {self.role} whose {self.thing} it was and the "
                f"{self.attr} on the {self.key} line, inside \\boxed{{}}: \\boxed{{name {self.attr}}}.")

    def schema(self) -> dict:
        return {"type": "function", "function": {
            "name": self.tool, "description": f"One page of the {self.record}.",
            "parameters": {"type": "object", "required": ["page"], "properties": {
                "page": {"type": "integer", "description": "The page, from 1."}}}}}


TWINS = (
    Twin("read_journal", "journal", "hotel journal", "An alarm went off somewhere in this journal of {pages} pages. "
         "Whose room was it, and what set it off?", "Check-ins", "ALARM", "guest", "room", "R", "cause",
         ("smoke", "flood", "heat", "glass", "panic", "gas"), ("hvac", "lift", "door", "boiler", "pool", "kitchen"),
         "desk-1 checkin room={id} guest={name}", "ok reading level={n}%"),
    Twin("read_ledger", "ledger", "warehouse ledger", "A fault was logged somewhere in this ledger of {pages} pages. "
         "Whose bay was it, and which part failed?", "Shift starts", "FAULT", "worker", "bay", "B", "part",
         ("belt", "motor", "sensor", "valve", "brake", "fuse"), ("crane", "scale", "dock", "forklift", "chiller"),
         "gate-2 shift start bay={id} worker={name}", "ok load={n}kg"),
    Twin("read_notebook", "notebook", "lab notebook", "A spill was noted somewhere in this notebook of {pages} pages. "
         "Whose sample was it, and what spilled?", "Assignments", "SPILL", "technician", "sample", "X", "agent",
         ("acid", "solvent", "dye", "enzyme", "resin", "saline"), ("fridge", "oven", "pump", "hood", "mixer"),
         "desk-3 assign sample={id} technician={name}", "ok temp={n}C"),
    Twin("read_register", "register", "parking register", "A car was towed somewhere in this register of {pages} "
         "pages. Whose spot was it, and under which rule?", "Arrivals", "TOW", "driver", "spot", "P", "rule",
         ("fireline", "loading", "disabled", "permit", "overtime", "tandem"), ("barrier", "ramp", "meter", "camera"),
         "gate-4 arrival spot={id} driver={name}", "ok count={n}"),
    Twin("read_manifest", "manifest", "ship manifest", "A leak was reported somewhere in this manifest of {pages} "
         "pages. Whose cabin was it, and what leaked?", "Boardings", "LEAK", "passenger", "cabin", "C", "fluid",
         ("water", "fuel", "oil", "steam", "brine", "coolant"), ("engine", "galley", "deck", "radar", "bilge"),
         "pier-2 boarding cabin={id} passenger={name}", "ok pressure={n}bar"),
    Twin("read_roster", "roster", "library roster", "A book went missing somewhere in this roster of {pages} pages. "
         "Whose locker was it, and which book?", "Loans", "LOST", "reader", "locker", "L", "item",
         ("atlas", "novel", "manual", "diary", "thesis", "almanac"), ("shelf", "scanner", "printer", "kiosk"),
         "desk-2 loan locker={id} reader={name}", "ok visitors={n}"),
)

# The log task as a twin: its words, so a demonstrated episode of the log shows the log agent's own prompts
# (log_task.SYSTEM is this twin's system prompt).
LOG = Twin("read_log", "log", "log", log_task.QUESTION, "Logins", "ERROR", "user", "session", "S", "reason",
           tuple(log_task.REASONS), tuple(log_task.SERVICES), "auth-1 login session={id} user={name}",
           "ok heartbeat latency={n}ms")
LOG_SEED = 5000  # the log episodes' seeds: the tasks' are 0-63 (train) and 1000-1015 (validation)


def make_record(twin: Twin, rng: random.Random, pages: int) -> tuple[list[str], dict[str, str], str, str]:
    """The record's pages, each name's id, the name whose id the key line names, and the key line."""
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
            # Entries on random lines: a warm start whose entries sat on fixed lines copied those lines of the log,
            # whatever they held, into its summaries.
            for at, name in zip(sorted(rng.sample(range(LINES_PER_PAGE), len(names))), names):
                page[at] = f"{start}:{at:02d}:00 " + twin.entry.format(name=name, id=ids[name])
        if p == pages - 1:
            at = rng.randrange(LINES_PER_PAGE)
            page[at] = (f"{start + p}:{at:02d}:{rng.randrange(60):02d} {rng.choice(twin.units)}-{rng.randrange(1, 5)} "
                        f"{twin.key} {twin.thing}={ids[found]} {twin.attr}={rng.choice(twin.values)}")
            key_line = page[at]
        out.append("\n".join(page))
    return out, ids, found, key_line


def call(twin: Twin, n: int) -> dict:
    return {"role": "assistant", "content": "", "tool_calls": [{
        "id": f"call_{n}", "type": "function", "function": {"name": twin.tool, "arguments": json.dumps({"page": n})}}]}


def result(n: int, pages: list[str]) -> dict:
    return {"role": "tool", "tool_call_id": f"call_{n}", "content": f"Page {n} of {len(pages)}:\n{pages[n - 1]}"}


def episode(rng: random.Random, twin: Twin) -> list[dict]:
    """One demonstrated episode of a twin: its three rows (module docstring)."""
    pages, ids, found, key_line = make_record(twin, rng, PAGES)
    return rows(twin, [twin.schema()], pages, ids, found, key_line)


def log_episode(seed: int, pages: int) -> list[dict]:
    """One demonstrated episode of the log task itself (log_task.make_log, the tool and prompts its agent uses)."""
    record, answer = log_task.make_log(seed, pages)
    found, reason = answer.split()
    ids = {name: id_ for id_, name in re.findall(r"session=(\S+) user=(\w+)", record[0])}
    key_line = next(line for line in record[-1].splitlines() if f" {LOG.key} " in line)
    assert key_line.endswith(f"session={ids[found]} reason={reason}"), (key_line, answer)
    return rows(LOG, [log_task.READ_LOG], record, ids, found, key_line)


def rows(twin: Twin, tools: list[dict], pages: list[str], ids: dict[str, str], found: str,
         key_line: str) -> list[dict]:
    view = [{"role": "system", "content": twin.system},
            {"role": "user", "content": twin.question.format(pages=len(pages))}]
    for n in range(1, PAGES_BEFORE_SUMMARY + 2):
        view += [call(twin, n), result(n, pages)]
    reading = {"tools": tools, "messages": view[:-1]}  # ends with the call the window could not answer
    cut = summary_cut(view)
    rest = range(PAGES_BEFORE_SUMMARY + 1, len(pages) + 1)
    left = f"page {rest[0]}" if len(rest) == 1 else f"pages {' and '.join(map(str, rest))}"
    # The entries are copied as written: the copy a small model makes most reliably, and every fact kept.
    entries = "\n".join(line for line in pages[0].splitlines() if f" {twin.role}=" in line)
    summary = (f"I read pages 1 to {PAGES_BEFORE_SUMMARY} of {len(pages)}. {twin.entries}, as written:\n{entries}\n"
               f"No {twin.key} line yet. Left to do: read {left}, find the {twin.key} line and answer with the "
               f"{twin.role} of its {twin.thing} and its {twin.attr}.")
    summarizing = {"messages": summary_request(view, cut, lambda request: True) + [
        {"role": "assistant", "content": summary}]}
    after, _ = summarized_view(view, cut, summary)
    for n in range(PAGES_BEFORE_SUMMARY + 2, len(pages) + 1):
        after += [call(twin, n), result(n, pages)]
    # The answer copies forward from what finds each fact: the key word to the rest of its line ("ALARM room=R-12
    # cause=smoke"), then the id to the name after it in the summary's entry ("room=R-12 guest=uma").
    fact = key_line.split(f" {twin.key} ", 1)[1]
    value = fact.rsplit("=", 1)[1]
    after.append({"role": "assistant", "content": f"{twin.key} {fact}\n{twin.thing}={ids[found]} {twin.role}={found}\n"
                                                  f"The answer is \\boxed{{{found} {value}}}."})
    return [reading, summarizing, {"tools": tools, "messages": after}]


def demonstrations(count: int, seed: int = 0) -> list[dict]:
    """`count` episodes, every fourth one of the log itself (seeds from LOG_SEED, which no task uses), the others
    of the twins in turn."""
    rng = random.Random(seed)
    out = []
    for i in range(count):
        if i % 4 == 3:
            out += log_episode(LOG_SEED + i, PAGES)
        else:
            out += episode(rng, TWINS[(i - i // 4) % len(TWINS)])
    return out


if __name__ == "__main__":
    out = Path(__file__).parent / "logs" / "demos.jsonl"
    out.write_text("".join(json.dumps(row) + "\n" for row in demonstrations(32)))
    print(f"wrote {out} (32 episodes, 3 rows each: 8 of the log, 24 of its twins)")
