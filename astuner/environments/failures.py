"""A failed environment is not a zero.

An environment's own call (a game's reset or step, a service's request, a scorer) that raises or runs past its
deadline says nothing about the model: scored 0 it would teach the policy to avoid whatever it did before the
crash, and a flaky environment would fill its groups with fake zeros. So such a call raises `EnvironmentFailure`
and records it in the episode's `EnvHealth`, a context variable the rollout sets per episode (as
astuner/tools/failures.py does for sandboxes): a framework that turns the exception into a tool result still
cannot hide it. The rollout then:

  * flags the episode `env_failed` (and `failed`): left out of training and of its group's statistics (the GRPO
    mean and standard deviation are over the group's trainable episodes only, algorithm/samples.py);
  * runs it again with a fresh environment (a new workflow instance), same task, same episode id and sampling seed,
    at most `rollout.env_retries` times;
  * counts both per step: `env/failed` (attempts whose environment failed, retried ones included) and
    `env/retried` (attempts run again);
  * stops the run (`TrainingStalled`, naming the environment and its last error) when more than
    ENV_FAILED_SHARE_TO_STOP of a batch's episodes still failed after their retries: the step would train on what
    is left of a broken environment.

Environments call through `call` (sync functions run in a thread under `rollout.env_timeout`) or raise
`failure(...)` themselves; a workflow of yours may do the same for its own environment.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

from astuner.types import FLAG_ENV_FAILED, FLAG_FAILED, Episode

# A batch whose episodes failed their environment, after retries, in more than this share stops the run.
ENV_FAILED_SHARE_TO_STOP = 0.5
# rollout.env_timeout, for a call made outside an episode (a test, a script).
DEFAULT_TIMEOUT_S = 60.0


class EnvironmentFailure(RuntimeError):
    """An environment's call failed (raised or timed out): the infrastructure's failure, not the model's."""

    def __init__(self, environment: str, operation: str, cause: str) -> None:
        super().__init__(f"environment {environment}: {operation} failed: {cause}")
        self.environment = environment
        self.operation = operation
        self.cause = cause


@dataclass
class EnvHealth:
    """What one episode's environment met: its failures, first first; `timeout` is rollout.env_timeout."""

    timeout: float = DEFAULT_TIMEOUT_S
    failures: list[EnvironmentFailure] = field(default_factory=list)


_health: contextvars.ContextVar[EnvHealth | None] = contextvars.ContextVar("astuner_env_health", default=None)


@contextlib.contextmanager
def for_episode(timeout: float = DEFAULT_TIMEOUT_S) -> Iterator[EnvHealth]:
    """The record of an episode's environment: tasks created inside the block (the workflow's) report to it."""
    health = EnvHealth(timeout=timeout)
    token = _health.set(health)
    try:
        yield health
    finally:
        _health.reset(token)


def record(error: EnvironmentFailure) -> EnvironmentFailure:
    """Note `error` in the running episode's record (none outside an episode) and return it, to raise."""
    health = _health.get()
    if health is not None:
        health.failures.append(error)
    return error


def failure(environment: str, operation: str, cause: BaseException | str) -> EnvironmentFailure:
    """An EnvironmentFailure quoting `cause`, recorded (`record`), to raise."""
    text = cause if isinstance(cause, str) else f"{type(cause).__name__}: {cause}"
    return record(EnvironmentFailure(environment, operation, text))


def current_timeout() -> float:
    """The running episode's rollout.env_timeout (DEFAULT_TIMEOUT_S outside an episode)."""
    health = _health.get()
    return health.timeout if health is not None else DEFAULT_TIMEOUT_S


async def call(environment: str, operation: str, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """`fn(*args, **kwargs)` (a sync call of the environment) in a thread, within the episode's
    rollout.env_timeout; whatever it raises, or its running past the deadline (the thread is then abandoned, as a
    stuck agent's is: astuner/daemon_threads.py), is an EnvironmentFailure."""
    timeout = current_timeout()
    job = asyncio.ensure_future(asyncio.to_thread(functools.partial(fn, *args, **kwargs)))
    done, _ = await asyncio.wait({job}, timeout=timeout)
    if not done:
        job.cancel()
        raise failure(environment, operation, f"no answer within {timeout:g}s (astuner.rollout.env_timeout)")
    try:
        return job.result()
    except Exception as exc:  # noqa: BLE001 - the environment's own error, whatever it is, is quoted
        raise failure(environment, operation, exc) from exc


def flag(episode: Episode, health: EnvHealth) -> bool:
    """Flag `episode` env_failed (and failed) from its environment's first failure; False when it had none."""
    if not health.failures:
        return False
    first = str(health.failures[0])
    episode.flags = [f for f in episode.flags if f != FLAG_FAILED] + [FLAG_FAILED, FLAG_ENV_FAILED]
    episode.error = episode.error if episode.error and first in episode.error else first  # the traceback, if any
    episode.error_summary, episode.error_source = first, "environment"
    return True


def env_metrics(episodes: list[Episode], prefix: str = "env") -> dict[str, float]:
    """`<prefix>/failed`: attempts whose environment failed, retried ones included; `<prefix>/retried`: attempts
    run again (each retry follows a failure, so failed = retried + the episodes still failed)."""
    retried = sum(e.env_retries for e in episodes)
    return {f"{prefix}/failed": float(retried + sum(FLAG_ENV_FAILED in e.flags for e in episodes)),
            f"{prefix}/retried": float(retried)}


def dominating_failure(episodes: list[Episode]) -> str | None:
    """Why a batch should stop: more than ENV_FAILED_SHARE_TO_STOP of its episodes failed their environment after
    their retries; the message names the environment and its last error. None otherwise."""
    failed = [e for e in episodes if FLAG_ENV_FAILED in e.flags]
    if not episodes or len(failed) <= ENV_FAILED_SHARE_TO_STOP * len(episodes):
        return None
    return (f"the environment failed in {len(failed)} of {len(episodes)} episodes of this batch, after "
            f"{max(e.env_retries for e in failed)} retries each with a fresh environment (astuner.rollout."
            f"env_retries), so they were not trained on; stopping rather than train on what is left. The last "
            f"error: {failed[-1].error_summary}")
