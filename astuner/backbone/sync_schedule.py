"""When the trinity backbone's explorers may roll out a batch and when they get new weights. Pure, no Ray.

Versions: the trainer's version is the number of steps it has trained; an explorer holds version v when its
weights are those after trainer step v (0: the initial model). The batch of loop step s is trained by the
trainer at version s - 1, so a batch rolled out at version v has

    staleness = (s - 1) - v        (0: on-policy)

and may start only while staleness <= bound, where

    bound = max_staleness                           if set
          = sync_interval - 1 + sync_offset         otherwise.

Syncs: style "fixed" pushes the trainer's weights after every step t with t % sync_interval == 0; both styles
also push when a batch that is due cannot start within the bound and the trainer has the version it needs
("dynamic_by_explorer" syncs only then). With sync_interval 1 and sync_offset 0 the bound is 0: each batch
waits for the previous step's weights, which is the debug and verl backbones' order.

The bound itself is `astuner.config.derived.staleness_bound`: the config's rules read it too (rollout_is_cap
acts only with a bound above 0), and the config sits below the backbones.
"""

from __future__ import annotations

from dataclasses import dataclass

SYNC_STYLES = ("fixed", "dynamic_by_explorer")


def needed_version(step: int, bound: int) -> int:
    """The oldest explorer version allowed to roll out the batch of loop step `step`."""
    return max(0, step - 1 - bound)


@dataclass
class SyncSchedule:
    sync_interval: int
    bound: int
    style: str = "fixed"
    lookahead: int = 0  # batches beyond the current one that may be rolled out early: the bound, at most

    def __post_init__(self) -> None:
        if self.style not in SYNC_STYLES:
            raise ValueError(f"sync_style must be one of {', '.join(SYNC_STYLES)}, got {self.style!r}")
        self.lookahead = self.bound

    def scheduled_sync(self, trainer_version: int) -> bool:
        """Push weights after this trainer step on the fixed schedule."""
        return self.style == "fixed" and trainer_version % self.sync_interval == 0

    def may_start(self, step: int, explorer_version: int) -> bool:
        return explorer_version >= needed_version(step, self.bound)

    def sync_needed_for(self, step: int, explorer_version: int, trainer_version: int) -> bool:
        """The batch of `step` is due but too stale on the explorer's weights, and the trainer has newer ones."""
        return not self.may_start(step, explorer_version) and trainer_version > explorer_version
