"""Demonstrations for a warm start that fits the user's tools, with none of the user's tools in them.

`demonstrations(tools, count, seed)` is pure and seeded: from the OpenAI function schemas an agent offers, it writes
chat episodes (the `offline_data` jsonl rows of `algorithm.type: sft`: {"tools": [...], "messages": [...]}) with
*made-up* tools of the same argument shapes. A twin of a tool keeps, argument by argument, the JSON type, whether
it is required, enum-ness (with other values, as many), nested objects and arrays (recursively), and numeric
bounds; its names, descriptions and values come from the vocabulary of `tool_demo_twins.py` (where the twins are
made), never from the user's schema. So SFT teaches the protocol the user's tools need (every argument, of the
right type, under the schema's own names, read from the question; a result read back and passed on; a final
answer), and GRPO still has the task to learn.

Episodes, in the shape of the hand-written ones of tutorial/agent_quickstart/warmup_tools.py:
  single  system, question, one call to the one twin offered, its result, the boxed answer
  chain   two twins offered; the first one's result, an identifier, is the value of one argument of the second
          (the tutorial's flight -> gate, the lookup task's name -> badge -> code)
  gather  two twins offered and both called; their results are numbers, and the answer is computed from them (a
          product or a sum, written out before the box): "gather, then compute", as a shop assistant multiplies
          the stock by the price
A new set of twins is drawn for every episode, so the model learns to read names from the schema, not to recall
them. Optional arguments are passed in about half the calls, and the question names only what is passed.

Three choices, from what warm-started models did on the agent quick-start (two tools to chain; its README has the
figures): a single-call episode offers only its tool (when every twin was offered, a second tool could go unused,
and the model answered after its first call); what a chain passes on is an identifier (four digits, or LL999), as
a badge or an order number is, not a word like "olive"; and a question that gives one value gives it bare half the
time (`asked`), so the argument's name is read from the schema, not copied from the question.
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import replace
from typing import Any

from astuner.offline.tool_demo_twins import (
    LETTERS,
    Slot,
    Twin,
    _named,
    listed,
    make_twin,
    user_vocabulary,
    with_identifier,
    with_slot,
)
from astuner.offline.tool_schema import kind_of, plain_parameters

SYSTEMS_SINGLE = [
    "You answer questions with tools. Call {tool} with the values the question gives, then give the {noun} "
    "inside \\boxed{{}}.",
    "You answer questions with the tools you are given. Call the right tool with every value the question gives, "
    "under the names its schema uses, then give the answer inside \\boxed{{}}.",
]
SYSTEM_CHAIN = ("You answer questions with tools. First call {first} with the values the question gives, then call "
                "{second} with the {carried} it returns and the other values the question gives, then give the "
                "{noun} inside \\boxed{{}}.")
ANSWER = "The answer is \\boxed{{{}}}."
SYSTEM_GATHER = ("You answer questions with tools. Call {first} and {second} with the values the question gives, then "
                 "compute the answer from their results and give it inside \\boxed{{}}.")
# How a gathered number comes back: tools word their results every way ("8 in stock", "price: 9"), and a model
# that saw one wording only took any other for no result and called again (measured on tutorial/shop).
GATHER_RESULTS = ("The {noun} is {value}.", "{value}", "{noun}: {value}", "{value} ({noun})")
# What a gathered result is: a count (an integer) or an amount (one decimal), and how two combine.
GATHER_OPS = {"product": ("times", "*", lambda a, b: a * b), "sum": ("plus", "+", lambda a, b: a + b)}


def draw_value(slot: Slot, rng: random.Random, optional_rate: float = 0.5) -> Any:
    """A value of the slot's schema; an object passes each optional property with probability `optional_rate`."""
    if slot.kind in ("string", "any", "enum"):
        return rng.choice(slot.pool)
    if slot.kind == "integer":
        return rng.randint(int(slot.low), int(slot.high))
    if slot.kind == "number":
        return min(max(round(rng.uniform(slot.low, slot.high), 1), slot.low), slot.high)
    if slot.kind == "boolean":
        return rng.random() < 0.5
    if slot.kind == "null":
        return None
    if slot.kind == "array":
        low = int(slot.schema.get("minItems", 1))
        high = max(low, min(int(slot.schema.get("maxItems", 3)), low + 2))
        drawn: list = []
        for _ in range(rng.randint(low, high)):
            for _ in range(8):  # distinct items while the pool has them: "the stops Osaka and Osaka" reads wrong
                value = draw_value(slot.items, rng, optional_rate)
                if value not in drawn:
                    break
            drawn.append(value)
        return drawn
    return {f.name: draw_value(f, rng, optional_rate) for f in slot.fields
            if f.name in slot.required or rng.random() < optional_rate}


