"""Writes logs/train.jsonl (64 logs) and logs/val.jsonl (16): each a seed, a page count (5) and the answer.
A folder named logs/, not data/: the warm start the README runs from here reads the agent quick-start's data/."""

import json
from pathlib import Path

from log_task import PAGES, QUESTION, make_log


def rows(seeds):
    for seed in seeds:
        _, failed = make_log(seed, PAGES)
        yield {"id": f"log{seed}", "question": QUESTION.format(pages=PAGES), "seed": seed, "pages": PAGES,
               "answer": failed}


if __name__ == "__main__":
    out = Path(__file__).parent / "logs"
    out.mkdir(exist_ok=True)
    for name, seeds in (("train", range(64)), ("val", range(1000, 1016))):
        (out / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows(seeds)))
