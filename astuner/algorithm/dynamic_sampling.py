"""DAPO dynamic sampling (verl's `algorithm.filter_groups`): train only on groups that carry a signal.

A group (the trainable episodes of one task) whose episodes all got the same value of the metric has
A_e = 0 for every episode under GRPO, Dr. GRPO and RLOO alike: it costs trainer time and, under token-mean
aggregation, dilutes the other groups' gradient. With `filter_groups.enable` the loop keeps

    informative(G)  <=>  |{ m(e) : e in G, e trainable }| >= 2      m = reward ("score") or is_success ("acc")

and rolls out further batches of tasks until `train_batch_size` informative groups are in hand (extra groups of
the last batch are cut), or `max_num_gen_batches` batches have been rolled out (then it trains on what it has and
says so). Unlike verl, a group with a single trainable episode is dropped too: its advantage is 0 here.
Pure Python.
"""

from __future__ import annotations

from astuner.types import Episode

FILTER_METRICS = ("score", "acc")


def _value(episode: Episode, metric: str) -> float:
    if metric == "score":
        return float(episode.reward)
    if metric == "acc":
        return float(bool(episode.is_success))
    raise ValueError(f"unknown filter_groups.metric {metric!r}; available: {', '.join(FILTER_METRICS)}")


def informative_groups(episodes: list[Episode], metric: str) -> list[str]:
    """Group ids (in order of first appearance) whose trainable episodes differ in `metric`."""
    values: dict[str, set[float]] = {}
    order: list[str] = []
    for e in episodes:
        if e.group_id not in values:
            values[e.group_id] = set()
            order.append(e.group_id)
        if e.trainable:
            values[e.group_id].add(_value(e, metric))
    return [g for g in order if len(values[g]) >= 2]


def keep_groups(episodes: list[Episode], group_ids: list[str]) -> list[Episode]:
    """The episodes of `group_ids`, in their original order."""
    wanted = set(group_ids)
    return [e for e in episodes if e.group_id in wanted]
