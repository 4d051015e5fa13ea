"""Episodes -> training samples: one sample per recorded LLM call, carrying its episode's advantage.

Rules:
  * Only `episode.trainable` episodes take part (failed / timed-out episodes have no trustworthy reward): they
    are left out of the advantage groups as well as of the samples.
  * Advantages are computed per reward unit within its group by the named estimator (`registry.ADV_ESTIMATORS`)
    and broadcast to every sample of the unit. A unit is the calls of one episode served by one model (several
    models: astuner.models / astuner.agents), except that an agent with its own reward
    (`WorkflowOutput.agent_rewards`) forms a unit of its own with that reward; the others take the episode's.
    Its group: the units of one task and one model, (task_id, model). With one model and no agent rewards a unit
    is an episode and a group a task, as in GRPO.
  * Calls with an empty response are dropped (no token to train on); they do not use up a slot below.
  * Subset rule, when an episode has n > k = `max_sample_per_task` remaining calls: keep the calls at indices
        i_j = floor(j * (n - 1) / (k - 1))   for j = 0 .. k-1        (k >= 2)
        i_0 = n - 1                                                (k == 1)
    i.e. the first call, the last call and evenly spaced ones between, in their original order. Because
    n > k the step (n-1)/(k-1) exceeds 1, so the indices are distinct. Example n=7, k=4: [0, 2, 4, 6].
    The rule applies per unit. The episode's weight in the loss does not depend on how many of its calls are kept
    (see `loss.py`).
  * Calls made with `trainable=False` (`ModelTuner.for_agent(name, trainable=False)`) never become samples.
  * `sample_mode` (multi_turn.sample_mode):
      per_call  one sample per call;
      merge     consecutive calls of one agent where call j+1's prompt ids start with call j's prompt + response
                ids are joined into one sample: prompt = the first call's prompt, response = R_1 + X_1 + R_2 + ...
                where X_j are the ids between (tool results, turn markers), with loss_mask 1 on every R and 0 on
                every X. Same tokens, same contexts, same per-token weights (loss.py counts masked tokens), so the
                same gradient from fewer forward passes; calls that do not extend stay separate. Ids are never
                rebuilt from text.
    `max_sample_per_task` counts samples after merging.
  * `Sample.old_logprobs` are the engine's sampling logprobs of the call: there is no separate old-logprob
    forward pass, so the PPO ratio starts at ~1 only if engine and trainer agree (tested elsewhere).
"""

from __future__ import annotations

from dataclasses import dataclass

from astuner.algorithm.registry import get_adv_estimator
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
    sample_mode: str = "per_call",
    constant_advantage: float | None = None,
) -> list[Sample]:
    """Samples of all trainable episodes, episode by episode, calls in order (rules in the module docstring)."""
    if sample_mode not in SAMPLE_MODES:
        raise ValueError(f"sample_mode must be one of {', '.join(SAMPLE_MODES)}, got {sample_mode!r}")
    estimator = get_adv_estimator(adv_estimator)
    units = [u for ep in episodes if ep.trainable for u in reward_units(ep)]
    if constant_advantage is not None:  # rejection-sampling fine-tuning: every kept episode weighs the same
        advantages_U = [constant_advantage] * len(units)
    else:
        advantages_U = estimator([u.reward for u in units], [u.group_id for u in units], norm_by_std=norm_by_std,
                                 epsilon=epsilon)

    samples: list[Sample] = []
    for unit, adv in zip(units, advantages_U):
        calls = [(i, c) for i, c in unit.calls if c.response_ids and c.trainable]
        pieces = [_to_sample(c, adv, unit.episode.episode_uid, i, unit.model) for i, c in calls]
        if sample_mode == "merge":
            pieces = merge_samples(pieces, [c.agent for _, c in calls])
        for i in subset_indices(len(pieces), max_sample_per_task):
            samples.append(pieces[i])
    version = {e.episode_uid: e.policy_version for e in episodes}
    for s in samples:
        s.policy_version = version.get(s.episode_uid, 0)
    return samples


