"""Writes the demonstrations and preference pairs of this tutorial from the quick-start's training tasks.

data/sft_train.jsonl   16 conversations: the quick-start question and a correct, boxed answer
data/sft_val.jsonl     32 others, for the validation loss
data/dpo_train.jsonl   the same 16 questions as preference pairs: chosen = the boxed answer, rejected = the
                       unboxed one the demo model tends to write (for algorithm.type dpo or orpo)
Validation tasks (the quick-start's val.jsonl) are never used here. Run: python make_data.py
"""

import json
from pathlib import Path

HERE = Path(__file__).parent
TASKS = HERE.parent / "quickstart" / "data" / "train.jsonl"


def answer(question: str, total: str, boxed: bool = True) -> str:
    a, b = question.removeprefix("What is ").split("?")[0].split(" + ")
    return f"{a} + {b} = {total}." + (f" The answer is \\boxed{{{total}}}." if boxed else "")


def write(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


if __name__ == "__main__":
    tasks = [json.loads(line) for line in TASKS.read_text().splitlines()]
    (HERE / "data").mkdir(exist_ok=True)

    def conversation(t):
        return {"messages": [{"role": "user", "content": t["question"]},
                             {"role": "assistant", "content": answer(t["question"], t["answer"])}]}

    write(HERE / "data" / "sft_train.jsonl", [conversation(t) for t in tasks[:16]])
    write(HERE / "data" / "sft_val.jsonl", [conversation(t) for t in tasks[16:48]])
    write(HERE / "data" / "dpo_train.jsonl", [
        {"prompt": [{"role": "user", "content": t["question"]}],
         "chosen": [{"role": "assistant", "content": answer(t["question"], t["answer"])}],
         "rejected": [{"role": "assistant", "content": answer(t["question"], t["answer"], boxed=False)}]}
        for t in tasks[:16]])
