"""Episodes -> samples: subset rule, empty responses, advantage broadcast, copied fields."""

from __future__ import annotations

import pytest

from astuner.algorithm.samples import episodes_to_samples, subset_indices
from astuner.types import Episode, LLMCall, Task


def _call(tag: int, n_tokens: int = 2, temperature: float = 0.7) -> LLMCall:
    return LLMCall(
        prompt_ids=[100 + tag],
        response_ids=[tag] * n_tokens,
        response_logprobs=[-0.1 * tag] * n_tokens,
        finish_reason="stop",
        temperature=temperature,
    )


def _episode(uid: str, task_id: str, reward: float, calls: list[LLMCall]) -> Episode:
    return Episode(task=Task(task_id, "q"), repeat_index=0, episode_uid=uid, calls=calls, reward=reward)


def _to_samples(episodes, max_sample_per_task=4):
    return episodes_to_samples(
        episodes, adv_estimator="grpo", norm_by_std=False, epsilon=1e-6, max_sample_per_task=max_sample_per_task
    )


def test_subset_indices_exact():
    assert subset_indices(7, 4) == [0, 2, 4, 6]
    assert subset_indices(10, 4) == [0, 3, 6, 9]
    assert subset_indices(6, 4) == [0, 1, 3, 5]
    assert subset_indices(5, 3) == [0, 2, 4]
    assert subset_indices(5, 1) == [4]
    assert subset_indices(3, 4) == [0, 1, 2]
    with pytest.raises(ValueError):
        subset_indices(3, 0)


def test_seven_calls_max_four_keeps_first_evenly_spaced_and_last():
    ep = _episode("e1", "t", 1.0, [_call(i) for i in range(7)])
    other = _episode("e2", "t", 0.0, [_call(9)])
    samples = _to_samples([ep, other], max_sample_per_task=4)
    assert [s.response_ids[0] for s in samples if s.episode_uid == "e1"] == [0, 2, 4, 6]


def test_empty_responses_dropped_before_subset():
    calls = [_call(1, n_tokens=0), _call(2), _call(3, n_tokens=0), _call(4), _call(5)]
    ep = _episode("e1", "t", 1.0, calls)
    samples = _to_samples([ep], max_sample_per_task=2)
    # Non-empty calls 2, 4, 5 -> subset of 3 with k=2 keeps indices [0, 2] -> calls 2 and 5.
    assert [s.response_ids[0] for s in samples] == [2, 5]


def test_advantage_broadcast_and_fields():
    # Group t: rewards 3 and 1 -> mean 2 -> A = +1, -1 (no std norm). Group u: single episode -> 0.
    e1 = _episode("e1", "t", 3.0, [_call(1), _call(2, n_tokens=3, temperature=0.0)])
    e2 = _episode("e2", "t", 1.0, [_call(3)])
    e3 = _episode("e3", "u", 7.0, [_call(4)])
    samples = _to_samples([e1, e2, e3])
    assert [(s.episode_uid, s.advantage) for s in samples] == [("e1", 1.0), ("e1", 1.0), ("e2", -1.0), ("e3", 0.0)]
    s = samples[1]
    assert s.prompt_ids == [102] and s.response_ids == [2, 2, 2]
    assert s.old_logprobs == pytest.approx([-0.2, -0.2, -0.2])
    assert s.temperature == 0.0


def test_mismatched_logprobs_rejected():
    bad = LLMCall(prompt_ids=[1], response_ids=[2, 3], response_logprobs=[-0.1], finish_reason="stop", temperature=1.0)
    with pytest.raises(ValueError, match="logprobs"):
        _to_samples([_episode("e1", "t", 1.0, [bad])])