SAMPLE_MODES = ("per_call", "merge")


@dataclass
class RewardUnit:
    """Calls of one episode that share a reward and a model (rules in the module docstring)."""

    episode: Episode
    model: str
    reward: float
    calls: list[tuple[int, LLMCall]]  # (index in the episode, call)

    @property
    def group_id(self) -> tuple[str, str]:
        return self.episode.group_id, self.model


def reward_units(episode: Episode) -> list[RewardUnit]:
    """The episode's reward units, in order of their first call (an episode without calls: one, the policy's)."""
    by_key: dict[tuple[str, str], list[tuple[int, LLMCall]]] = {}
    for i, c in enumerate(episode.calls):
        own = c.agent if c.agent in episode.agent_rewards else ""
        by_key.setdefault((c.model, own), []).append((i, c))
    if not by_key:
        return [RewardUnit(episode, "policy", episode.reward, [])]
    return [RewardUnit(episode, model, episode.agent_rewards[own] if own else episode.reward, calls)
            for (model, own), calls in by_key.items()]


def extends(prefix_ids: list[int], ids: list[int]) -> bool:
    return len(ids) > len(prefix_ids) and ids[: len(prefix_ids)] == prefix_ids


def merge_samples(samples: list[Sample], agents: list[str]) -> list[Sample]:
    """Join consecutive samples of one agent whose prompt extends the previous prompt + response exactly."""
    out: list[Sample] = []
    last_of: dict[str, Sample] = {}  # agents may interleave; each agent's conversation merges on its own
    for s, agent in zip(samples, agents):
        last = last_of.get(agent)
        if (last is not None and last.temperature == s.temperature
                and extends(last.prompt_ids + last.response_ids, s.prompt_ids)):
            gap = s.prompt_ids[len(last.prompt_ids) + len(last.response_ids):]
            mask = last.loss_mask if last.loss_mask is not None else [1] * len(last.response_ids)
            last.response_ids = last.response_ids + gap + s.response_ids
            last.old_logprobs = last.old_logprobs + [0.0] * len(gap) + s.old_logprobs
            if last.teacher_logprobs is not None and s.teacher_logprobs is not None:
                last.teacher_logprobs = last.teacher_logprobs + [0.0] * len(gap) + s.teacher_logprobs
            else:
                last.teacher_logprobs = None
            if last.teacher_topk is not None and s.teacher_topk is not None:
                last.teacher_topk = last.teacher_topk + [[] for _ in gap] + s.teacher_topk
            else:
                last.teacher_topk = None
            last.loss_mask = mask + [0] * len(gap) + [1] * len(s.response_ids)
            last.call_indices = last.call_indices + s.call_indices
            continue
        out.append(s)
        last_of[agent] = s
    return out


def merge_ratio(episodes: list[Episode]) -> float:
    """Fraction of trainable calls whose prompt extends the previous call of the same agent exactly (the calls
    `merge` joins; in per_call mode it says how much merging would save)."""
    total = joined = 0
    for ep in episodes:
        if not ep.trainable:
            continue
        previous: dict[str, LLMCall] = {}
        for c in ep.calls:
            if not (c.response_ids and c.trainable):
                continue
            total += 1
            p = previous.get(c.agent)
            if p is not None and extends(p.prompt_ids + p.response_ids, c.prompt_ids):
                joined += 1
            previous[c.agent] = c
    return joined / total if total else 0.0


def _to_sample(call: LLMCall, advantage: float, episode_uid: str, call_index: int = -1,
               model: str = "policy") -> Sample:
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
        call_indices=[call_index] if call_index >= 0 else [],
        model=model,
        teacher_logprobs=None if call.teacher_logprobs is None else list(call.teacher_logprobs),
        teacher_topk=None if call.teacher_topk is None else [list(p) for p in call.teacher_topk],
    )
