"""Advantage estimators (GRPO, Dr. GRPO, RLOO) on hand-computed examples."""

from __future__ import annotations

import pytest

from astuner.algorithm.advantage import grpo_advantages
from astuner.algorithm.dr_grpo import dr_grpo_advantages
from astuner.algorithm.registry import ADV_ESTIMATORS, get_adv_estimator
from astuner.algorithm.rloo import rloo_advantages
from astuner.algorithm.samples import episodes_to_samples
from astuner.types import FLAG_FAILED, FLAG_TIMEOUT, Episode, LLMCall, Task

# Group "a": rewards 1, 0, 0, 1 -> mean 0.5, unbiased std sqrt(1/3) = 0.57735, A = +-0.5 / 0.57735 = +-0.8660254
# Group "b": rewards 2, 4, 6    -> mean 4,   unbiased std sqrt(8/2) = 2,      A = -1, 0, 1
REWARDS = [1.0, 2.0, 0.0, 4.0, 0.0, 6.0, 1.0]
GROUPS = ["a", "b", "a", "b", "a", "b", "a"]


def test_grpo_two_groups_with_std_norm():
    adv = grpo_advantages(REWARDS, GROUPS, norm_by_std=True, epsilon=0.0)
    assert adv == pytest.approx([0.8660254, -1.0, -0.8660254, 0.0, -0.8660254, 1.0, 0.8660254], abs=1e-6)


def test_grpo_two_groups_without_std_norm():
    adv = grpo_advantages(REWARDS, GROUPS, norm_by_std=False, epsilon=1e-6)
    assert adv == pytest.approx([0.5, -2.0, -0.5, 0.0, -0.5, 2.0, 0.5])


def test_epsilon_is_added_to_std():
    # Group "b" with epsilon 1: (r - 4) / (2 + 1).
    adv = grpo_advantages([2.0, 4.0, 6.0], ["b", "b", "b"], norm_by_std=True, epsilon=1.0)
    assert adv == pytest.approx([-2 / 3, 0.0, 2 / 3])


def test_group_of_one_and_constant_group_get_zero():
    adv = grpo_advantages([5.0, 1.0, 1.0], ["solo", "same", "same"], norm_by_std=True, epsilon=1e-6)
    assert adv == [0.0, 0.0, 0.0]
    assert grpo_advantages([], [], norm_by_std=True, epsilon=1e-6) == []


def test_registry():
    assert ADV_ESTIMATORS == {"grpo": grpo_advantages, "dr_grpo": dr_grpo_advantages, "rloo": rloo_advantages}


def test_dr_grpo_never_divides_by_std():
    # Group "a": 1, 0, 0, 1 -> mean 0.5 -> +-0.5 even though norm_by_std=True is passed; "b": 2, 4, 6 -> -2, 0, 2.
    adv = dr_grpo_advantages(REWARDS, GROUPS, norm_by_std=True, epsilon=1e-6)
    assert adv == pytest.approx([0.5, -2.0, -0.5, 0.0, -0.5, 2.0, 0.5])


def test_rloo_leave_one_out_baseline():
    # Group "a" (1, 0, 0, 1): for r=1 the others average 1/3 -> 2/3; for r=0 they average 2/3 -> -2/3.
    # Group "b" (2, 4, 6): 2 - 5 = -3, 4 - 4 = 0, 6 - 3 = 3. Also n/(n-1) * (r - mean): 3/2 * (2 - 4) = -3.
    adv = rloo_advantages(REWARDS, GROUPS)
    assert adv == pytest.approx([2 / 3, -3.0, -2 / 3, 0.0, -2 / 3, 3.0, 2 / 3])
    assert rloo_advantages([5.0, 1.0], ["solo", "other"]) == [0.0, 0.0]
    with pytest.raises(ValueError, match="unknown adv_estimator 'ppo'"):
        get_adv_estimator("ppo")


def _episode(uid: str, reward: float, flags=(), task_id="t1") -> Episode:
    call = LLMCall(prompt_ids=[1, 2], response_ids=[3], response_logprobs=[-0.5], finish_reason="stop", temperature=1.0)
    return Episode(task=Task(task_id, "q"), repeat_index=0, episode_uid=uid, calls=[call], reward=reward,
                   flags=list(flags))


def test_failed_and_timed_out_episodes_leave_the_group():
    # Only rewards 1 and 0 remain: mean 0.5, unbiased std sqrt(0.5) -> A = +-0.5 / 0.7071068 = +-0.7071068.
    episodes = [
        _episode("e1", 1.0),
        _episode("e2", 100.0, flags=[FLAG_FAILED]),
        _episode("e3", 0.0),
        _episode("e4", -50.0, flags=[FLAG_TIMEOUT]),
    ]
    samples = episodes_to_samples(episodes, adv_estimator="grpo", norm_by_std=True, epsilon=0.0, max_sample_per_task=4)
    assert [s.episode_uid for s in samples] == ["e1", "e3"]
    assert [s.advantage for s in samples] == pytest.approx([0.7071068, -0.7071068], abs=1e-6)
