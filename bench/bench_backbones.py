"""Step time of the same config on the debug, verl and trinity backbones, and how much of a trinity step's rollout
overlaps the previous step's training.

    python bench/bench_backbones.py [--work /tmp/astuner_backbones] [--steps 5] [--engine hf]

The quick-start (demo model, 135M, fp32 on CPU) with a smaller step (4 tasks x 8 episodes), no validation, on a
local Ray cluster that each Ray run starts for itself:
    debug              one process
    verl               one worker (trainer + engine), cpus_per_worker = all cores
    trinity            one explorer + one trainer, sync_interval 1, sync_offset 0 (on-policy, no overlap)
    trinity_offpolicy  the same with sync_offset 1 (rollout of step s+1 runs while step s trains)
The step time is rollout (for trinity: the wait for the batch) + train + sync, averaged over the steps after the
first (start-up and first-call costs excluded). Not a test: nothing here asserts a number.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
QUICKSTART = REPO / "tutorial" / "quickstart" / "quickstart.yaml"


def configs(cores: int) -> dict[str, tuple[str, list[str]]]:
    half = max(cores / 2, 0.5)
    return {
        "debug": ("debug", []),
        "verl": ("verl", [f"astuner.trainer_common.cpus_per_worker={cores}"]),
        "trinity": ("trinity", [f"astuner.trainer_common.cpus_per_worker={half}"]),
        "trinity_offpolicy": ("trinity", [f"astuner.trainer_common.cpus_per_worker={half}",
                                          "trinity.synchronizer.sync_offset=1"]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", default="/tmp/astuner_backbones")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--engine", default="hf")
    args = parser.parse_args()
    work = Path(args.work)
    cores = os.cpu_count() or 2
    common = [f"astuner.trainer_common.total_training_steps={args.steps}", "astuner.trainer_common.test_freq=999",
              "astuner.trainer_common.val_before_train=false", "astuner.data.train_batch_size=4",
              f"astuner.rollout.engine={args.engine}", "astuner.trainer_common.resume_mode=disable"]
    rows = {}
    for name, (backbone, extra) in configs(cores).items():
        out = work / name
        start = time.perf_counter()
        cmd = [sys.executable, "-m", "astuner.cli", "--conf", str(QUICKSTART), "--backbone", backbone,
               *(["--with-ray"] if backbone != "debug" else []), f"astuner.experiment_dir={out}", *common, *extra]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                       env={**os.environ, "RAY_AUTH_MODE": "disabled"})
        wall = time.perf_counter() - start
        steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()
                 if '"time/train_s"' in line]
        later = steps[1:]
        step_s = [m["time/rollout_s"] + m["time/train_s"] + m["time/sync_s"] for m in later]
        rows[name] = {
            "wall_s": wall,
            "step_s": sum(step_s) / len(step_s),
            "rollout_wait_s": sum(m["time/rollout_s"] for m in later) / len(later),
            "train_s": sum(m["time/train_s"] for m in later) / len(later),
            "overlap": sum(m.get("perf/rollout_overlap_fraction", 0.0) for m in later) / len(later),
            "staleness_max": max(m.get("rollout/staleness_max", 0.0) for m in steps),
        }
        print(f"{name:18s} {json.dumps({k: round(v, 3) for k, v in rows[name].items()})}", flush=True)
    base = rows["debug"]["step_s"]
    print("\nstep time relative to debug:")
    for name, row in rows.items():
        print(f"  {name:18s} {row['step_s']:7.2f} s  x{row['step_s'] / base:.2f}  rollout overlapping training: "
              f"{row['overlap']:.0%}  max staleness {row['staleness_max']:.0f}")


if __name__ == "__main__":
    main()
