"""A task with one three-argument tool, for the generated warm start (`astuner warmstart`).

"What does the ferry from Split cost for 3 passengers in a cabin?" The fare comes only from the tool
`ferry_fare(port, passengers, cabin_class)`: a base fare per port (made up, from a hash, so no model knows it)
times the passengers times the class's factor. An episode succeeds when the agent passes all three arguments, of
their types (a string, an integer, one of four classes), and writes the fare inside \\boxed{}. A call that misses an
argument gets the error back, as a real tool's schema check would say it.
"""

import hashlib
import re

from astuner.task_judge.base_judge import BaseJudge

PORTS = ["Split", "Valletta", "Piraeus", "Palermo", "Tangier", "Stavanger", "Rosslare", "Holyhead", "Dubrovnik",
         "Ancona", "Bastia", "Ibiza"]
CLASSES = {"deck": 1.0, "seat": 1.5, "cabin": 2.5, "suite": 4.0}
MAX_PASSENGERS = 6
SYSTEM = ("You answer questions about ferry fares. Call ferry_fare with the departure port, the number of "
          "passengers and the cabin class the question gives, then give the fare in euros inside \\boxed{}. "
          "Never guess.")
QUESTIONS = ["What does the ferry from {port} cost for {n} {people} in {a} {cabin}?",
             "How much is the ferry fare from {port} for {n} {people}, {cabin} class?"]
MAX_TURNS = 4


def base_fare(port: str) -> int:
    return int.from_bytes(hashlib.sha256(("ferry:" + port).encode()).digest()[:2], "big") % 60 + 20


def fare_of(port: str, passengers: int, cabin_class: str) -> int:
    return round(base_fare(port) * passengers * CLASSES[cabin_class])


def ferry_fare(port: str, passengers: int, cabin_class: str) -> str:
    """The fare of a ferry crossing from a port, for a number of passengers in a cabin class."""
    known = {p.lower(): p for p in PORTS}
    name = known.get(" ".join(str(port).split()).lower())
    if name is None:
        return f"No ferry leaves from {port!r}. Give the departure port as the question names it."
    try:
        count = int(passengers)
    except (TypeError, ValueError):
        return f"passengers must be a whole number, not {passengers!r}."
    if not 1 <= count <= MAX_PASSENGERS:
        return f"A booking takes 1 to {MAX_PASSENGERS} passengers, not {count}."
    if cabin_class not in CLASSES:
        return f"No cabin class {cabin_class!r}; the classes are {', '.join(CLASSES)}."
    return f"The fare from {name} for {count} in {cabin_class} class is {fare_of(name, count, cabin_class)} euros."


TOOL_SCHEMAS = [{"type": "function", "function": {
    "name": "ferry_fare", "description": "The fare of a ferry crossing, in euros.",
    "parameters": {"type": "object", "properties": {
        "port": {"type": "string", "description": "The departure port."},
        "passengers": {"type": "integer", "description": "How many passengers travel.", "minimum": 1,
                       "maximum": MAX_PASSENGERS},
        "cabin_class": {"type": "string", "enum": list(CLASSES), "description": "The cabin class."}},
        "required": ["port", "passengers", "cabin_class"]}}}]
TOOLS = {"ferry_fare": ferry_fare}

BOXED = re.compile(r"\\boxed\{\s*(?:€\s*)?(\d+)(?:\s*euros?)?\s*\}")


class FareJudge(BaseJudge):
    """Reward 1.0 when the last boxed number is the fare, else 0.0: the outcome only."""

    def compute_reward(self, workflow_task, workflow_output):
        boxed = BOXED.findall(str(workflow_output.metadata.get("final_answer") or ""))
        ok = bool(boxed) and int(boxed[-1]) == int(workflow_task.task.metadata["answer"])
        return float(ok), ok
