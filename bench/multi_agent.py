"""The multi-agent tutorial, measured: do both agents (finder, keeper; each its own model) learn, and how fast?

    python bench/multi_agent.py [--conf tutorial/multi_agent/two_agents.yaml] [--warm-start CHECKPOINT
                                 --warm-start-minutes M] [--steps 6] [--test-freq 2] [--out bench_multi_agent]
                                 [KEY=VALUE ...]

Stage 1 is the agent quick-start's SFT warm start (tutorial/agent_quickstart/sft.yaml), timed; --warm-start skips it.
Stage 2 is GRPO from that checkpoint for both models (the YAML's astuner.model.path and every astuner.models path
are pointed at it), validation every --test-freq steps. Printed per training step: the episode's success, each
agent's own success (the workflow's finder_success / keeper_success) and tool calls per episode, the trainer's
seconds; per validation: the same on the validation tasks, and the minutes since stage 1 began. Then the minutes to
episode success >= 0.8 on validation, the run's peak resident memory (from /proc, sampled) and the rollout's
generated tokens per second. Writes results.json and, with matplotlib, multi_agent.png (each agent's success and
tool calls by step). One run at a time: two cores.
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
TUTORIAL = REPO / "tutorial" / "multi_agent"
TARGET = 0.8
AGENTS = ("finder", "keeper")


def rss_bytes(pid: int) -> int:
    """Resident memory of a process and all its descendants (vLLM's engine core and worker run in their own)."""
    import psutil

    try:
        procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    except psutil.Error:
        return 0
    total = 0
    for p in procs:
        try:
            total += p.memory_info().rss
        except psutil.Error:
            pass
    return total


def warm_start(out: Path) -> tuple[Path, float]:
    folder = out / "sft"
    start = time.perf_counter()
    with open(out / "sft.console.txt", "w") as log:
        code = subprocess.call([sys.executable, "-m", "astuner.cli", "--conf",
                                str(REPO / "tutorial/agent_quickstart/sft.yaml"), f"astuner.experiment_dir={folder}"],
                               stdout=log, stderr=subprocess.STDOUT)
    if code:
        raise SystemExit(f"the warm start failed (exit {code}): {out / 'sft.console.txt'}")
    last = max(folder.glob("global_step_*"), key=lambda p: int(p.name.rsplit("_", 1)[1]))
    return last, (time.perf_counter() - start) / 60


def point(row: dict, split: str) -> dict:
    p = {"step": row["step"], "success": row.get(f"{split}/success_rate", row.get(f"{split}/accuracy", 0.0))}
    for agent in AGENTS:
        p[f"{agent}_success"] = row.get(f"{split}/metrics/{agent}_success", 0.0)
        p[f"{agent}_tool_calls"] = row.get(f"agent/{agent}/tool_calls_per_episode", float("nan"))
    return p


def grpo(conf: Path, model: Path, args, out: Path, minutes_before: float) -> dict:
    folder = out / "grpo"
    from astuner.config import load_config

    roster = load_config(conf).typed.astuner.models  # composed: a YAML may take them from its defaults
    cmd = [sys.executable, "-m", "astuner.cli", "--conf", str(conf), f"astuner.model.path={model}",
           *[f"astuner.models.{name}.path={model}" for name in roster], f"astuner.experiment_dir={folder}",
           f"astuner.trainer_common.total_training_steps={args.steps}",
           f"astuner.trainer_common.test_freq={args.test_freq}", "astuner.trainer_common.val_before_train=true",
           *args.overrides]
    metrics = folder / "metrics.jsonl"
    train, val, seen, peak = [], [], 0, 0
    start = time.perf_counter()
    with open(out / "grpo.console.txt", "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=conf.parent,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
        while True:
            done = proc.poll() is not None
            peak = max(peak, rss_bytes(proc.pid))
            lines = metrics.read_text().splitlines() if metrics.is_file() else []
            for line in lines[seen:]:
                row = json.loads(line)
                minutes = minutes_before + (time.perf_counter() - start) / 60
                if "time/train_s" in row:
                    p = {**point(row, "train"), "train_s": row["time/train_s"], "rollout_s": row["time/rollout_s"],
                         "gen_tok_s": row.get("perf/rollout_tokens_per_s", 0.0)}
                    train.append(p)
                    print(f"  train step {p['step']:2d}: success {p['success']:.3f}  finder {p['finder_success']:.3f}"
                          f" ({p['finder_tool_calls']:.2f} tool calls/ep)  keeper {p['keeper_success']:.3f} "
                          f"({p['keeper_tool_calls']:.2f})  train {p['train_s']:.0f}s rollout {p['rollout_s']:.0f}s",
                          flush=True)
                if "val/accuracy" in row:
                    p = {**point(row, "val"), "minutes": minutes}
                    val.append(p)
                    print(f"  validation step {p['step']:2d}: success {p['success']:.3f}  finder "
                          f"{p['finder_success']:.3f}  keeper {p['keeper_success']:.3f}  {minutes:5.1f} min",
                          flush=True)
            seen = len(lines)
            if done:
                break
            time.sleep(2)
    reached = next((p for p in val if p["success"] >= TARGET), None)
    return {"code": proc.returncode, "train": train, "val": val, "reached": reached, "peak_rss_gib": peak / 2**30,
            "minutes": minutes_before + (time.perf_counter() - start) / 60}


def plot(result: dict, path: Path, title: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.8))
    steps = [p["step"] for p in result["train"]]
    left.plot(steps, [p["success"] for p in result["train"]], marker="o", label="episode (code right)")
    for agent in AGENTS:
        left.plot(steps, [p[f"{agent}_success"] for p in result["train"]], marker="o", label=f"{agent}'s own part")
        right.plot(steps, [p[f"{agent}_tool_calls"] for p in result["train"]], marker="o", label=agent)
    left.axhline(TARGET, color="grey", linestyle=":", linewidth=1)
    left.set(title="success on the training batch", xlabel="GRPO step", ylim=(-0.02, 1.02))
    right.set(title="tool calls per episode (1 each needed)", xlabel="GRPO step", ylim=(0, 3.2))
    for axis in (left, right):
        axis.xaxis.get_major_locator().set_params(integer=True)
        axis.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--conf", type=Path, default=TUTORIAL / "two_agents.yaml")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--test-freq", type=int, default=2)
    ap.add_argument("--warm-start", type=Path)
    ap.add_argument("--warm-start-minutes", type=float, default=0.0)
    ap.add_argument("--out", type=Path, default=Path("bench_multi_agent"))
    ap.add_argument("--replot", type=Path, help="draw the figure of an earlier run's results.json into --out")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    if args.replot:
        result = json.loads(args.replot.read_text())
        args.out.mkdir(parents=True, exist_ok=True)
        plot(result, args.out / "multi_agent.png", f"Two agents, {Path(result['conf']).stem} (2 CPU cores)")
        return
    args.out.mkdir(parents=True, exist_ok=True)
    if args.warm_start:
        model, sft_minutes = args.warm_start.resolve(), args.warm_start_minutes
    else:
        model, sft_minutes = warm_start(args.out.resolve())
        print(f"warm start: {model} in {sft_minutes:.1f} min", flush=True)
    result = grpo(args.conf.resolve(), model, args, args.out.resolve(), sft_minutes)
    result.update({"conf": str(args.conf), "warm_start": str(model), "sft_minutes": sft_minutes})
    (args.out / "results.json").write_text(json.dumps(result, indent=1))
    r = result["reached"]
    print(f"episode success >= {TARGET} on validation: "
          + (f"step {r['step']}, {r['minutes']:.1f} min (warm start included)" if r else "not reached"))
    rates = [p["gen_tok_s"] for p in result["train"]]
    print(f"peak resident memory {result['peak_rss_gib']:.2f} GiB; rollout {sum(rates) / max(len(rates), 1):.0f} "
          f"generated tokens/s (mean over steps); {result['minutes']:.1f} min in all")
    if plot(result, args.out / "multi_agent.png", f"Two agents, {args.conf.stem} (2 CPU cores)"):
        print(f"figure: {args.out / 'multi_agent.png'}")


if __name__ == "__main__":
    main()
