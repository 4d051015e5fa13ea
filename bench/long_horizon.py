"""Long horizons, measured (tutorial/long_horizon/README.md): per step of each run, training success, episodes
cut at the window, compactions and summary length per episode, and validation success where it ran.

    python bench/long_horizon.py --runs tutorial/long_horizon/launcher_record/long_horizon_none \
        tutorial/long_horizon/launcher_record/long_horizon [--png curves.png]

Reads each run folder's metrics.jsonl; runs nothing itself (the README's commands train the runs).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

COLUMNS = (("train/success_rate", "train: success"), ("rollout/cut/window", "cut at the window"),
           ("rollout/context/compactions", "compactions/ep"), ("rollout/context/summary_length", "summary tokens"),
           ("train/turns_per_episode", "calls/ep"), ("val/accuracy", "validation: success"))


def rows_of(folder: Path) -> dict[int, dict]:
    """Each step's metrics, training and validation lines of one step merged."""
    steps: dict[int, dict] = {}
    for line in (folder / "metrics.jsonl").read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            steps.setdefault(row["step"], {}).update(row)
    return steps


def table(folder: Path) -> str:
    steps = rows_of(folder)
    out = [f"{folder.name}:", "| step | " + " | ".join(label for _, label in COLUMNS) + " |",
           "| --- |" + " --- |" * len(COLUMNS)]
    for step in sorted(steps):
        cells = ["" if key not in steps[step] else f"{steps[step][key]:.3g}" for key, _ in COLUMNS]
        out.append(f"| {step} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def plot(folders: list[Path], png: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    for folder in folders:
        steps = rows_of(folder)
        for ax, key in zip(axes, ("train/success_rate", "rollout/cut/window", "rollout/context/summary_length")):
            xs = [s for s in sorted(steps) if key in steps[s]]
            ax.plot(xs, [steps[s][key] for s in xs], marker="o", label=folder.name)
            ax.set(xlabel="step", title=key)
    axes[0].legend()
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    print(f"curves: {png}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", nargs="+", type=Path, required=True)
    parser.add_argument("--png", type=Path)
    args = parser.parse_args()
    for folder in args.runs:
        print(table(folder))
    if args.png:
        plot(args.runs, args.png)


if __name__ == "__main__":
    main()
