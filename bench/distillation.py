"""On-policy distillation on the agent quick-start, measured: the demo model (0.000 on the lookup task) learns from
a teacher checkpoint, with no warm start.

    python bench/distillation.py --teacher CHECKPOINT [--seeds 0 1 2] [--steps 8] [--test-freq 2]
                                 [--reward-weight 0 ...] [--out bench_distillation] [KEY=VALUE ...]
    python bench/distillation.py --curves RUN_FOLDER [--png curves.png]

Per seed and distill_reward_weight, one `astuner` process of tutorial/distillation/distillation.yaml from the demo
model (bench/agent_quickstart.py's grpo(): validation, greedy, before training and every --test-freq steps, each
point stamped with the minutes since the run started, model loading included). Printed: the curve, the minutes to
0.8 validation success, and per step the reverse KL to the teacher; results.json beside. --curves prints a run
folder's curves by step (also one extended by a resumed run) and draws them (--png). Compare with the warm
start + GRPO recipe of bench/warmstart_seeds.py (tutorial/agent_quickstart/README.md). One run at a time.
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
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--curves", type=Path, help="print (and with --png draw) the curves of this run folder")
    ap.add_argument("--png", type=Path)
    ap.add_argument("--teacher", type=Path)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--test-freq", type=int, default=2)
    ap.add_argument("--reward-weight", type=float, nargs="+", default=[0.0])
    ap.add_argument("--out", type=Path, default=Path("bench_distillation"))
    ap.add_argument("overrides", nargs="*", help="further KEY=VALUE overrides for every run")
    args = ap.parse_args()
    if args.curves:
        curves(args.curves, args.png)
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
