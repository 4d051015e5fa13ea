"""bench/suite_profile.py reads py-spy's raw profiles: a process whose command line holds ";" (an xdist worker's
`python -c "import sys;exec(...)"`) stays one process, its frames lose their line numbers, counts become seconds."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1] / "bench"
sys.path.insert(0, str(BENCH))

import suite_profile  # noqa: E402

WORKER = 'process 1:"python -m pytest";process 2:"python -u -c import sys;exec(eval(sys.stdin.readline()))";'
RAW = (WORKER + "main (astuner/cli.py:10);_find_and_load (<frozen importlib._bootstrap>:1165);"
       "<module> (torch/__init__.py:3) 20\n"
       + WORKER + "main (astuner/cli.py:12);run (astuner/loop.py:5) 10\n"
       "exec(globals().pop('__code')) /tmp/x.py\" 3\n")


def test_a_command_line_with_semicolons_is_one_process_and_counts_are_seconds(tmp_path):
    profile = tmp_path / "suite.txt"
    profile.write_text(RAW)
    (processes, frames, seconds), second, third = suite_profile.stacks(profile, 10.0)
    assert processes == ['process 1:"python -m pytest"',
                         'process 2:"python -u -c import sys;exec(eval(sys.stdin.readline()))"']
    assert frames == ["main (astuner/cli.py)", "_find_and_load (<frozen importlib._bootstrap>)",
                      "<module> (torch/__init__.py)"] and seconds == 2.0
    assert suite_profile.kind(processes) == "xdist worker" and second[1][-1] == "run (astuner/loop.py)"
    assert third == ([], ["exec(globals().pop('__code')) /tmp/x.py\""], 0.3)  # a stray piece: kept, not lost
    out = subprocess.run([sys.executable, str(BENCH / "suite_profile.py"), str(profile)], capture_output=True,
                         text=True, check=True).stdout
    assert "3 CPU-seconds sampled" in out and "     2.0 s  xdist worker" in out
    assert "     3.0 s  90.9 %  main (astuner/cli.py)" in out  # inclusive: both stacks under it