def say(slot: Slot, value: Any) -> str:
    """How a question gives `value` for the slot: "the city Osaka", "with express delivery", "the parcel (...)"."""
    if slot.kind == "boolean":
        return f"{'with' if value else 'without'} {slot.words}"
    if slot.kind == "object":
        return f"the {slot.words} ({say_all(slot.fields, value)})"
    if slot.kind == "array":
        parts = [say_item(slot.items, v) for v in value]
        return f"the {slot.words} " + listed(parts, "(none)")
    return f"the {slot.words} {_text(value)}"


def say_item(slot: Slot, value: Any) -> str:
    if slot.kind == "object":
        return f"({say_all(slot.fields, value)})"
    if slot.kind == "array":
        return "[" + ", ".join(say_item(slot.items, v) for v in value) + "]"
    return _text(value)


def say_all(fields: tuple[Slot, ...], values: dict) -> str:
    parts = [say(f, values[f.name]) for f in fields if f.name in values]
    return listed(parts, "nothing")


def asked(groups: list[tuple[tuple[Slot, ...], dict]], rng: random.Random, bare_share: float = 0.5) -> str:
    """How a question gives the values of `groups` ((fields, values) of each tool called): each one named ("the
    planet Mars and the quantity 3"), or, when it gives a single scalar, in `bare_share` of the episodes the value
    alone ("Mars"). Real questions seldom name the argument ("the access code of Mira Okafor"); a model whose
    every demonstration named it learnt to copy an argument name from the question, and took a word of the tool's
    name when the question had none (measured: `find_badge(badge=...)` in every episode of one draw)."""
    given = [(f, values[f.name]) for fields, values in groups for f in fields if f.name in values]
    if len(given) == 1 and given[0][0].kind in ("string", "number", "integer", "enum") and rng.random() < bare_share:
        return _text(given[0][1])
    return " and ".join(say_all(fields, values) for fields, values in groups if any(f.name in values for f in fields))


def bare(groups: list[tuple[tuple[Slot, ...], dict]], rng: random.Random, share: float = 0.5) -> str | None:
    """In `share` of the episodes whose values are all scalars, the values alone ("kimono and east"), each to be
    matched to its argument by the schema, as "the scarves in stock, in GBP" leaves the model to do; else None."""
    given = [(f, values[f.name]) for fields, values in groups for f in fields if f.name in values]
    if not given or any(f.kind not in ("string", "number", "integer", "enum") for f, _ in given):
        return None
    if rng.random() >= share:
        return None
    return listed([_text(v) for _, v in given])


def _text(value: Any) -> str:
    return "null" if value is None else json.dumps(value) if isinstance(value, bool) else str(value)


def _digest(*parts: Any) -> int:
    return int.from_bytes(hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).digest()[:6], "big")


def result_value(twin: Twin, arguments: dict, slot: Slot | None = None) -> Any:
    """What a twin returns for these arguments: a value for `slot` (a chain passes it on), else a code."""
    h = _digest(twin.name, arguments)
    if slot is None:
        return f"{LETTERS[h % 24]}{LETTERS[h // 24 % 24]}-{h // 576 % 9000 + 1000}"
    if slot.kind == "integer":
        return int(slot.low) + h % (int(slot.high) - int(slot.low) + 1)
    if slot.kind == "number":
        return round(slot.low + (h % 10_000) / 10_000 * (slot.high - slot.low), 1)
    if slot.kind == "boolean":
        return bool(h % 2)
    return slot.pool[h % len(slot.pool)]


def _call_id(index: int) -> str:
    return f"call{index:05d}"  # nine letters and digits: the ids Mistral's template accepts, fine for all others


def _call(index: int, twin: Twin, arguments: dict) -> dict:
    return {"id": _call_id(index), "type": "function",
            "function": {"name": twin.name, "arguments": json.dumps(arguments, ensure_ascii=False)}}


def _episode(system: str, question: str, steps: list[tuple[Twin, dict, str]], answer: Any, offered: list[Twin],
             answer_format: str) -> dict:
    messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
    for i, (twin, arguments, result) in enumerate(steps):
        messages.append({"role": "assistant", "content": "", "tool_calls": [_call(i, twin, arguments)]})
        messages.append({"role": "tool", "tool_call_id": _call_id(i), "content": result})
    messages.append({"role": "assistant", "content": answer_format.format(_text(answer))})
    return {"tools": [t.offered() for t in offered], "messages": messages}


def _passable(twin: Twin) -> list[Slot]:
    """Top-level arguments a chain can fill with an earlier tool's result: scalars, the required ones if any."""
    scalars = [s for s in twin.args.fields if s.kind in ("string", "integer", "number", "enum")]
    return [s for s in scalars if s.name in twin.args.required] or scalars


