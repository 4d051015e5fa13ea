"""On-policy distillation on the agent quick-start, measured: the demo model (0.000 on the lookup task) learns from
a teacher checkpoint, with no warm start.

    python bench/distillation.py --teacher CHECKPOINT [--seeds 0 1 2] [--steps 8] [--test-freq 2]
                                 [--reward-weight 0 ...] [--stop-at-target] [--out bench_distillation] [KEY=VALUE ...]
    python bench/distillation.py --curves RUN_FOLDER [--png curves.png]
    python bench/distillation.py --versus RESULTS_JSON ... [--draws DRAWS_JSON] [--png versus.png]

Per seed and distill_reward_weight, one `astuner` process of tutorial/distillation/distillation.yaml from the demo
model (bench/agent_quickstart.py's grpo(): validation, greedy, before training and every --test-freq steps, each
point stamped with the minutes since the run started, model loading included). Printed: the curve, the minutes to
0.8 validation success (--stop-at-target ends the run there), and per step the reverse KL to the teacher;
results.json beside. --curves prints a run folder's curves by step (also one extended by a resumed run) and draws
them (--png). Compare with the warm start + GRPO recipe of bench/warmstart_seeds.py
(tutorial/agent_quickstart/README.md); --versus draws runs' curves in minutes beside that recipe's measured draws
(tutorial/distillation/warmstart_grpo_draws.json). One run at a time.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from agent_quickstart import TARGET, grpo  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
CONF = REPO / "tutorial" / "distillation" / "distillation.yaml"


def _pyplot():
    """matplotlib's pyplot on the file-only backend (the figures are written, never shown)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def reverse_kl(folder: Path) -> list[tuple[int, float]]:
    rows = [json.loads(x) for x in (folder / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return [(r["step"], r["distill/reverse_kl"]) for r in rows if "distill/reverse_kl" in r]


def curves(folder: Path, png: Path | None) -> None:
    """Per step: the reverse KL, the training episodes' tool calls and success; validation where it ran."""
    rows = [json.loads(x) for x in (folder / "metrics.jsonl").read_text().splitlines() if x.strip()]
    train = {r["step"]: r for r in rows if "distill/reverse_kl" in r}
    val = {r["step"]: r for r in rows if "val/accuracy" in r}
    print("| step | reverse KL | train: tool calls/ep | train: success | validation: success | validation: tool "
          "calls/ep |")
    print("| --- | --- | --- | --- | --- | --- |")
    for step in sorted(set(train) | set(val)):
        t, v = train.get(step, {}), val.get(step, {})
        cell = lambda row, key: "" if key not in row else f"{row[key]:.3f}"  # noqa: E731
        print(f"| {step} | {cell(t, 'distill/reverse_kl')} | {cell(t, 'train/tool_calls_per_episode')} | "
              f"{cell(t, 'train/success_rate')} | {cell(v, 'val/accuracy')} | {cell(v, 'val/tool_calls_per_episode')} |")
    if png is None:
        return
    plt = _pyplot()
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.6))
    steps = sorted(train)
    a.plot(steps, [train[s]["distill/reverse_kl"] for s in steps], marker="o")
    a.set(xlabel="step", ylabel="reverse KL to the teacher (nats/token)", title="distill/reverse_kl")
    vs = sorted(val)
    b.plot(vs, [val[s]["val/accuracy"] for s in vs], marker="o", label="validation success")
    b.plot(steps, [train[s]["train/tool_calls_per_episode"] / 4 for s in steps], marker=".",
           label="training tool calls per episode / 4")
    b.set(xlabel="step", ylim=(-0.05, 1.05), title="the student")
    b.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    print(f"curves: {png}")


def versus(results: list[Path], draws: Path, png: Path) -> None:
    """Greedy validation success against minutes from the start: the distillation runs of `results` (results.json
    files this bench wrote) beside the warm start + GRPO draws of `draws` (a JSON list of measured draws)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 4))
    baseline = json.loads(draws.read_text())["draws"]
    for k, draw in enumerate(baseline):
        ax.plot([0, draw["warm_start_min"], draw["total_min"]], [0.0, draw["warm_start_success"], draw["success"]],
                color="0.6", ls="--", marker="s",
                label=f"warm start, then 2 GRPO steps ({len(baseline)} draws)" if k == 0 else None)
    labels: set[str] = set()
    for path in results:
        for run in json.loads(path.read_text()):
            curve, label = run["curve"], f"distillation, seed {run['seed']}"
            label += " (again)" if label in labels else ""
            labels.add(label)
            ax.plot([p["minutes"] for p in curve], [p["success"] for p in curve], marker="o", label=label)
    ax.axhline(TARGET, color="k", lw=0.8, ls=":")
    ax.set(xlabel="minutes from the start (2 cores)", ylabel="greedy validation success", ylim=(-0.05, 1.05),
           title="the agent quick-start's student: distillation beside its warm start + GRPO")
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    print(f"curves: {png}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--curves", type=Path, help="print (and with --png draw) the curves of this run folder")
    ap.add_argument("--png", type=Path)
    ap.add_argument("--versus", type=Path, nargs="+", help="results.json files to draw beside --draws (--png)")
    ap.add_argument("--draws", type=Path, default=REPO / "tutorial" / "distillation" / "warmstart_grpo_draws.json")
    ap.add_argument("--teacher", type=Path)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--test-freq", type=int, default=2)
    ap.add_argument("--reward-weight", type=float, nargs="+", default=[0.0])
    ap.add_argument("--out", type=Path, default=Path("bench_distillation"))
    ap.add_argument("--stop-at-target", action="store_true", help="end each run at its first validation >= target")
    ap.add_argument("overrides", nargs="*", help="further KEY=VALUE overrides for every run")
    args = ap.parse_args()
    if args.curves:
        curves(args.curves, args.png)
        return
    if args.versus:
        versus(args.versus, args.draws, args.png or Path("distillation_versus.png"))
        return
    if args.teacher is None:
        ap.error("--teacher CHECKPOINT is required (or --curves RUN_FOLDER)")
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    runs = []
    for weight in args.reward_weight:
        for seed in args.seeds:
            run_args = argparse.Namespace(
                conf=CONF, workflow=None, steps=args.steps, test_freq=args.test_freq,
                stop_at_target=args.stop_at_target,
                overrides=[f"astuner.teacher.model={args.teacher.resolve()}",
                           f"astuner.trainer_common.algorithm.distill_reward_weight={weight}", *args.overrides])
            folder = out / f"reward_weight_{weight:g}"
            folder.mkdir(exist_ok=True)
            run = grpo("demo:smollm2-135m-instruct", "merge", seed, run_args, folder)
            run["reward_weight"], run["reverse_kl"] = weight, reverse_kl(folder / f"merge_seed{seed}")
            runs.append(run)
            (out / "results.json").write_text(json.dumps(runs, indent=1))
    print("\n| reward weight | seed | validation success by step | reverse KL by step | to >= 0.8 | wall |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in runs:
        curve = ", ".join(f"{p['step']}: {p['success']:.2f}" for p in r["curve"])
        kl = ", ".join(f"{s}: {v:.3f}" for s, v in r["reverse_kl"])
        reached = f"step {r['reached']['step']}, {r['reached']['minutes']:.1f} min" if r["reached"] else "-"
        print(f"| {r['reward_weight']:g} | {r['seed']} | {curve} | {kl} | {reached} | {r['minutes']:.1f} min |")
    print(f"(target: validation success >= {TARGET})")


if __name__ == "__main__":
    main()
