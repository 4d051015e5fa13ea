"""Where the test suite's CPU goes, every process counted: reads a py-spy profile of the main pass.

    pip install py-spy   # not a dependency of astuner
    py-spy record --subprocesses -r 10 -f raw -o suite.txt -- python -m pytest -q -n 2 --dist loadfile
    python bench/suite_profile.py suite.txt [--frame REGEX] [--callers REGEX] [--below REGEX]

py-spy samples each process's Python stacks (the xdist workers, the CLI runs, vLLM's engine processes, Ray's
workers and daemons); its raw output is one line per distinct stack, "process ...;frame;...;frame COUNT". Printed:
the CPU-seconds sampled, the frames that hold the most of it (inclusive: a frame counted once per sample) and the
imports by kind of process. --frame REGEX lists only frames matching it; --callers REGEX the three frames above the
first frame matching it, --below REGEX the two below, by CPU-seconds. Samples are on-CPU stacks only, but a process
in another PID namespace (the Python tool's sandbox) may be sampled while it sleeps: read its rows with care.
"""

from __future__ import annotations

import argparse
import collections
import re
from pathlib import Path

LINE = re.compile(r":\d+\)$")
FRAME = re.compile(r".* \([^()]*:\d+\)$")  # py-spy's "function (file:line)"
KINDS = (("cli_forkserver", "tutorial fork server"), ("default_worker", "Ray worker"), ("ray/", "Ray daemon"),
         ("multiprocessing.spawn", "spawned (vLLM engine, torch workers)"), ("import sys;exec(eval", "xdist worker"),
         ("astuner.cli", "CLI run"))


def stacks(path: Path, rate: float):
    """(process chain, frames without line numbers, CPU-seconds) per line of a py-spy raw profile, read a line at a
    time (tens of MB for a whole pass)."""
    with open(path, errors="replace") as lines:
        for line in lines:
            stack, _, count = line.rstrip("\n").rpartition(" ")
            if not count.isdigit():
                continue  # a process's command line that held a newline: the rest of that stack's first line
            processes, frames = [], []
            for part in stack.split(";"):
                if part.startswith("process "):
                    processes.append(part)
                elif processes and not frames and not FRAME.match(part):  # a command line's own ";"
                    processes[-1] += ";" + part
                else:
                    frames.append(LINE.sub(")", part))
            yield processes, frames, int(count) / rate


def kind(processes: list[str]) -> str:
    last = processes[-1] if processes else ""
    return next((name for key, name in KINDS if key in last), "other")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("profile", type=Path)
    parser.add_argument("--rate", type=float, default=10.0, help="py-spy's samples per second (-r)")
    parser.add_argument("--frame", default="", help="list only frames matching this regular expression")
    parser.add_argument("--callers", help="the callers of the first frame matching this regular expression")
    parser.add_argument("--below", help="what the first frame matching this regular expression calls")
    parser.add_argument("--top", type=int, default=40)
    args = parser.parse_args()
    total, inclusive, imports, around = 0.0, collections.Counter(), collections.Counter(), collections.Counter()
    focus = re.compile(args.callers or args.below) if args.callers or args.below else None
    for processes, frames, seconds in stacks(args.profile, args.rate):
        total += seconds
        for frame in set(frames):
            inclusive[frame] += seconds
        if any(f.startswith("_find_and_load (") for f in frames):
            imports[kind(processes)] += seconds
        at = next((i for i, f in enumerate(frames) if focus.search(f)), None) if focus else None
        if at is not None:
            near = frames[max(0, at - 3):at][::-1] if args.callers else frames[at + 1:at + 3]
            around[" < ".join(near) if args.callers else " > ".join(near) or "(itself)"] += seconds
    print(f"{total:.0f} CPU-seconds sampled")
    if focus:
        for text, seconds in around.most_common(args.top):
            print(f"{seconds:8.1f} s  {text[:300]}")
        return
    print("imports, by kind of process:")
    for name, seconds in imports.most_common():
        print(f"{seconds:8.1f} s  {name}")
    print("frames (inclusive):")
    shown = [(f, s) for f, s in inclusive.most_common() if re.search(args.frame, f)][: args.top]
    for frame, seconds in shown:
        print(f"{seconds:8.1f} s {100 * seconds / total:5.1f} %  {frame[:160]}")


if __name__ == "__main__":
    main()
