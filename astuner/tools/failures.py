"""An infrastructure failure of a tool (its sandbox could not start) is not a tool result.

Returned to the model as text, such a failure would be trained on: the episode's reward would judge the policy for
an error it did not cause, and a run whose sandbox never starts would train for days on nothing but that error.
So a tool that cannot start raises `ToolInfraError` (a framework that turns exceptions into tool results still
cannot hide it) and records it in the episode's `ToolHealth`, a context variable the rollout sets per episode
(`for_episode`); asyncio tasks and `asyncio.to_thread` carry it into the agent's code. The rollout then flags the
episode (`FLAG_TOOL_INFRA_FAILED`), leaves it out of training, and stops the run when whole batches fail so
(astuner/rollout.py): each batch collects its episodes' records (`for_batch`).
"""

from __future__ import annotations

import contextlib
import contextvars
from dataclasses import dataclass, field
from typing import Iterator


class ToolInfraError(RuntimeError):
    """A tool could not run at all (not the model's code failing): the message quotes why and what to do."""


@dataclass
class ToolHealth:
    """What the tools of one episode met: the infrastructure failures (their messages) and the starts that worked."""

    failures: list[str] = field(default_factory=list)
    started: int = 0


_health: contextvars.ContextVar[ToolHealth | None] = contextvars.ContextVar("astuner_tool_health", default=None)
_batch: contextvars.ContextVar[list[ToolHealth] | None] = contextvars.ContextVar("astuner_tool_batch", default=None)


@contextlib.contextmanager
def for_batch(healths: list[ToolHealth]) -> Iterator[list[ToolHealth]]:
    """Collect into `healths` the record of every episode started inside the block (in tasks created there)."""
    token = _batch.set(healths)
    try:
        yield healths
    finally:
        _batch.reset(token)


@contextlib.contextmanager
def for_episode() -> Iterator[ToolHealth]:
    """The record of the tools an episode runs: tasks created inside the block (the workflow's) report to it."""
    health = ToolHealth()
    batch = _batch.get()
    if batch is not None:
        batch.append(health)
    token = _health.set(health)
    try:
        yield health
    finally:
        _health.reset(token)


def record_failure(error: ToolInfraError) -> ToolInfraError:
    """Note the failure in the running episode's record (none outside an episode) and return it, to raise."""
    health = _health.get()
    if health is not None:
        health.failures.append(str(error))
    return error


def record_start() -> None:
    health = _health.get()
    if health is not None:
        health.started += 1
