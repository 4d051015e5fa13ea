"""A shop assistant's task: two independent look-ups and a computed answer (`astuner warmstart`'s gather shape).

"What would all the umbrellas in stock cost in EUR?" The agent has two tools, `stock(item)` (how many are in
stock) and `price(item, currency)` (one item's price), and must call both and multiply: the answer is in no tool
result. Stocks and prices are made up (from a hash), so no model knows them. Stocks are 2 to 9 and prices whole
numbers, so the product is arithmetic a 135M model can do in its head; GRPO rewards the whole episode (the calls, the
product, the box), nothing else.
"""

import hashlib
import re

from astuner.task_judge.base_judge import BaseJudge

ITEMS = {"umbrella": "umbrellas", "scarf": "scarves", "kettle": "kettles", "lamp": "lamps", "teapot": "teapots",
         "candle": "candles", "notebook": "notebooks", "backpack": "backpacks", "wallet": "wallets",
         "mug": "mugs", "blanket": "blankets", "cushion": "cushions", "glove": "gloves", "hat": "hats",
         "clock": "clocks", "vase": "vases", "towel": "towels", "basket": "baskets", "mirror": "mirrors",
         "pillow": "pillows", "bowl": "bowls", "spoon": "spoons", "belt": "belts", "torch": "torches",
         "brush": "brushes", "jar": "jars", "rug": "rugs", "sock": "socks", "tray": "trays", "apron": "aprons"}
SINGULAR = {plural: item for item, plural in ITEMS.items()}
CURRENCIES = ("EUR", "USD", "GBP")
SYSTEM = ("You are a shop assistant. Use the tools to find how many of the item are in stock and what one costs in "
          "the currency asked, then multiply and give the total inside \\boxed{}.")


def _hash(*parts: str) -> int:
    return int.from_bytes(hashlib.sha256(":".join(parts).encode()).digest()[:4], "big")


def stock_of(item: str) -> int:
    return 2 + _hash("stock", item) % 8


def price_of(item: str, currency: str) -> int:
    return 2 + _hash("price", item, currency) % 11


def _item(name) -> str | None:
    """The catalogue's item for what the agent passed: any case, singular or plural."""
    text = " ".join(str(name).split()).lower()
    return text if text in ITEMS else SINGULAR.get(text)


def stock(item: str) -> str:
    found = _item(item)
    if found is None:
        return f"We do not sell {item!r}."
    return f"{stock_of(found)} in stock"


def price(item: str, currency: str) -> str:
    found = _item(item)
    if found is None:
        return f"We do not sell {item!r}."
    code = str(currency).strip().upper()
    if code not in CURRENCIES:
        return f"No prices in {currency!r}; the currencies are {', '.join(CURRENCIES)}."
    return f"{price_of(found, code)} {code} each"


BOXED = re.compile(r"\\boxed\{([^}]*)\}")
NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


class TotalJudge(BaseJudge):
    """Reward 1.0 when the last boxed number is the stock times the price, else 0.0: the outcome only."""

    def compute_reward(self, workflow_task, workflow_output):
        boxed = BOXED.findall(str(workflow_output.metadata.get("final_answer") or ""))
        numbers = NUMBER.findall(boxed[-1].replace(",", "")) if boxed else []
        ok = bool(numbers) and abs(float(numbers[-1]) - float(workflow_task.task.metadata["answer"])) < 1e-6
        return float(ok), ok