def default_chain_share(tools: list[dict]) -> float:
    """Half the episodes chain two calls when the agent offers several tools, none when it offers one.

    Measured on the agent quick-start (two tools that must be chained; 32 demonstrations, greedy success on its 32
    validation tasks after the SFT): with a quarter of chains the demonstrations of seed 0 gave 0.00 (the model
    answers after one call); with half, those of seeds 0, 1 and 42 gave 0.28, 0.69 and 0.00. With one tool, a
    chain would teach calling it twice."""
    return 0.5 if len(tools) > 1 else 0.0


def demonstrations(tools: list[dict], count: int = 32, seed: int = 0, chain_share: float | None = None,
                   answer_format: str = ANSWER, gather_share: float = 0.0) -> list[dict]:
    """`count` episodes ({"tools", "messages"} rows) with made-up twins of `tools` (module docstring); a share
    `chain_share` of them (default_chain_share when None) chains two calls when some twin has a scalar argument
    to pass a result to, and a share `gather_share` gathers two numbers and computes the answer. The same
    arguments always give the same rows."""
    if not tools:
        raise ValueError("no tool schemas to make demonstrations for")
    if chain_share is None:
        chain_share = default_chain_share(tools)
    for name, share in (("chain_share", chain_share), ("gather_share", gather_share)):
        if not 0.0 <= share <= 1.0:
            raise ValueError(f"{name} is a share of the episodes, between 0 and 1, not {share}")
    if chain_share + gather_share > 1.0:
        raise ValueError(f"chain_share {chain_share} and gather_share {gather_share} add up to more than every episode")
    banned = user_vocabulary(tools)
    rng = random.Random(seed)
    chains = round(count * chain_share)
    gathers = round(count * gather_share)
    rows = []
    for i in range(count):
        names: set[str] = set()
        offered = [make_twin(t, rng, banned, names) for t in tools]
        if i < chains:
            row = _chain(offered, tools, rng, banned, names, answer_format)
            if row is not None:
                rows.append(row)
                continue
        elif i < chains + gathers:
            rows.append(_gather(offered, tools, rng, banned, names, answer_format))
            continue
        twin = offered[i % len(offered)]
        offered = [twin]  # one tool offered, one called: with several offered, the chains are the episodes
        arguments = draw_value(twin.args, rng)
        question = f"What is the {twin.noun} for {asked([(twin.args.fields, arguments)], rng) or 'nothing'}?"
        answer = result_value(twin, arguments)
        system = rng.choice(SYSTEMS_SINGLE).format(tool=twin.name, noun=twin.noun)
        rows.append(_episode(system, question, [(twin, arguments, f"The {twin.noun} is {answer}.")], answer,
                             offered, answer_format))
    random.Random(seed).shuffle(rows)
    return rows


def _chain(offered: list[Twin], tools: list[dict], rng: random.Random, banned: frozenset[str], names: set[str],
           answer_format: str) -> dict | None:
    """A two-call episode: the first twin's result is the value of a scalar argument of the second."""
    seconds = [t for t in offered if _passable(t)]
    if not seconds:
        return None
    second = rng.choice(seconds)
    carried = rng.choice(_passable(second))
    if carried.kind == "string":  # what one tool hands another is most often an identifier: a number, a code
        second, carried = with_identifier(second, carried, rng, banned)
        offered = [second if t.name == second.name else t for t in offered]
    others = [t for t in offered if t is not second]
    if not others:  # one tool: a second twin of the same shape gives the value
        others = [make_twin(tools[0], rng, banned, names)]
        offered = [*offered, others[0]]
    first = rng.choice(others)
    # The first tool gives what the second one takes: its name and description say so.
    renamed = replace(_named(first.args, (carried.name, carried.words), rng, banned, names), like=first.like)
    offered = [renamed if t is first else t for t in offered]
    first = renamed
    first_args = draw_value(first.args, rng)
    passed = result_value(first, first_args, carried)
    second_args = draw_value(second.args, rng)
    second_args[carried.name] = passed
    answer = result_value(second, second_args)
    told = tuple(s for s in second.args.fields if s.name != carried.name)
    given = asked([(first.args.fields, first_args), (told, second_args)], rng)
    question = f"What is the {second.noun} for {given or 'this'}?"
    system = SYSTEM_CHAIN.format(first=first.name, second=second.name, carried=carried.words, noun=second.noun)
    steps = [(first, first_args, f"The {carried.words} is {_text(passed)}."),
             (second, second_args, f"The {second.noun} is {answer}.")]
    return _episode(system, question, steps, answer, offered, answer_format)


def _gathered(twin: Twin, arguments: dict, as_count: bool) -> float | int:
    """A gathered result: a count (2 to 40) or an amount with one decimal (0.5 to 99.5), fixed by the arguments."""
    h = _digest("gather", twin.name, arguments)
    return 2 + h % 39 if as_count else (5 + h % 991) / 10


