"""The algorithms tutorial, measured: validation accuracy and wall time of base, SFT-only, GRPO-only and SFT+GRPO
on the quick-start task with the demo model, and the effect of DAPO dynamic sampling on the quick-start curve.

    python bench/bench_algorithms.py [--work /tmp/astuner_algorithms] [--skip-existing]

Runs, one after another (about 100 minutes on 2 CPU cores), from the repository's own configs:
    sft        tutorial/algorithms/sft.yaml
    grpo       tutorial/quickstart/quickstart.yaml
    sft_grpo   the same from the SFT checkpoint
    dapo       the same with trainer_common.algorithm.filter_groups.enable (max_num_gen_batches 3)
then `astuner eval` of all of them (greedy accuracy, pass@1..4, intervals against the base model), and prints
each run's wall time and validation curve. Not a test: nothing here asserts a number.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
QUICKSTART = REPO / "tutorial" / "quickstart" / "quickstart.yaml"


def runs(work: Path) -> dict[str, list[str]]:
    def out(name: str) -> str:
        return f"astuner.experiment_dir={work / name}"

    return {
        "sft": ["--conf", str(REPO / "tutorial" / "algorithms" / "sft.yaml"), out("sft")],
        "grpo": ["--conf", str(QUICKSTART), out("grpo")],
        "sft_grpo": ["--conf", str(QUICKSTART), out("sft_grpo"), f"astuner.model.path={work / 'sft' / 'global_step_8'}"],
        "dapo": ["--conf", str(QUICKSTART), out("dapo"), "astuner.trainer_common.algorithm.filter_groups.enable=true",
                 "astuner.trainer_common.algorithm.filter_groups.max_num_gen_batches=3"],
    }


def curve(folder: Path, key: str) -> list[tuple[int, float]]:
    rows = [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]
    return [(r["step"], r[key]) for r in rows if key in r]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--work", default="/tmp/astuner_algorithms")
    parser.add_argument("--skip-existing", action="store_true", help="reuse runs whose folder has a checkpoint")
    args = parser.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    subprocess.run([sys.executable, str(REPO / "tutorial" / "algorithms" / "make_data.py")], check=True)
    seconds = {}
    for name, argv in runs(work).items():
        if args.skip_existing and list((work / name).glob("global_step_*")):
            continue
        start = time.perf_counter()
        subprocess.run([sys.executable, "-m", "astuner.cli", *argv], check=True, cwd=work)
        seconds[name] = time.perf_counter() - start
    models = ["base", *(str(max((work / n).glob("global_step_*"), key=lambda p: int(p.name.split("_")[-1])))
                        for n in ("sft", "grpo", "sft_grpo", "dapo"))]
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "astuner.cli", "eval", "--conf", str(QUICKSTART), "--num-repeat", "4",
                    "--out", str(work / "eval"), *[a for m in models for a in ("--model", m)]], check=True, cwd=work)
    seconds["eval"] = time.perf_counter() - start
    print("\nwall time: " + ", ".join(f"{k} {v / 60:.1f} min" for k, v in seconds.items()))
    print("sft validation loss:", curve(work / "sft", "val/loss"))
    for name in ("grpo", "sft_grpo", "dapo"):
        print(f"{name} val/accuracy:", [(s, round(v, 3)) for s, v in curve(work / name, "val/accuracy")])
    gens = [v for _, v in curve(work / "dapo", "train/dynamic_sampling/gen_batches")]
    if gens:
        print(f"dapo rollout batches per step: mean {sum(gens) / len(gens):.2f}, max {max(gens):.0f}")


if __name__ == "__main__":
    main()
