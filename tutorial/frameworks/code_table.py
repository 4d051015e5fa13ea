"""The task every framework tutorial shares: look up a person's access code with a tool, then answer with it.

The codes are made up (derived from a hash of the name), so no model knows them: an episode succeeds only when
the agent calls `lookup_code`, reads its result and writes the code inside \\boxed{}. Two model calls at least.
"""

import hashlib
import re

from astuner.task_judge.base_judge import BaseJudge

FIRST = ["Mira", "Tomas", "Ines", "Oskar", "Leila", "Bruno", "Saanvi", "Kofi", "Yara", "Emil", "Noor", "Dario"]
LAST = ["Okafor", "Lindqvist", "Moreau", "Tanaka", "Castillo", "Haddad", "Novak", "Mensah"]
NAMES = [f"{first} {last}" for last in LAST for first in FIRST]  # 96 people
LETTERS = "ABCDEFGHJKLMNPQRSTUVWXYZ"
QUESTION = ("What is the access code of {name}? Look it up with the lookup_code tool, then give the code "
            "inside \\boxed{{}}.")
SYSTEM = "You answer questions about access codes. Use the lookup_code tool; never guess a code."


def code_of(name: str) -> str:
    digest = hashlib.sha256(name.encode()).digest()
    letters = LETTERS[digest[0] % len(LETTERS)] + LETTERS[digest[1] % len(LETTERS)]
    return f"{letters}-{int.from_bytes(digest[2:4], 'big') % 10000:04d}"


CODES = {name: code_of(name) for name in NAMES}


def lookup_code(name: str) -> str:
    """The tool's answer for `name` (case and spacing forgiven)."""
    wanted = " ".join(name.split()).lower()
    for known, code in CODES.items():
        if known.lower() == wanted:
            return f"The access code of {known} is {code}."
    return f"No entry for {name!r}. Use the person's full name."


LOOKUP_SCHEMA = {"type": "function", "function": {
    "name": "lookup_code", "description": "The access code of a person, by full name.",
    "parameters": {"type": "object", "properties": {"name": {"type": "string", "description": "Full name."}},
                   "required": ["name"]}}}

BOXED = re.compile(r"\\boxed\{\s*([A-Z]{2}-\d{4})\s*\}")


class CodeJudge(BaseJudge):
    """1.0 when the last boxed code is the person's code, else 0.0 (no shaping)."""

    def compute_reward(self, workflow_task, workflow_output):
        boxed = BOXED.findall(str(workflow_output.metadata.get("final_answer") or ""))
        ok = bool(boxed) and boxed[-1] == workflow_task.task.metadata["answer"]
        return float(ok), ok
