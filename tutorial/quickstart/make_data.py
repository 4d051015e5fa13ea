"""Writes data/train.jsonl and data/val.jsonl: two-number additions whose answer must be given in \\boxed{}.

The 135M demo model writes "a + b = <sum>." and gets the sum right about half the time, but it rarely goes on to
box the sum as the prompt asks (about 2% of answers succeed at step 0). GRPO teaches it to finish the answer,
which makes learning visible within minutes on a CPU. Run: python make_data.py
"""

import json
import random
from pathlib import Path

PROMPT = "What is {a} + {b}? Reply in the form: {a} + {b} = <sum>. The answer is \\boxed{{<sum>}}."


def rows(rng: random.Random, n: int, seen: set) -> list[dict]:
    out = []
    while len(out) < n:
        a, b = rng.randint(1, 30), rng.randint(1, 30)
        if (a, b) in seen:
            continue
        seen.add((a, b))
        out.append({"id": f"add-{a}-{b}", "question": PROMPT.format(a=a, b=b), "answer": str(a + b)})
    return out


if __name__ == "__main__":
    rng = random.Random(0)
    seen: set = set()
    data = Path(__file__).parent / "data"
    data.mkdir(exist_ok=True)
    # Validation pairs are disjoint from training pairs.
    for name, n in (("val", 64), ("train", 512)):
        with open(data / f"{name}.jsonl", "w") as f:
            for row in rows(rng, n, seen):
                f.write(json.dumps(row) + "\n")
