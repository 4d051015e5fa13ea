"""The order the test files start in: longest first, so the two workers of scripts/test.sh finish together.

pytest-xdist's `--dist loadfile` hands a worker the next file when it has at most 2 tests left; by default the
queue is sorted by the number of tests in a file, which puts a file of one 90 s test (tests/test_serve_team.py)
last, while the other worker has nothing left to do. Handing out the longest files first (longest processing time
first) leaves the short files to even the two workers out at the end.

A file's seconds come from tests/file_seconds.json (the sum of its tests' setup, call and teardown, from a run of
scripts/test.sh). A file not in it goes first: a new file may be long, and a short one first costs nothing. To
refresh it after a full run:

    ASTUNER_FILE_SECONDS=tests/file_seconds.json bash scripts/test.sh
"""

from __future__ import annotations

import json
from pathlib import Path

SECONDS_FILE = Path(__file__).with_name("file_seconds.json")


def file_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def longest_files_first(nodeids: list[str], seconds: dict[str, float]) -> list[int]:
    """Indices of `nodeids` in running order: files by their seconds, descending (unknown files first, in their
    collected order); a file's own tests keep their order (its fixtures and the loadfile scope rely on it)."""
    first_seen: dict[str, int] = {}
    for i, nodeid in enumerate(nodeids):
        first_seen.setdefault(file_of(nodeid), i)

    def key(i: int):
        name = file_of(nodeids[i])
        return (-seconds.get(name, float("inf")), first_seen[name], i)

    return sorted(range(len(nodeids)), key=key)


def read_seconds(path: Path = SECONDS_FILE) -> dict[str, float]:
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return {}


def seconds_by_file(durations: dict[str, float]) -> dict[str, float]:
    """Per-test seconds (nodeid -> s) summed per file, rounded to 0.1 s, longest first."""
    total: dict[str, float] = {}
    for nodeid, s in durations.items():
        total[file_of(nodeid)] = total.get(file_of(nodeid), 0.0) + s
    return {name: round(s, 1) for name, s in sorted(total.items(), key=lambda kv: -kv[1])}
