"""Episodes -> training samples: one sample per recorded LLM call, carrying its episode's advantage.

Rules:
  * Only `episode.trainable` episodes take part (failed / timed-out episodes have no trustworthy reward): they
    are left out of the advantage groups as well as of the samples.
  * Advantages are computed per episode within its group (`episode.group_id`) by the named estimator
    (`advantage.ADV_ESTIMATORS`) and broadcast to every sample of the episode.
  * Calls with an empty response are dropped (no token to train on); they do not use up a slot below.
  * Subset rule, when an episode has n > k = `max_sample_per_task` remaining calls: keep the calls at indices
        i_j = floor(j * (n - 1) / (k - 1))   for j = 0 .. k-1        (k >= 2)
        i_0 = n - 1                                                (k == 1)
    i.e. the first call, the last call and evenly spaced ones between, in their original order. Because
    n > k the step (n-1)/(k-1) exceeds 1, so the indices are distinct. Example n=7, k=4: [0, 2, 4, 6].
    The episode's weight in the loss does not depend on how many of its calls are kept (see `loss.py`).
  * `Sample.old_logprobs` are the engine's sampling logprobs of the call: there is no separate old-logprob
    forward pass, so the PPO ratio starts at ~1 only if engine and trainer agree (tested elsewhere).
"""

from __future__ import annotations

from astuner.algorithm.advantage import get_adv_estimator
from astuner.types import Episode, LLMCall, Sample


def subset_indices(n: int, k: int) -> list[int]:
    """Indices of the calls kept out of n when at most k may be kept (rule in the module docstring)."""
    if k < 1:
        raise ValueError(f"max_sample_per_task must be >= 1, got {k}")
    if n <= k:
        return list(range(n))
    if k == 1:
        return [n - 1]
    return [j * (n - 1) // (k - 1) for j in range(k)]


def episodes_to_samples(
    episodes: list[Episode],
    *,
    adv_estimator: str,
    norm_by_std: bool,
    epsilon: float,
    max_sample_per_task: int,
) -> list[Sample]:
    """Samples of all trainable episodes, episode by episode, calls in order (rules in the module docstring)."""
    estimator = get_adv_estimator(adv_estimator)
    trainable = [ep for ep in episodes if ep.trainable]
    advantages_E = estimator(
        [ep.reward for ep in trainable], [ep.group_id for ep in trainable], norm_by_std=norm_by_std, epsilon=epsilon
    )

    samples: list[Sample] = []
    for ep, adv in zip(trainable, advantages_E):
        calls = [c for c in ep.calls if c.response_ids]
        for i in subset_indices(len(calls), max_sample_per_task):
            samples.append(_to_sample(calls[i], adv, ep.episode_uid))
    return samples


def _to_sample(call: LLMCall, advantage: float, episode_uid: str) -> Sample:
    if len(call.response_logprobs) != len(call.response_ids):
        raise ValueError(
            f"episode {episode_uid}: {len(call.response_ids)} response tokens but "
            f"{len(call.response_logprobs)} logprobs"
        )
    if not call.prompt_ids:
        # The first response token is predicted from the last prompt position: an empty prompt has none.
        raise ValueError(f"episode {episode_uid}: an LLM call with an empty prompt cannot be trained on")
    return Sample(
        prompt_ids=list(call.prompt_ids),
        response_ids=list(call.response_ids),
        old_logprobs=[float(x) for x in call.response_logprobs],
        advantage=float(advantage),
        temperature=float(call.temperature),
        episode_uid=episode_uid,
    )