def _number(value: float) -> str:
    return f"{round(value, 2):.10g}"


def _gather(offered: list[Twin], tools: list[dict], rng: random.Random, banned: frozenset[str], names: set[str],
            answer_format: str) -> dict:
    """A two-call episode whose answer is computed: both twins are called with values the question gives, each
    returns a number, and the answer combines them (GATHER_OPS), the arithmetic written out before the box. One
    tool: a second twin of the same shape is the other look-up. When the user's two tools share an argument name
    (a shop's `stock(item)` and `price(item, currency)`), the twins share that argument too, and the question gives
    its value once for both calls."""
    if len(offered) < 2:
        offered = [*offered, make_twin(tools[0], rng, banned, names)]
    i, j = rng.sample(range(len(offered)), 2)
    shared = shared_arguments(tools[i], tools[j]) if i < len(tools) and j < len(tools) else []
    if shared and len(offered[i].args.fields) > len(offered[j].args.fields):
        # The tool that takes fewer arguments first, so the second call adds to the first's: called the other way,
        # the model carried the extra argument into the smaller call, which the framework refused ("stock() got an
        # unexpected keyword argument 'currency'", measured on tutorial/shop), and had one number left.
        i, j = j, i
        shared = [(b, a) for a, b in shared]
    first, second = offered[i], offered[j]
    for a, b in shared:
        second = with_slot(second, second.args.fields[b], first.args.fields[a])
    offered = [second if k == j else t for k, t in enumerate(offered)]
    first_args, second_args = draw_value(first.args, rng), draw_value(second.args, rng)
    for a, _ in shared:
        name = first.args.fields[a].name
        if name in first_args:
            second_args[name] = first_args[name]
        else:
            second_args.pop(name, None)
    a, b = _gathered(first, first_args, True), _gathered(second, second_args, rng.random() < 0.5)
    op = rng.choice(sorted(GATHER_OPS))
    word, sign, combine = GATHER_OPS[op]
    answer = _number(combine(a, b))
    if shared:
        said = {first.args.fields[k].name for k, _ in shared}
        rest = tuple(f for f in second.args.fields if f.name not in said)
        groups = [(first.args.fields, first_args), (rest, second_args)]
        given = bare(groups, rng) or asked(groups, rng)
        question = f"What is the {first.noun} {word} the {second.noun} for {given or 'this'}?"
    else:
        question = (f"What is the {first.noun} for {asked([(first.args.fields, first_args)], rng) or 'this'} {word} "
                    f"the {second.noun} for {asked([(second.args.fields, second_args)], rng) or 'this'}?")
    system = SYSTEM_GATHER.format(first=first.name, second=second.name)
    steps = [(first, first_args, rng.choice(GATHER_RESULTS).format(noun=first.noun, value=_number(a))),
             (second, second_args, rng.choice(GATHER_RESULTS).format(noun=second.noun, value=_number(b)))]
    row = _episode(system, question, steps, answer, offered, answer_format)
    last = row["messages"][-1]
    last["content"] = f"{_number(a)} {sign} {_number(b)} = {answer}. {last['content']}"
    return row


SCALARS = ("string", "integer", "number", "enum", "boolean")


def shared_arguments(one: dict, other: dict) -> list[tuple[int, int]]:
    """(position in `one`, position in `other`) of the top-level arguments the two tools name alike and type
    alike: the twins' fields are the tools' properties in order, so the positions carry over."""
    ours, theirs = plain_parameters(one)[0].get("properties") or {}, plain_parameters(other)[0].get("properties") or {}
    names = list(theirs)
    return [(k, names.index(n)) for k, (n, sub) in enumerate(ours.items())
            if n in theirs and kind_of(sub) in SCALARS and kind_of(sub) == kind_of(theirs[n])]


def answers_are_computed(answers: list, tool_results: list[str], tools: list[dict]) -> bool:
    """Whether the judge's answers look computed from tool results rather than read from one: the agent offers
    several tools, most answers are numbers, and (when the dry run saw tool results at all) most numeric answers
    appear in none of them. A single tool's number is read, not computed (a unit converter's answer)."""
    numbers = [str(a).strip() for a in answers if _is_number(a)]
    if len(tools) < 2 or not answers or 2 * len(numbers) <= len(answers):
        return False
    if not tool_results:
        return True
    seen = sum(any(n in text for text in tool_results) for n in numbers)
    return 2 * seen < len(numbers)


def _is_number(value: Any) -> bool:
    if isinstance(value, bool):
        return False
    try:
        float(str(value).replace(",", "").strip())
        return True
    except ValueError:
        return False
