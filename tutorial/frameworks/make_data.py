"""Writes data/train.jsonl (80 people) and data/val.jsonl (16 others). Run: python make_data.py"""

import json
import random
from pathlib import Path

from code_table import CODES, NAMES, QUESTION

if __name__ == "__main__":
    names = list(NAMES)
    random.Random(0).shuffle(names)
    data = Path(__file__).parent / "data"
    data.mkdir(exist_ok=True)
    for split, part in (("train", names[:80]), ("val", names[80:])):
        with open(data / f"{split}.jsonl", "w") as f:
            for name in part:
                row = {"id": "code-" + name.lower().replace(" ", "-"), "question": QUESTION.format(name=name),
                       "name": name, "answer": CODES[name]}
                f.write(json.dumps(row) + "\n")
