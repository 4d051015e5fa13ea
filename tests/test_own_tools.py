"""The own-tools tutorial's task (tutorial/own_tools/): every task can be won through its tool and only with all
three arguments, the judge pays the fare alone, and its agent loop hands a tool's complaint back to the model.
Its README's commands (warm start, GRPO, eval) run as written in tests/test_tutorial_commands.py."""

from __future__ import annotations

import json
import re
from types import SimpleNamespace

import pytest

from conftest import REPO, load_tutorial_module

TUTORIAL = REPO / "tutorial" / "own_tools"


@pytest.fixture
def ferry(monkeypatch):
    monkeypatch.syspath_prepend(str(TUTORIAL))
    return load_tutorial_module("tutorial/own_tools/ferry_task.py", "ferry_task")


def rows(split: str) -> list[dict]:
    return [json.loads(line) for line in (TUTORIAL / "data" / f"{split}.jsonl").read_text().splitlines()]


def test_every_task_is_won_by_the_tool_with_its_three_arguments(ferry):
    train, val = rows("train"), rows("val")
    assert len(train) == 128 and len(val) == 32 and not {r["id"] for r in train} & {r["id"] for r in val}
    for row in train + val:
        text = ferry.ferry_fare(row["port"], row["passengers"], row["cabin_class"])
        assert re.search(rf"is {row['answer']} euros\.$", text), (row, text)
        # The question names all three values; no answer follows from fewer.
        assert row["port"] in row["question"] and str(row["passengers"]) in row["question"]
        assert row["cabin_class"] in row["question"]
    # base fare x passengers x the class's factor (cabin: 2.5)
    assert ferry.fare_of("Split", 2, "cabin") == round(ferry.base_fare("Split") * 2 * 2.5)
    assert ferry.ferry_fare("split", "3", "deck").startswith("The fare from Split for 3 in deck class")
    assert "classes are deck, seat, cabin, suite" in ferry.ferry_fare("Split", 3, "first")
    assert "1 to 6 passengers" in ferry.ferry_fare("Split", 9, "deck")
    assert "No ferry leaves from 'Oslo'" in ferry.ferry_fare("Oslo", 1, "deck")


def test_the_judge_pays_the_boxed_fare_only(ferry):
    judge = ferry.FareJudge.__new__(ferry.FareJudge)
    task = SimpleNamespace(task=SimpleNamespace(metadata={"answer": 345}))

    def reward(text):
        return judge.compute_reward(task, SimpleNamespace(metadata={"final_answer": text}))

    assert reward("The answer is \\boxed{345}.") == (1.0, True)
    assert reward("\\boxed{345 euros}") == (1.0, True)
    assert reward("\\boxed{344}") == (0.0, False)
    assert reward("345") == (0.0, False)
    assert reward(None) == (0.0, False)


def test_the_agent_returns_a_missing_argument_to_the_model(monkeypatch, ferry):
    agent = load_tutorial_module("tutorial/own_tools/ferry_agent.py", "ferry_agent")
    said = agent.call_tool("ferry_fare", json.dumps({"port": "Split", "passengers": 2}))
    assert said.startswith("Error:") and "cabin_class" in said
    assert agent.call_tool("ferry_fare", "not json").startswith("Error:")
    assert "no tool named 'book'" in agent.call_tool("book", "{}")
    assert "is " in agent.call_tool("ferry_fare", json.dumps({"port": "Split", "passengers": 2,
                                                              "cabin_class": "suite"}))
