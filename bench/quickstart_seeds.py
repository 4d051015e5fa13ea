"""The quick-start (or another tutorial) on several seeds and engines: does it learn on every seed, and how fast?

    python bench/quickstart_seeds.py [--seeds 0 1 2] [--engines vllm hf] [--test-freq 2] [--out bench_quickstart]
                                     [--max-minutes 12] [--conf tutorial/x/x.yaml] [--gain 0.3] [KEY=VALUE ...]

Each (engine, seed) runs `astuner --conf tutorial/quickstart/quickstart.yaml --backbone debug` (or `--conf`) in
its own process with `astuner.seed`, `astuner.rollout.engine` and validation every `--test-freq` steps (extra
KEY=VALUE overrides are passed on). The bench stamps each validation line of metrics.jsonl with the wall time
since the process started (model loading included), so "minutes to +0.3" is what a newcomer waits. It prints
each curve, the step and wall time at which validation accuracy first reaches step 0's + `--gain` (0.3), and the
mean and spread of the final accuracy; `--max-minutes` stops a run that takes longer. Runs one at a time: two
cores, no parallel runs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
QUICKSTART = REPO / "tutorial" / "quickstart" / "quickstart.yaml"


def run_one(engine: str, seed: int, out: Path, test_freq: int, max_minutes: float, extra: list[str],
            conf: Path = QUICKSTART, gain: float = 0.3) -> dict:
    folder = out / f"{engine}_seed{seed}"
    cmd = [sys.executable, "-m", "astuner.cli", "--conf", str(conf), "--backbone", "debug",
           f"astuner.seed={seed}", f"astuner.rollout.engine={engine}", f"astuner.experiment_dir={folder}",
           f"astuner.trainer_common.test_freq={test_freq}", *extra]
    metrics = folder / "metrics.jsonl"
    start = time.perf_counter()
    curve: list[tuple[int, float, float]] = []  # (step, accuracy, minutes since start)
    seen = 0
    log = open(out / f"{engine}_seed{seed}.console.txt", "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    stopped = False
    while True:
        done = proc.poll() is not None
        if metrics.is_file():
            lines = metrics.read_text().splitlines()
            for line in lines[seen:]:
                row = json.loads(line)
                if "val/accuracy" in row:
                    curve.append((row["step"], row["val/accuracy"], (time.perf_counter() - start) / 60))
                    print(f"  {engine} seed {seed}: step {row['step']:2d}  accuracy {row['val/accuracy']:.3f}  "
                          f"{curve[-1][2]:5.1f} min", flush=True)
            seen = len(lines)
        if done:
            break
        if (time.perf_counter() - start) / 60 > max_minutes:
            proc.terminate()
            proc.wait(timeout=60)
            stopped = True
            break
        time.sleep(2)
    log.close()
    wall = (time.perf_counter() - start) / 60
    reached = next(((s, m) for s, a, m in curve if curve and a >= curve[0][1] + gain), None)
    return {"engine": engine, "seed": seed, "curve": curve, "reached": reached, "minutes": wall,
            "stopped": stopped, "code": proc.returncode}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--engines", nargs="+", default=["vllm", "hf"])
    ap.add_argument("--test-freq", type=int, default=2)
    ap.add_argument("--max-minutes", type=float, default=30.0)
    ap.add_argument("--out", type=Path, default=Path("bench_quickstart"))
    ap.add_argument("--conf", type=Path, default=QUICKSTART, help="the tutorial's YAML (default: the quick-start)")
    ap.add_argument("--gain", type=float, default=0.3, help="the gain over step 0 whose first step is reported")
    ap.add_argument("overrides", nargs="*", help="further KEY=VALUE overrides for every run")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    results = []
    for engine in args.engines:
        for seed in args.seeds:
            results.append(run_one(engine, seed, args.out, args.test_freq, args.max_minutes, args.overrides,
                                   args.conf, args.gain))
    (args.out / "results.json").write_text(json.dumps(results, indent=1))
    print(f"\n{args.conf.name}, {' '.join(args.overrides) or 'as shipped'}; validation every {args.test_freq} steps")
    print(f"| engine | seed | curve (step: accuracy) | +{args.gain} reached | final | wall |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in results:
        curve = ", ".join(f"{s}: {a:.2f}" for s, a, _ in r["curve"])
        reached = f"step {r['reached'][0]}, {r['reached'][1]:.1f} min" if r["reached"] else "no"
        final = f"{r['curve'][-1][1]:.3f}" if r["curve"] else "-"
        note = " (stopped)" if r["stopped"] else ("" if r["code"] == 0 else f" (exit {r['code']})")
        print(f"| {r['engine']} | {r['seed']} | {curve} | {reached} | {final} | {r['minutes']:.1f} min{note} |")
    for engine in args.engines:
        finals = [r["curve"][-1][1] for r in results if r["engine"] == engine and r["curve"]]
        times = [r["reached"][1] for r in results if r["engine"] == engine and r["reached"]]
        if finals:
            spread = statistics.pstdev(finals) if len(finals) > 1 else 0.0
            print(f"{engine}: final accuracy {statistics.mean(finals):.3f} +- {spread:.3f} over {len(finals)} "
                  f"seeds; +{args.gain} reached by {len(times)}/{len(finals)}"
                  + (f", slowest at {max(times):.1f} min" if times else ""))


if __name__ == "__main__":
    main()
