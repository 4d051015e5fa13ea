"""Writes the ferry task's data. Run: python make_data.py

data/train.jsonl   128 crossings to price (the GRPO tasks)
data/val.jsonl     32 others, never trained on (validation and `astuner eval`)
No demonstrations: `astuner warmstart` writes its own, with made-up tools of ferry_fare's shape.
"""

import itertools
import json
import random
from pathlib import Path

from ferry_task import CLASSES, MAX_PASSENGERS, PORTS, QUESTIONS, fare_of

HERE = Path(__file__).parent


def task(port: str, n: int, cabin: str, rng: random.Random) -> dict:
    question = rng.choice(QUESTIONS).format(port=port, n=n, people="passenger" if n == 1 else "passengers",
                                            a="an" if cabin[0] in "aeiou" else "a", cabin=cabin)
    return {"id": f"ferry-{port.lower()}-{n}-{cabin}", "question": question, "port": port, "passengers": n,
            "cabin_class": cabin, "answer": fare_of(port, n, cabin)}


if __name__ == "__main__":
    rng = random.Random(0)
    combos = list(itertools.product(PORTS, range(1, MAX_PASSENGERS + 1), CLASSES))
    rng.shuffle(combos)
    rows = [task(*c, rng) for c in combos[:160]]
    (HERE / "data").mkdir(exist_ok=True)
    for name, part in (("train", rows[:128]), ("val", rows[128:])):
        (HERE / "data" / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in part))
