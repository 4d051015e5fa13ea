"""The rollouts' thread pool: a daemon thread per blocking call, so a call that never returns costs one thread.

Synchronous agents (smolagents, anything an agent runs with `asyncio.to_thread` or `run_in_executor(None, ...)`)
run in the event loop's default executor. A thread cannot be stopped, so an agent stuck in a blocking call past
its episode's deadline keeps its thread. In a ThreadPoolExecutor that thread holds one of a fixed number of
workers: after a few such episodes every later call queues behind them for ever, and the pool's workers are
joined when the loop closes and at interpreter exit, so the run hangs at its end too.

DaemonExecutor starts a daemon thread per call (tens of microseconds, nothing next to an agent's step): no cap to
exhaust, and nothing joins them. It records which episode submitted each running call (`owner`, a context
variable the rollout sets per episode), so that the calls an episode leaves running when it ends can be named,
counted and logged (`abandon`): a leak is visible, not silent. The live count (threads of ended episodes still
running; those that finish are dropped from it) is each episode's `abandoned_threads`, the step's
`rollout/abandoned_threads`, and past `max_abandoned` the run stops with TrainingStalled naming the functions the
threads are stuck in: every stuck thread holds its memory, sockets and files for good, so a leak that grows each
step ends in an out-of-memory kill or exhausted descriptors far from its cause.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextvars
import functools
import logging
import threading
from dataclasses import dataclass

from astuner.errors import TrainingStalled

log = logging.getLogger(__name__)

owner: contextvars.ContextVar[str] = contextvars.ContextVar("astuner_thread_owner", default="")


def _name(fn) -> str:
    """The function's qualified name, through the partials `asyncio.to_thread` wraps it in (`ctx.run, fn`)."""
    while isinstance(fn, functools.partial):
        runs_in_context = getattr(fn.func, "__self__", None).__class__ is contextvars.Context and fn.args
        fn = fn.args[0] if runs_in_context else fn.func
    return getattr(fn, "__qualname__", None) or type(fn).__name__


@dataclass(frozen=True)
class RunningCall:
    owner: str  # the episode that submitted it ("" outside an episode)
    name: str  # the function's qualified name
    thread: threading.Thread


class DaemonExecutor(concurrent.futures.ThreadPoolExecutor):
    """A default executor for asyncio (which takes only a ThreadPoolExecutor; the base class's own workers are
    never started) that runs each call in a new daemon thread and never waits for one."""

    def __init__(self, thread_name_prefix: str = "astuner-episode", max_abandoned: int | None = None,
                 limit_source: str = "") -> None:
        super().__init__(max_workers=1, thread_name_prefix=thread_name_prefix)
        self._prefix = thread_name_prefix
        self.max_abandoned = max_abandoned  # live abandoned threads past which `abandon` stops the run
        self._limit_source = limit_source  # where that limit comes from, for the message
        self._guard = threading.Lock()
        self._calls: dict[concurrent.futures.Future, RunningCall] = {}
        self._abandoned: set[str] = set()  # episodes that ended with calls still running
        self._closed = False
        self._started = 0

    def submit(self, fn, /, *args, **kwargs) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        name = _name(fn)
        with self._guard:
            if self._closed:
                raise RuntimeError("cannot schedule new futures after shutdown")
            self._started += 1
            # The caller's context variables go with the call (as asyncio.to_thread does): the episode it
            # belongs to, for its blocking calls' owner and for where its prints go (logs.EPISODE).
            call = functools.partial(contextvars.copy_context().run, fn)
            thread = threading.Thread(target=self._work, args=(future, call, args, kwargs),
                                      name=f"{self._prefix}_{self._started}", daemon=True)
            self._calls[future] = RunningCall(owner.get(), name, thread)
        thread.start()
        return future

    def _work(self, future: concurrent.futures.Future, fn, args, kwargs) -> None:
        if not future.set_running_or_notify_cancel():
            self._forget(future)
            return
        try:
            result = fn(*args, **kwargs)
        except BaseException as exc:  # noqa: BLE001 - handed to whoever awaits the future
            self._forget(future)  # before the future settles: an awaited call is never counted as left running
            future.set_exception(exc)
        else:
            self._forget(future)
            future.set_result(result)

    def _forget(self, future: concurrent.futures.Future) -> None:
        with self._guard:
            self._calls.pop(future, None)

    def running(self, of: str | None = None) -> list[RunningCall]:
        """The calls still running (those submitted by episode `of`, when given)."""
        with self._guard:
            return [c for c in self._calls.values() if of is None or c.owner == of]

    def abandoned(self) -> list[RunningCall]:
        """Calls still running whose episode has ended: threads that will run on, unwaited for. Episodes whose
        abandoned calls have all finished since are forgotten."""
        with self._guard:
            self._abandoned &= {c.owner for c in self._calls.values()}
            return [c for c in self._calls.values() if c.owner in self._abandoned]

    def abandon(self, episode: str) -> list[RunningCall]:
        """`episode` has ended: its calls still running are abandoned (logged once, with the process's total).
        Raises TrainingStalled when the live total passes `max_abandoned`."""
        left = self.running(episode)
        if left:
            with self._guard:
                self._abandoned.add(episode)
            total = self.abandoned()
            if self.max_abandoned is not None and len(total) > self.max_abandoned:
                stuck = ", ".join(f"{name} ({n})" for name, n in collections.Counter(c.name for c in total)
                                  .most_common(5))
                source = f" ({self._limit_source})" if self._limit_source else ""
                raise TrainingStalled(
                    f"{len(total)} threads of episodes that ended are still running in this process, more than "
                    f"{self.max_abandoned}{source}; they are stuck in {stuck}. A thread cannot be stopped, and "
                    "each one holds its memory and connections for good, so the run stops here. Give that blocking "
                    "call a timeout of its own (a socket or HTTP timeout, subprocess.run(timeout=...)), shorter "
                    "than astuner.rollout.episode_timeout.")
            episodes = sorted({c.owner for c in total})
            log.warning(
                "episode %s ended with %d blocking call(s) still running in worker threads (%s); a thread cannot "
                "be stopped, so it is abandoned and runs on. %d abandoned thread(s) in this process, of episodes "
                "%s. An agent's blocking call (a tool, a sleep, a network call without a timeout) should have a "
                "timeout of its own shorter than astuner.rollout.episode_timeout.",
                episode, len(left), ", ".join(sorted({c.name for c in left})), len(total),
                ", ".join(episodes[:10]) + (f" and {len(episodes) - 10} more" if len(episodes) > 10 else ""))
        return left

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Refuse new calls; never wait for running ones (a stuck one would hang the loop's close and the exit)."""
        with self._guard:
            self._closed = True
