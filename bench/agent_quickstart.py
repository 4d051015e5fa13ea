"""The agent quick-start, measured: does the demo model learn to use its tools, on every seed, and how fast?

    python bench/agent_quickstart.py [--seeds 0 1 2] [--sample-modes merge] [--steps 4] [--test-freq 2]
                                     [--warm-start CHECKPOINT] [--eval] [--out bench_agent_quickstart]
                                     [--workflow 'openai_agent.py->OpenAILookupAgent'] [--add-run FOLDER]
                                     [KEY=VALUE ...]

The recipe of tutorial/agent_quickstart/, stage by stage, each its own `astuner` process:
  1. the SFT warm start (sft.yaml: demonstrations with other tools; none shows the task's own), once, timed;
     skipped with --warm-start;
  2. GRPO from that checkpoint (agent_quickstart.yaml) per sample mode and seed, validation every --test-freq
     steps. Validation lines are stamped with the wall time since that run started (model loading included).
Printed per seed and validation step: validation success (greedy), tool calls per episode, tool-call parse
failures, model calls per episode, generated tokens per episode; then per run the minutes to the targets
(validation success >= 0.8), the final score, and the trainer's seconds per step, whose ratio between sample modes
is the merge speed-up. --eval runs `astuner eval` (greedy success and pass@k) on the base model, the warm start
and each final checkpoint. A PNG of the curves (validation success and tool calls per episode, by step, one line
per run) is written beside results.json when matplotlib is installed. --add-run puts an earlier GRPO run's
folder (same recipe) in the tables, its minutes read from the timestamps of its astuner.log. One run at a time:
two cores.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TUTORIAL = REPO / "tutorial" / "agent_quickstart"
TARGET = 0.8


def run_lr(folder: Path) -> float | None:
    import yaml

    config = folder / "config.yaml"
    return yaml.safe_load(config.read_text())["astuner"]["trainer_common"]["optim"]["lr"] if config.is_file() else None


def astuner(args: list[str], log: Path) -> int:
    with open(log, "w") as out:
        return subprocess.call([sys.executable, "-m", "astuner.cli", *args], stdout=out, stderr=subprocess.STDOUT,
                               env={**os.environ, "PYTHONUNBUFFERED": "1"})


def last_checkpoint(folder: Path) -> Path:
    steps = sorted(folder.glob("global_step_*"), key=lambda p: int(p.name.rsplit("_", 1)[1]))
    if not steps:
        raise SystemExit(f"no checkpoint in {folder}: see the console log beside it")
    return steps[-1]


def warm_start(out: Path) -> tuple[Path, float]:
    folder = out / "sft"
    start = time.perf_counter()
    code = astuner(["--conf", str(TUTORIAL / "sft.yaml"), f"astuner.experiment_dir={folder}"], out / "sft.console.txt")
    if code:
        raise SystemExit(f"the warm start failed (exit {code}): {out / 'sft.console.txt'}")
    return last_checkpoint(folder), (time.perf_counter() - start) / 60


def val_point(row: dict, minutes: float) -> dict:
    calls = row.get("val/turns_per_episode", 0.0)
    return {"step": row["step"], "minutes": minutes, "success": row["val/accuracy"],
            "tool_calls": row.get("val/tool_calls_per_episode", 0.0),
            "parse_failures": row.get("val/tool_call_parse_failure_rate", 0.0), "calls": calls,
            "tokens": row.get("val/response_length", 0.0) * calls}


def grpo(model: Path, mode: str, seed: int, args, out: Path) -> dict:
    name = f"{mode}_seed{seed}"
    folder = out / name
    conf = getattr(args, "conf", None) or TUTORIAL / "agent_quickstart.yaml"
    workflow = [f"astuner.rollout.agentscope_workflow='{args.workflow}'"] if args.workflow else []
    cmd = [sys.executable, "-m", "astuner.cli", "--conf", str(conf),
           f"astuner.model.path={model}", f"astuner.seed={seed}", f"astuner.experiment_dir={folder}",
           f"astuner.rollout.multi_turn.sample_mode={mode}", f"astuner.trainer_common.total_training_steps={args.steps}",
           f"astuner.trainer_common.test_freq={args.test_freq}", "astuner.trainer_common.val_before_train=true",
           *workflow, *args.overrides]
    metrics = folder / "metrics.jsonl"
    curve, train = [], []
    seen, stop_at_target = 0, getattr(args, "stop_at_target", False)
    start = time.perf_counter()
    with open(out / f"{name}.console.txt", "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        while True:
            done = proc.poll() is not None
            lines = metrics.read_text().splitlines() if metrics.is_file() else []
            for line in lines[seen:]:
                row = json.loads(line)
                if "val/accuracy" in row:
                    p = val_point(row, (time.perf_counter() - start) / 60)
                    curve.append(p)
                    print(f"  {name}: step {p['step']:2d}  success {p['success']:.3f}  tool calls/ep "
                          f"{p['tool_calls']:.2f}  parse failures {p['parse_failures']:.3f}  calls/ep "
                          f"{p['calls']:.2f}  tokens/ep {p['tokens']:5.1f}  {p['minutes']:5.1f} min", flush=True)
                    if stop_at_target and p["success"] >= TARGET:
                        proc.terminate()  # the time to the target is what is measured; the rest is not needed
                if "time/train_s" in row:
                    train.append({"step": row["step"], "train_s": row["time/train_s"],
                                  "rollout_s": row.get("time/rollout_s", 0.0),
                                  "train_tokens": row.get("actor/train_tokens", 0.0),
                                  "success": row.get("train/success_rate", 0.0),
                                  "tool_calls": row.get("rollout/tool_call_rate", 0.0),
                                  "parse_failures": row.get("rollout/tool_call_parse_failure_rate", 0.0)})
            seen = len(lines)
            if done:
                break
            time.sleep(2)
    if proc.returncode and not curve:
        raise SystemExit(f"{name} failed (exit {proc.returncode}): {out / (name + '.console.txt')}")
    reached = next((p for p in curve if p["success"] >= TARGET), None)
    final = folder / f"global_step_{curve[-1]['step']}" if curve else None
    return {"mode": mode, "seed": seed, "lr": run_lr(folder), "curve": curve, "train": train, "code": proc.returncode,
            "minutes": (time.perf_counter() - start) / 60, "reached": reached,
            "checkpoint": str(final) if final and final.is_dir() else None}


def adopt(folder: Path) -> dict:
    """An earlier run's folder as grpo() would have returned it (minutes from astuner.log's timestamps)."""
    import yaml

    config = yaml.safe_load((folder / "config.yaml").read_text())["astuner"]
    log = (folder / "astuner.log").read_text().splitlines()
    stamp = lambda line: datetime.datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S.%f")  # noqa: E731
    start = stamp(log[0])
    val_times = {int(m.group(1)): (stamp(line) - start).total_seconds() / 60
                 for line in log if (m := re.search(r"astuner\.loop: step (\d+) validation accuracy", line))}
    curve, train = [], []
    for line in (folder / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        if "val/accuracy" in row:
            curve.append(val_point(row, val_times.get(row["step"], float("nan"))))
        if "time/train_s" in row:
            train.append({"step": row["step"], "train_s": row["time/train_s"], "rollout_s": row.get("time/rollout_s", 0.0)})
    ckpts = sorted(folder.glob("global_step_*"), key=lambda p: int(p.name.rsplit("_", 1)[1]))
    return {"mode": config["rollout"]["multi_turn"]["sample_mode"], "seed": config.get("seed", 0),
            "lr": config["trainer_common"]["optim"]["lr"], "curve": curve,
            "train": train, "code": 0, "minutes": curve[-1]["minutes"] if curve else 0.0,
            "reached": next((p for p in curve if p["success"] >= TARGET), None),
            "checkpoint": str(ckpts[-1]) if ckpts else None}


def plot(results: list[dict], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8))
    for r in results:
        steps = [p["step"] for p in r["curve"]]
        label = f"{r['mode']}, seed {r['seed']}, lr {r['lr']:g}"
        left.plot(steps, [p["success"] for p in r["curve"]], marker="o", label=label)
        right.plot(steps, [p["tool_calls"] for p in r["curve"]], marker="o", label=label)
    left.axhline(TARGET, color="grey", linestyle=":", linewidth=1)
    left.set(title="validation success (greedy); the base model scores 0", xlabel="GRPO step (0: after the warm start)",
             ylim=(-0.02, 1.02))
    right.set(title="tool calls per episode (validation; 2 needed)", xlabel="GRPO step", ylim=(0, 4.2))
    for axis in (left, right):
        axis.xaxis.get_major_locator().set_params(integer=True)
    left.legend(fontsize=8)
    fig.suptitle("Agent quick-start: SmolLM2-135M learns to chain two tools (2 CPU cores)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def evaluate(models: list[str], out: Path) -> str:
    cmd = ["eval", "--conf", str(TUTORIAL / "agent_quickstart.yaml"), "--num-repeat", "4", "--out", str(out / "eval")]
    for m in models:
        cmd += ["--model", m]
    astuner(cmd, out / "eval.console.txt")
    lines = (out / "eval.console.txt").read_text().splitlines()
    table = [ln for ln in lines if ln.split(" ")[0] in ("metric", "tasks") or "/" in ln.split(" ")[0]]
    return "\n".join(table)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, nargs="*", default=[42, 1, 2], help="none: only tabulate --add-run")
    ap.add_argument("--sample-modes", nargs="+", default=["merge"], choices=["merge", "per_call"])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--test-freq", type=int, default=2)
    ap.add_argument("--workflow", default="openai_agent.py->OpenAILookupAgent")
    ap.add_argument("--warm-start", type=Path, help="a checkpoint to start GRPO from (skips stage 1)")
    ap.add_argument("--warm-start-minutes", type=float, default=0.0, help="what that checkpoint's SFT run took")
    ap.add_argument("--eval", action="store_true", help="astuner eval on base, warm start and the final checkpoints")
    ap.add_argument("--out", type=Path, default=Path("bench_agent_quickstart"))
    ap.add_argument("--add-run", type=Path, action="append", default=[], help="an earlier GRPO run's folder")
    ap.add_argument("overrides", nargs="*", help="further KEY=VALUE overrides for every GRPO run")
    args = ap.parse_args()
    args.out = args.out.resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.warm_start:
        model, sft_minutes = args.warm_start.resolve(), args.warm_start_minutes
    else:
        model, sft_minutes = warm_start(args.out)
        print(f"warm start: {model} in {sft_minutes:.1f} min", flush=True)
    results = [adopt(folder.resolve()) for folder in args.add_run]
    for mode in args.sample_modes:
        for seed in args.seeds:
            results.append(grpo(model, mode, seed, args, args.out))
            (args.out / "results.json").write_text(json.dumps(
                {"warm_start": str(model), "sft_minutes": sft_minutes, "runs": results}, indent=1))

    print(f"\nagent quick-start: {args.workflow}, {args.steps} GRPO steps, validation every {args.test_freq}"
          + (f"; {' '.join(args.overrides)}" if args.overrides else ""))
    print("| sample mode | seed | lr | validation success by step | tool calls/ep (first -> last) | "
          f">= {TARGET} reached | final | GRPO wall | trainer s/step |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in results:
        c = r["curve"]
        curve = ", ".join(f"{p['step']}: {p['success']:.2f}" for p in c)
        tools = f"{c[0]['tool_calls']:.2f} -> {c[-1]['tool_calls']:.2f}" if c else "-"
        reached = (f"step {r['reached']['step']}, {r['reached']['minutes']:.1f} min "
                   f"({r['reached']['minutes'] + sft_minutes:.1f} with the warm start)" if r["reached"] else "no")
        train_s = statistics.mean(t["train_s"] for t in r["train"]) if r["train"] else float("nan")
        note = "" if r["code"] == 0 else f" (exit {r['code']})"
        print(f"| {r['mode']} | {r['seed']} | {r['lr']:g} | {curve} | {tools} | {reached} | "
              f"{c[-1]['success'] if c else float('nan'):.3f} | {r['minutes']:.1f} min{note} | {train_s:.1f} |")
    by_mode = {m: [t["train_s"] for r in results if r["mode"] == m for t in r["train"]] for m in args.sample_modes}
    for mode, times in by_mode.items():
        finals = [r["curve"][-1]["success"] for r in results if r["mode"] == mode and r["curve"]]
        if finals and times:
            print(f"{mode}: final success {statistics.mean(finals):.3f} +- "
                  f"{statistics.pstdev(finals) if len(finals) > 1 else 0.0:.3f} over {len(finals)} seeds; trainer "
                  f"{statistics.mean(times):.1f} s/step")
    if all(by_mode.get(m) for m in ("merge", "per_call")):
        print(f"per_call / merge trainer time: {statistics.mean(by_mode['per_call']) / statistics.mean(by_mode['merge']):.2f}x")
    if plot(results, args.out / "agent_quickstart.png"):
        print(f"curves: {args.out / 'agent_quickstart.png'}")
    if args.eval:
        finals = [r["checkpoint"] for r in results if r["checkpoint"]]
        print("\n" + evaluate(["base", str(model), *finals], args.out))


if __name__ == "__main__":
    main()
