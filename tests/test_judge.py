"""Built-in judges: math equality through math_verify (safe off the main thread) and normalised exact match."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

from astuner.errors import UserError
from astuner.task_judge.base_judge import BaseJudge, ground_truth_of
from astuner.task_judge.exact_match_judge import ExactMatchJudge
from astuner.task_judge.math_answer_as_judge import MathAnswerAsJudge
from astuner.types import Task
from astuner.workflow import WorkflowOutput, WorkflowTask, load_class

REPO = Path(__file__).resolve().parents[1]


def episode(final_answer=None, **metadata):
    task = WorkflowTask(task=Task(task_id="t-0", main_query="q", metadata=metadata))
    output = WorkflowOutput(metadata={} if final_answer is None else {"final_answer": final_answer})
    return task, output


@pytest.fixture(scope="module")
def math_judge():
    judge = MathAnswerAsJudge(None)
    yield judge
    judge.close()


def test_judges_load_by_config_string():
    for spec in (
        "astuner.task_judge.math_answer_as_judge->MathAnswerAsJudge",
        "astuner.task_judge.exact_match_judge->ExactMatchJudge",
    ):
        assert issubclass(load_class(spec), BaseJudge)


def test_base_judge_is_abstract():
    with pytest.raises(TypeError):
        BaseJudge(None)


@pytest.mark.parametrize(
    "prediction, ground_truth, expected",
    [
        ("Adding them up, so the answer is \\boxed{72}", "6 * 12 = 72\n#### 72", (1.0, True)),
        ("so the answer is \\boxed{71}", "6 * 12 = 72\n#### 72", (0.0, False)),
        ("\\boxed{1234}", "Total: 1,000 + 234\n#### 1,234", (1.0, True)),
        ("\\boxed{1,234}", "#### 1234", (1.0, True)),
        ("1,234", "#### 1,234", (1.0, True)),
        ("\\boxed{\\frac{1}{2}}", "0.5", (1.0, True)),
        ("72", "#### 72", (1.0, True)),
        ("73", "#### 72", (0.0, False)),
        ("2\\pi", "2\\pi", (1.0, True)),
        ("\\boxed{2}", "2\\pi", (0.0, False)),
        ("First I thought 5, but the final answer is \\boxed{6}", "6", (1.0, True)),
        ("no number here", "6", (0.0, False)),
    ],
)
def test_math_judge(math_judge, prediction, ground_truth, expected):
    assert math_judge.compute_reward(*episode(prediction, answer=ground_truth)) == expected


def test_math_judge_ground_truth_keys_in_order(math_judge):
    assert math_judge.compute_reward(*episode("\\boxed{5}", ground_truth="5")) == (1.0, True)
    assert math_judge.compute_reward(*episode("\\boxed{5}", solution="so it is $\\boxed{5}$")) == (1.0, True)
    assert math_judge.compute_reward(*episode("\\boxed{5}", answer="5", solution="\\boxed{6}")) == (1.0, True)


def test_math_judge_number_ground_truth(math_judge):
    assert math_judge.compute_reward(*episode("\\boxed{72}", answer=72)) == (1.0, True)


@pytest.mark.parametrize("final_answer", [None, "", "   "])
def test_math_judge_missing_final_answer_scores_zero(math_judge, final_answer):
    assert math_judge.compute_reward(*episode(final_answer, answer="#### 72")) == (0.0, False)


def test_missing_ground_truth_is_user_error(math_judge):
    with pytest.raises(UserError, match="answer, ground_truth, solution"):
        math_judge.compute_reward(*episode("\\boxed{1}", question="q"))


def test_math_judge_in_threads(math_judge):
    results, errors = [], []

    def judge(prediction):
        try:
            results.append(math_judge.compute_reward(*episode(prediction, answer="#### 72")))
        except Exception as exc:  # noqa: BLE001 - the assertion below reports it
            errors.append(exc)

    threads = [threading.Thread(target=judge, args=(p,)) for p in ["\\boxed{72}", "\\boxed{71}", "72"] * 3]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert errors == []
    assert sorted(results) == [(0.0, False)] * 3 + [(1.0, True)] * 6


@pytest.mark.slow
def test_math_judge_times_out_on_runaway_answer_and_recovers():
    # Verifying a power tower never finishes and holds the GIL; the judge must still return, then keep working.
    judge = MathAnswerAsJudge(None, timeout_s=1.5)
    try:
        start = time.monotonic()
        assert judge.compute_reward(*episode("\\boxed{9^{9^{9^{9}}}}", answer="72")) == (0.0, False)
        assert time.monotonic() - start < 30
        assert judge.compute_reward(*episode("\\boxed{72}", answer="72")) == (1.0, True)
    finally:
        judge.close()


def test_gsm8k_ground_truth_reduction():
    task, _ = episode(answer="Half of 4 is 2.\nThen 2 + 70 = 72\n#### 72")
    assert ground_truth_of(task) == "72"
    task, _ = episode(answer=None, ground_truth="  x + 1  ")
    assert ground_truth_of(task) == "x + 1"


@pytest.mark.parametrize(
    "prediction, ground_truth, expected",
    [
        ("Paris", "paris", (1.0, True)),
        ("  The   Eiffel\nTower. ", "the eiffel tower", (1.0, True)),
        ("STRASSE", "straße", (1.0, True)),
        ("72", "reasoning\n#### 72", (1.0, True)),
        ("72.", "72", (1.0, True)),
        ("1234", "1,234", (0.0, False)),
        ("\\boxed{72}", "72", (0.0, False)),
        ("Lyon", "Paris", (0.0, False)),
    ],
)
def test_exact_match(prediction, ground_truth, expected):
    assert ExactMatchJudge(None).compute_reward(*episode(prediction, answer=ground_truth)) == expected


def test_exact_match_missing_final_answer_and_ground_truth():
    judge = ExactMatchJudge(None)
    assert judge.compute_reward(*episode(None, answer="x")) == (0.0, False)
    with pytest.raises(UserError, match="no ground truth"):
        judge.compute_reward(*episode("x"))


@pytest.mark.parametrize(
    "prediction, expected",
    [
        ("The total is \\boxed{18 dollars}.", 1.0),
        ("\\boxed{\\$18}", 1.0),
        ("\\boxed{18\\text{ dollars}}", 1.0),
        ("\\boxed{18 apples and 3 pears}", 0.0),  # not a unit: the numbers stay, and 183 != 18
        ("\\boxed{17 dollars}", 0.0),
    ],
)
def test_math_judge_ignores_units_inside_the_box(math_judge, prediction, expected):
    assert math_judge.compute_reward(*episode(prediction, answer="18")) == (expected, expected == 1.0)


def test_a_sync_judge_can_be_left_behind_without_blocking_the_loop_close():
    import asyncio

    from astuner.task_judge.base_judge import call_judge

    seen = {}

    def judge(x):
        if x < 0:
            raise ValueError("negative")
        return x * 2

    def hung():
        release.wait()

    async def main():
        assert await call_judge(judge, 21) == 42
        with pytest.raises(ValueError, match="negative"):
            await call_judge(judge, -1)
        with pytest.raises(asyncio.TimeoutError):
            await asyncio.wait_for(call_judge(hung), 0.2)  # the await is cancelled, the thread abandoned

    def run():  # as the rollout does: run, then close the loop
        loop = asyncio.new_event_loop()
        loop.run_until_complete(main())
        loop.run_until_complete(loop.shutdown_default_executor())  # nothing of the judge's to wait for
        loop.close()
        seen["closed"] = True

    release = threading.Event()
    runner = threading.Thread(target=run, daemon=True)
    runner.start()
    runner.join(timeout=2.0)
    release.set()  # the abandoned thread's late answer goes to a closed loop, and is dropped
    assert seen.get("closed"), "closing the loop waited for the hung judge"


@pytest.mark.parametrize("answer, reward", [
    ("27 + 6 = 33. The answer is \\boxed{33}.", 1.0),
    ("\\boxed{33}", 1.0),  # right is right, whatever the form
    ("27 + 6 = 34. The answer is \\boxed{34}.", 0.3),  # the asked form, a wrong sum: form credit
    ("\\boxed{34}", 0.0),  # a bare guess computes nothing: no credit (seeds settled on it: see the README)
    ("27 + 6 = 34. The answer is \\boxed{35}.", 0.0),  # the box does not hold the sum it wrote
    ("7 + 6 = 13. The answer is \\boxed{13}.", 0.0),  # another task's sum
    ("27 + 6 = 34. \\boxed{34} or \\boxed{34}", 0.0),  # scattered boxes
    ("27 + 6 = 33.", 0.0),  # no box
])
def test_quickstart_judge(answer, reward):
    judge = load_class(str(REPO / "tutorial/quickstart/boxed_judge.py") + "->BoxedAnswerJudge")(None)
    task = WorkflowTask(task=Task(task_id="add-27-6", main_query="What is 27 + 6? Reply in the form: 27 + 6 = "
                                  "<sum>. The answer is \\boxed{<sum>}.", metadata={"answer": "33"}))
    assert judge.compute_reward(task, WorkflowOutput(metadata={"final_answer": answer}))[0] == reward
