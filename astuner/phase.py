"""Long phases said on the console: one that runs past `after_s` (10 s) gets a line saying what it is and how long
it has taken, again every `every_s` (30 s), and a last one when it ends. A short phase says nothing."""

from __future__ import annotations

import contextlib
import sys
import threading
import time


AFTER_S, EVERY_S = 10.0, 30.0


@contextlib.contextmanager
def phase(what: str, after_s: float | None = None, every_s: float | None = None, say=None):
    """`with phase("starting the vLLM engine"): ...`; `say(line)`: where the lines go (default: the console above
    any progress bar, and the run's log)."""
    say = say or _say
    after_s = AFTER_S if after_s is None else after_s
    every_s = EVERY_S if every_s is None else every_s
    done = threading.Event()
    start = time.monotonic()
    spoke = []

    def watch() -> None:
        wait = after_s
        while not done.wait(wait):
            spoke.append(True)
            say(f"{what}: {time.monotonic() - start:.0f} s so far")
            wait = every_s

    watcher = threading.Thread(target=watch, name=f"phase: {what}", daemon=True)
    watcher.start()
    ok = False
    try:
        yield
        ok = True
    finally:
        done.set()
        watcher.join(timeout=5)
        if spoke:
            say(f"{what}: {'done' if ok else 'stopped'} after {time.monotonic() - start:.0f} s")


def _say(line: str) -> None:
    from astuner.logs import announce

    try:
        announce(line)
    except Exception:  # noqa: BLE001 - a progress line must never fail the phase
        print(f"astuner: {line}", file=sys.stderr, flush=True)
