"""Writes the agent quick-start's data. Run: python make_data.py

data/train.jsonl   128 people to look up (the GRPO tasks)
data/val.jsonl     32 others, never trained on (validation and `astuner eval`)
data/sft_train.jsonl  32 demonstrations for the SFT warm start: whole episodes (tool calls, tool results, boxed
                      answer) with *other* tools (warmup_tools.py), 8 of them chaining two calls; none shows
                      find_badge or lookup_code
"""

import json
import random
from pathlib import Path

from lookup_task import CODES, NAMES, QUESTION
from warmup_tools import FAMILIES, ROUTES, chained_demonstration

HERE = Path(__file__).parent


def task(name: str) -> dict:
    return {"id": "code-" + name.lower().replace(" ", "-"), "question": QUESTION.format(name=name), "name": name,
            "answer": CODES[name]}


def demonstrations() -> list[dict]:
    rows = []
    for schema, values, system, question, result, answer in FAMILIES:
        tool, argument = schema["function"]["name"], next(iter(schema["function"]["parameters"]["properties"]))
        for x in values:
            call = {"id": "call_0", "type": "function",
                    "function": {"name": tool, "arguments": json.dumps({argument: x})}}
            rows.append({"tools": [schema], "messages": [
                {"role": "system", "content": system},
                {"role": "user", "content": question.format(x=x)},
                {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call_0", "content": result(x)},
                {"role": "assistant", "content": f"The answer is \\boxed{{{answer(x)}}}."}]})
    for route in ROUTES:
        tools, messages = chained_demonstration(route)
        rows.append({"tools": tools, "messages": messages})
    random.Random(0).shuffle(rows)
    return rows


def write(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


if __name__ == "__main__":
    names = list(NAMES)
    random.Random(0).shuffle(names)
    train, val = names[:128], names[128:]
    (HERE / "data").mkdir(exist_ok=True)
    write(HERE / "data" / "train.jsonl", [task(n) for n in train])
    write(HERE / "data" / "val.jsonl", [task(n) for n in val])
    write(HERE / "data" / "sft_train.jsonl", demonstrations())
