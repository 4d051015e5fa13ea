"""A watchdog that names the stuck stage: which stage of a step is running, what it waits on, for how long.

Code that may wait registers what it waits on with `watch(kind, label)` (a context manager; it works in threads
and in asyncio tasks): an episode, a model call, the tool an agent is running, a judge, an environment-service
request, a Ray actor. An item opened inside another (a judge inside an episode) is its child, through a context
variable, so the report can say where the oldest episode is now.

The loop runs each stage of a step (rollout, train, sync, checkpoint, validation) inside `Watchdog.stage`. A
thread polls every `poll_s` seconds:
  - slow: once the step has run longer than `factor` x the median of the completed steps (after `min_steps` of
    them), a warning names the step, the stage, the oldest pending item, where it is now and how long each has
    waited; it repeats each time the step's time doubles. The monitor's progress bar shows the same line.
  - deadline: a stage that runs past `deadline_s` is stopped: the thread running it is interrupted and the stage
    raises StageTimeout with that message, so a hang becomes an error that says where it was.

The stop does not depend on SIGINT, which a run started in the background (`nohup ... &`) ignores and which a
framework may have taken over: a watchdog entered by the main thread installs one handler of its own for
STOP_SIGNAL (a real-time signal that astuner, vLLM, Ray and torch leave alone; torch's c10 takes SIGUSR2, SLURM
sends SIGUSR1/2) for the whole run, and puts the previous disposition back when it exits. The handler raises only
inside a stage that has expired and drops any other delivery (a stop that lands just as its stage ended), so the
handler is never swapped mid-run. It is a handler, never SIG_IGN: exec resets a handled signal to its default in
every child the run starts, whereas an ignored one would be inherited by every later subprocess. The signal, sent
to the main thread, also ends a blocking wait (sleep, select, a lock): the handler raises, so PEP 475's retry does
not happen. A stage run by another thread gets the exception asynchronously, at its next Python instruction, since
only the main thread runs Python signal handlers.
"""

from __future__ import annotations

import contextlib
import contextvars
import ctypes
import itertools
import logging
import signal
import statistics
import threading
import time
from dataclasses import dataclass

from astuner.errors import StageTimeout

log = logging.getLogger(__name__)


@dataclass
class Item:
    kind: str  # "episode", "model call", "tool", "judge", "env service", "actor", ...
    label: str
    started: float
    parent: int | None


_items: dict[int, Item] = {}
_lock = threading.Lock()
_ids = itertools.count(1)
_current: contextvars.ContextVar[int | None] = contextvars.ContextVar("astuner_watch", default=None)


def current_item() -> int | None:
    """The innermost item open in this context (to hand to work that runs in another one)."""
    return _current.get()


@contextlib.contextmanager
def watch(kind: str, label: str, parent: int | None = None):
    """Register `label` as pending while the block runs (nested blocks are its children; `parent`: the item it
    belongs to when it runs in another context, e.g. a model call served over HTTP for an episode)."""
    key = next(_ids)
    with _lock:
        _items[key] = Item(kind, label, time.monotonic(), parent if parent is not None else _current.get())
    token = _current.set(key)
    try:
        yield
    finally:
        _current.reset(token)
        with _lock:
            _items.pop(key, None)
            for orphan in [k for k, it in _items.items() if it.parent == key]:  # items opened for it, not closed
                del _items[orphan]


def open_item(kind: str, label: str, parent: int | None = None) -> int | None:
    """Register an item whose end is known only later (e.g. the tool an agent runs between two model calls);
    close it with `close_item`. None when its parent has ended already (a late call of a finished episode)."""
    key = next(_ids)
    parent = parent if parent is not None else _current.get()
    with _lock:
        if parent is not None and parent not in _items:
            return None
        _items[key] = Item(kind, label, time.monotonic(), parent)
    return key


def close_item(key: int | None) -> None:
    if key is not None:
        with _lock:
            _items.pop(key, None)


