"""Madness checks: degenerate output is flagged, realistic prose / code / math is not."""

from __future__ import annotations

import random

import pytest

from astuner.madness import MADNESS_CHECKS, CallView, detect_nonsense, run_checks, validate_checklist

PROSE = """Reinforcement learning from verifiable rewards has become a common way to improve reasoning in language
models. Instead of imitating reference answers, the model samples several attempts for each problem, a checker
scores them, and the update pushes probability mass toward attempts that scored above the group average. The
method is simple, but details matter: how advantages are normalised, whether long answers dominate the loss,
and how often the sampling weights are refreshed all change the outcome. In practice, a small learning rate,
a modest group size and careful filtering of broken episodes go a long way."""

CODE = '''def merge_sorted(a: list[int], b: list[int]) -> list[int]:
    """Merge two sorted lists into one sorted list."""
    i = j = 0
    out = []
    while i < len(a) and j < len(b):
        if a[i] <= b[j]:
            out.append(a[i])
            i += 1
        else:
            out.append(b[j])
            j += 1
    out.extend(a[i:])
    out.extend(b[j:])
    return out


def test_merge():
    assert merge_sorted([], []) == []
    assert merge_sorted([1], []) == [1]
    assert merge_sorted([], [2]) == [2]
    assert merge_sorted([1, 3, 5], [2, 4, 6]) == [1, 2, 3, 4, 5, 6]
    assert merge_sorted([1, 1, 1], [1, 1]) == [1, 1, 1, 1, 1]
'''

MATH = r"""We need $x$ such that $3x + 7 = 22$. Subtracting 7 from both sides gives $3x = 15$, so $x = 5$.
Check: $3 \cdot 5 + 7 = 15 + 7 = 22$. For the second part, the identity matrix is
$$I_4 = \begin{pmatrix} 1 & 0 & 0 & 0 \\ 0 & 1 & 0 & 0 \\ 0 & 0 & 1 & 0 \\ 0 & 0 & 0 & 1 \end{pmatrix},$$
and $\det(I_4) = 1$. Summing $1 + 2 + \dots + 10 = \frac{10 \cdot 11}{2} = 55$.
Therefore the answer is \boxed{5}."""

TABLE = """| step | reward | loss |
|------|--------|------|
| 1 | 0.10 | 0.693 |
| 2 | 0.15 | 0.688 |
| 3 | 0.22 | 0.671 |
| 4 | 0.31 | 0.650 |
| 5 | 0.35 | 0.642 |

Steps 1. First, read the task. 2. Then, call the tool. 3. Then, check the result. 4. Finally, answer."""

TOOL_ANSWER = """I will compute it with Python.
<tool_call>
{"name": "execute_python_code", "arguments": {"code": "print(sum(i * i for i in range(1, 101)))"}}
</tool_call>"""

CHINESE = (
    "强化学习通过奖励信号来改进模型的行为。每个问题采样多个回答，然后根据得分调整概率。"
    "最终答案是 \\boxed{42}。"
)


@pytest.fixture(scope="module")
def ids_of(demo_tokenizer):
    return lambda text: demo_tokenizer.encode(text, add_special_tokens=False)


@pytest.fixture(scope="module")
def special(demo_tokenizer):
    return {int(i) for i in demo_tokenizer.added_tokens_decoder}  # ids 0..16, all special in SmolLM2


@pytest.mark.parametrize(
    "text", [PROSE, CODE, MATH, TABLE, TOOL_ANSWER, CHINESE, PROSE + "\n\n" + CODE + "\n" + MATH, "72", ""]
)
def test_normal_text_is_not_flagged(demo_tokenizer, ids_of, special, text):
    eos = demo_tokenizer.eos_token_id
    assert detect_nonsense(ids_of(text) + [eos], text, special, {eos}) is None


def test_leaked_special_token(demo_tokenizer, ids_of, special):
    im_start = demo_tokenizer.convert_tokens_to_ids("<|im_start|>")
    eos = demo_tokenizer.eos_token_id
    ids = ids_of("The answer is 4.") + [im_start] + ids_of("user\nThanks!") + [eos]
    reason = detect_nonsense(ids, "The answer is 4.user\nThanks!", special, {eos})
    assert reason and f"special token id {im_start} " in reason
    # A stop token is only accepted in final position.
    assert detect_nonsense(ids_of("Hi") + [eos] + ids_of("more"), "Himore", special, {eos}) is not None


def test_long_span_loop_even_when_cut_mid_repetition(ids_of, special):
    sentence = " So we add the two numbers together and check the result again."
    text = "Let me think." + sentence * 6
    ids = ids_of(text)[:-3]  # generation stopped by max_tokens in the middle of a repetition
    reason = detect_nonsense(ids, text, special, set())
    assert reason and reason.startswith("looping")


def test_three_repeats_are_tolerated(ids_of, special):
    text = PROSE + " I am sure of it." * 3
    assert detect_nonsense(ids_of(text), text, special, set()) is None


def test_short_period_loop(ids_of, special):
    text = "The answer is" + " the" * 200
    reason = detect_nonsense(ids_of(text), text, special, set())
    assert reason and "looping" in reason


def test_low_diversity(special):
    # Not periodic ("ha ha haha ..."), but 300 tokens drawn from 2 ids.
    rng = random.Random(0)
    ids = [rng.choice([100, 101]) for _ in range(300)]
    reason = detect_nonsense(ids, "x" * 300, special, set())
    assert reason and "distinct tokens" in reason


def test_numeric_data_is_not_low_diversity(ids_of, special):
    text = ",\n".join(f"({i * 37 % 1000}, {i * 91 % 1000}, {i % 3})" for i in range(150))
    ids = ids_of(text)
    assert len(ids) > 1024 and len(set(ids[-1024:])) < 20
    assert detect_nonsense(ids, text, special, set()) is None


def test_garbled_text(ids_of, special):
    text = "Result: " + "\ufffd\x07\ufffd" * 5 + " ok"
    assert "garbled" in detect_nonsense(ids_of("Result: ok"), text, special, set())
    run = "A long and perfectly fine answer. " * 10 + "\ufffd" * 20
    assert "garbled" in detect_nonsense(ids_of("x"), run, special, set())
    # One replacement char from a multi-byte character cut by max_tokens is normal.
    assert detect_nonsense(ids_of("x"), PROSE + "\ufffd", special, set()) is None


def test_registry_and_wrong_toolcall():
    assert set(MADNESS_CHECKS) == {"nonsense", "wrong_toolcall"}
    view = CallView(response_ids=[5, 6], text="hi", tool_errors=["tool call 0: invalid JSON"])
    assert run_checks(("nonsense", "wrong_toolcall"), view) == {"wrong_toolcall": "tool call 0: invalid JSON"}
    assert run_checks(("nonsense",), view) == {}
    with pytest.raises(ValueError, match="available"):
        validate_checklist(["nonsense", "gibberish"])
