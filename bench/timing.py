"""Timing shared by the benchmarks (run as `python bench/<name>.py`, so this folder is on sys.path)."""

from __future__ import annotations

import time


def best_of(fn, repeats: int) -> float:
    """Seconds of the fastest of `repeats` calls, after one warm-up call (first-call allocations, kernel choice)."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)
