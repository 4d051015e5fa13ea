"""Writes the shop task's data. Run: python make_data.py

data/train.jsonl   200 questions (the GRPO tasks)
data/val.jsonl     32 questions on (item, currency) pairs never trained on (validation and `astuner eval`)
"""

import itertools
import json
import random
from pathlib import Path

from shop_task import CURRENCIES, ITEMS, price_of, stock_of

HERE = Path(__file__).parent
QUESTIONS = ["What would all the {plural} in stock cost in {currency}?",
             "How much are all the {plural} we have in stock worth in {currency}?",
             "If a customer bought every {item} in stock, what would they pay in {currency}?",
             "What is the total price in {currency} of the {plural} in stock?"]


def task(item: str, currency: str, template: int) -> dict:
    question = QUESTIONS[template].format(item=item, plural=ITEMS[item], currency=currency)
    return {"id": f"shop-{item}-{currency.lower()}-{template}", "question": question, "item": item,
            "currency": currency, "answer": stock_of(item) * price_of(item, currency)}


if __name__ == "__main__":
    rng = random.Random(0)
    pairs = list(itertools.product(ITEMS, CURRENCIES))
    rng.shuffle(pairs)
    val = [task(item, currency, rng.randrange(len(QUESTIONS))) for item, currency in pairs[:32]]
    train = [task(item, currency, t) for (item, currency), t in itertools.product(pairs[32:], range(len(QUESTIONS)))]
    rng.shuffle(train)
    (HERE / "data").mkdir(exist_ok=True)
    for name, rows in (("train", train[:200]), ("val", val)):
        (HERE / "data" / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