def pending(now: float | None = None) -> str:
    """The oldest pending top-level item and where it is now (its newest open descendant), or ''."""
    now = time.monotonic() if now is None else now
    with _lock:
        items = dict(_items)
    if not items:
        return ""
    roots = [k for k, it in items.items() if it.parent not in items]
    oldest = min(roots, key=lambda k: (items[k].started, k))
    text = f"oldest pending: {_describe(items[oldest], now)}"
    leaf, children = oldest, [oldest]
    while children:
        children = [k for k, it in items.items() if it.parent == leaf]
        if children:
            leaf = max(children, key=lambda k: (items[k].started, k))
    if leaf != oldest:
        text += f", now in {_describe(items[leaf], now)}"
    others = len(roots) - 1
    return text + (f" ({others} more pending)" if others else "")


def _describe(item: Item, now: float) -> str:
    return f"{item.kind} {item.label} for {now - item.started:.0f} s"


# The watchdog's own signal (module docstring); None where the platform has neither (Windows).
STOP_SIGNAL: int | None = (signal.SIGRTMIN + 6 if hasattr(signal, "SIGRTMIN")
                           else getattr(signal, "SIGUSR2", None))


class StageDeadline(KeyboardInterrupt):
    """Raised inside a stage the watchdog stops; the stage turns it into StageTimeout. A KeyboardInterrupt, so
    that neither `except Exception` in user code nor asyncio (which re-raises it out of the loop) keeps it."""


def _interrupt(thread_id: int, by_signal: bool) -> None:
    """Raise StageDeadline in the thread running the stage: by STOP_SIGNAL when that thread is the main one and
    the watchdog installed its handler (it ends a blocking call too), else asynchronously (it lands at the thread's
    next Python instruction, so a wait inside C code ends only when it returns)."""
    if by_signal:
        signal.pthread_kill(thread_id, STOP_SIGNAL)
    else:
        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread_id), ctypes.py_object(StageDeadline))


def _install_stop_handler(handler):
    """Install `handler` for STOP_SIGNAL; returns the disposition to put back, or None where it cannot be installed
    (another thread than the main one, no such signal, or a handler set from C, which could not be put back)."""
    if STOP_SIGNAL is None or threading.current_thread() is not threading.main_thread():
        return None
    previous = signal.getsignal(STOP_SIGNAL)
    if previous is None:
        return None
    signal.signal(STOP_SIGNAL, handler)
    return previous


def _restore_stop_handler(previous) -> None:
    """Put `previous` back. A stop sent but not yet delivered is consumed first (blocked, then taken), so it never
    meets the default disposition, which would end the process."""
    if not hasattr(signal, "sigtimedwait"):
        signal.signal(STOP_SIGNAL, previous)
        return
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, {STOP_SIGNAL})
    try:
        signal.sigtimedwait([STOP_SIGNAL], 0)
        signal.signal(STOP_SIGNAL, previous)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)


