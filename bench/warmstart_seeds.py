"""The generated warm start, measured: `astuner warmstart`, then GRPO from its checkpoint, per seed.

    python bench/warmstart_seeds.py --conf tutorial/own_tools/own_tools.yaml [--seeds 0 1 2] [--steps 4]
                                    [--test-freq 2] [--base] [--out bench_warmstart]
                                    [--warmstart-option=--count=64 ...] [KEY=VALUE ...]

Per seed, each its own `astuner` process: the warm start (`astuner warmstart --conf X --seed S`: a dry run reads the
agent's tools, demonstrations with made-up tools of their shapes, the SFT), timed; then GRPO from its checkpoint
with `astuner.seed=S` (bench/agent_quickstart.py's grpo(): validation before training and every --test-freq
steps). Step 0's greedy validation success is the warm start's own; the last one is GRPO's. --base adds the base
model's greedy success (`astuner eval --num-repeat 0`). Prints a markdown table (with the share of validation tool
calls that pass every required argument, after the warm start and at the end) and writes results.json;
--tabulate prints the table of an earlier --out again.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from agent_quickstart import astuner, grpo  # noqa: E402


def warm_start(conf: Path, seed: int, out: Path, options: list[str]) -> tuple[Path, float]:
    folder = out / f"warmstart_seed{seed}"
    console = out / f"warmstart_seed{seed}.console.txt"
    start = time.perf_counter()
    code = astuner(["warmstart", "--conf", str(conf), "--seed", str(seed), "--out", str(folder), *options], console)
    if code:
        raise SystemExit(f"the warm start of seed {seed} failed (exit {code}): {console}")
    done = [ln for ln in console.read_text().splitlines() if "warm start done: checkpoint " in ln]
    checkpoint = Path(done[-1].split("checkpoint ", 1)[1].split(";", 1)[0])
    return checkpoint, (time.perf_counter() - start) / 60


def base_success(conf: Path, out: Path) -> float | None:
    astuner(["eval", "--conf", str(conf), "--model", "base", "--num-repeat", "0", "--out", str(out / "eval_base")],
            out / "eval_base.console.txt")
    summary = out / "eval_base" / "eval_summary.json"
    if not summary.is_file():
        return None
    return json.loads(summary.read_text())["models"][0]["greedy/success_rate"]


def complete_calls(run: Path, tools: Path, step: int) -> float | None:
    """The share of validation tool calls at `step` that name an offered tool and pass, as JSON, every argument
    its schema requires (the warm start's job; whether the values are right is the task's)."""
    trajectories = run / "trajectories" / f"val_step_{step:06d}.jsonl"
    if not trajectories.is_file() or not tools.is_file():
        return None
    required = {t["function"]["name"]: set(t["function"]["parameters"].get("required", []))
                for t in json.loads(tools.read_text())}
    total = complete = 0
    for line in trajectories.read_text().splitlines():
        for call in json.loads(line)["calls"]:
            for tool_call in call.get("tool_calls") or []:
                total += 1
                try:
                    arguments = json.loads(tool_call.get("arguments") or "{}")
                except json.JSONDecodeError:
                    continue
                name = tool_call.get("name")
                complete += name in required and isinstance(arguments, dict) and required[name] <= set(arguments)
    return complete / total if total else None


def table(conf: Path, base: float | None, runs: list[dict], steps: int) -> None:
    print(f"\n{conf.name}: astuner warmstart, then {steps} GRPO steps (validation: greedy success)"
          + (f"; base model {base:.3f}" if base is not None else ""))
    print("| seed | after the warm start | after GRPO, by step | tool calls/ep | calls with every required argument | "
          "warm start | GRPO wall |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in runs:
        c = r["curve"]
        by_step = ", ".join(f"{p['step']}: {p['success']:.2f}" for p in c[1:])
        tools = f"{c[0]['tool_calls']:.2f} -> {c[-1]['tool_calls']:.2f}" if c else "-"
        # The warm start's `model` links to the kept draw's checkpoint; its tools.json is beside it.
        folder, tools_file = Path(r["folder"]), Path(r["warm_start"]).resolve().parent / "tools.json"
        shares = [complete_calls(folder, tools_file, p["step"]) for p in (c[0], c[-1])] if c else [None, None]
        complete = " -> ".join("-" if v is None else f"{v:.2f}" for v in shares)
        print(f"| {r['seed']} | {c[0]['success'] if c else float('nan'):.2f} | {by_step} | {tools} | {complete} | "
              f"{r['sft_minutes']:.1f} min | {r['minutes']:.1f} min |")
    finals = [r["curve"][-1]["success"] for r in runs if r["curve"]]
    starts = [r["curve"][0]["success"] for r in runs if r["curve"]]
    if finals:
        print(f"mean over {len(finals)} seeds: {statistics.mean(starts):.3f} after the warm start, "
              f"{statistics.mean(finals):.3f} after GRPO")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--conf", type=Path, required=True)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--test-freq", type=int, default=2)
    ap.add_argument("--base", action="store_true", help="the base model's greedy success too")
    ap.add_argument("--out", type=Path, default=Path("bench_warmstart"))
    ap.add_argument("overrides", nargs="*", help="further KEY=VALUE overrides for every GRPO run")
    ap.add_argument("--warmstart-option", action="append", default=[],
                    help="an option for `astuner warmstart`, e.g. --warmstart-option=--count=64")
    ap.add_argument("--tabulate", action="store_true", help="print the table of --out's results.json, run nothing")
    args = ap.parse_args()
    args.conf, args.out, args.workflow = args.conf.resolve(), args.out.resolve(), None
    if args.tabulate:
        done = json.loads((args.out / "results.json").read_text())
        for r in done["runs"]:
            r.setdefault("folder", str(args.out / f"merge_seed{r['seed']}"))
        table(args.conf, done["base"], done["runs"], args.steps)
        return
    args.out.mkdir(parents=True, exist_ok=True)
    base = base_success(args.conf, args.out) if args.base else None
    if args.base:
        print(f"base model: greedy success {base}", flush=True)
    runs = []
    for seed in args.seeds:
        checkpoint, sft_minutes = warm_start(args.conf, seed, args.out, args.warmstart_option)
        print(f"seed {seed}: warm start {checkpoint} in {sft_minutes:.1f} min", flush=True)
        run = grpo(checkpoint, "merge", seed, args, args.out)
        runs.append({**run, "warm_start": str(checkpoint), "sft_minutes": sft_minutes,
                     "folder": str(args.out / f"merge_seed{seed}")})
        (args.out / "results.json").write_text(json.dumps({"conf": str(args.conf), "base": base, "runs": runs},
                                                          indent=1))
    table(args.conf, base, runs, args.steps)


if __name__ == "__main__":
    main()