class Watchdog:
    def __init__(self, factor: float = 3.0, min_steps: int = 2, deadline_s: float | None = None,
                 poll_s: float = 5.0, on_slow=None) -> None:
        if deadline_s is not None:
            poll_s = min(poll_s, deadline_s / 4)  # a deadline is kept to within a quarter of itself
        self.factor, self.min_steps, self.deadline_s, self.poll_s = factor, min_steps, deadline_s, poll_s
        self.on_slow = on_slow  # called with the line (the progress bar), from the watchdog's thread
        self.durations: list[float] = []
        self._step: int | None = None
        self._timing = False  # between step_started and step_finished
        self._step_start = 0.0
        self._stage: str | None = None
        self._stage_start = 0.0
        self._next_warn = 0.0
        self._expired: str | None = None
        self._owner = threading.get_ident()  # the thread running the stages
        self._by_signal = False  # whether the running stage is stopped by STOP_SIGNAL (its handler is installed)
        self._previous_handler = None  # STOP_SIGNAL's disposition before __enter__; None: ours is not installed
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> Watchdog:
        self._previous_handler = _install_stop_handler(self._on_stop_signal)
        self._thread = threading.Thread(target=self._run, name="astuner-watchdog", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.poll_s + 1)
        if self._previous_handler is not None:  # after the join: no stop is sent from here on
            _restore_stop_handler(self._previous_handler)
            self._previous_handler = None

    def _on_stop_signal(self, signum, frame) -> None:
        """STOP_SIGNAL's handler for the run: the stop of an expired stage; any other delivery is dropped (the
        stage ended meanwhile, and raises StageTimeout itself on seeing `_expired`)."""
        if self._stage is not None and self._expired is not None:
            raise StageDeadline

    def step_started(self, step: int) -> None:
        self._step, self._step_start, self._timing = step, time.monotonic(), True
        self._next_warn = 0.0

    def step_finished(self) -> None:
        """The step's own work is done (its validation and checkpoint, if any, still name it but are not timed)."""
        self.durations.append(time.monotonic() - self._step_start)
        self._timing = False

    @contextlib.contextmanager
    def stage(self, name: str):
        """Run one stage of the current step; past `deadline_s` it raises StageTimeout naming what it waited on."""
        by_signal = self._previous_handler is not None and threading.current_thread() is threading.main_thread()
        try:
            with self._lock:
                self._stage, self._stage_start, self._expired = name, time.monotonic(), None
                self._owner, self._by_signal = threading.get_ident(), by_signal
            try:
                yield
            finally:
                with self._lock:  # no interrupt is sent once the stage has ended
                    self._stage = None
        except KeyboardInterrupt:  # also one that landed while the stage was ending
            self._stage = None  # in case it landed in the lock above
            if self._expired is None:
                raise  # the user's Ctrl-C
            raise StageTimeout(self._expired) from None
        if self._expired is not None:  # the interrupt came after the stage's last Python line: still a timeout
            raise StageTimeout(self._expired)

    def status(self, now: float | None = None) -> str:
        """A line: the step, its stage, their times, and the oldest pending item."""
        now = time.monotonic() if now is None else now
        if self._stage is None:
            return ""
        where = f"step {self._step} " if self._step is not None else ""
        text = f"{where}stage {self._stage} for {now - self._stage_start:.0f} s"
        waiting = pending(now)
        return f"{text}; {waiting}" if waiting else text

    def check(self, now: float | None = None) -> None:
        """One poll (the thread calls it every `poll_s`; tests call it directly)."""
        now = time.monotonic() if now is None else now
        stage, started = self._stage, self._stage_start
        if stage is None:
            return
        if self.deadline_s is not None and now - started > self.deadline_s and self._expired is None:
            with self._lock:
                if (self._stage, self._stage_start) != (stage, started):
                    return  # it ended meanwhile
                self._expired = (f"{self.status(now)}: past astuner.trainer_common.stage_timeout_s = "
                                 f"{self.deadline_s:g} s, so the run stops here (raise that key if the stage is "
                                 "only slow)")
                log.error("watchdog: %s", self._expired)
                _interrupt(self._owner, self._by_signal)
            return
        if not self._timing or len(self.durations) < self.min_steps:
            return
        median = statistics.median(self.durations)
        elapsed = now - self._step_start
        threshold = max(self.factor * median, self._next_warn)
        if elapsed > threshold:
            line = (f"{self.status(now)}; the step has run {elapsed:.0f} s, {elapsed / max(median, 1e-9):.1f}x "
                    f"the median step ({median:.0f} s)")
            log.warning("watchdog: %s", line)
            if self.on_slow is not None:
                self.on_slow(line)
            self._next_warn = 2 * elapsed

    def _run(self) -> None:
        while not self._stop.wait(self.poll_s):
            try:
                self.check()
            except Exception as exc:  # a broken report must not stop the run it watches
                log.debug("watchdog poll failed: %s", exc)
