"""tinker-cookbook recipes, unchanged, against `astuner serve` on the demo model: their curves, as they log them.

    python bench/tinker_cookbook.py --cookbook-python /path/to/venv/bin/python [--recipe rl|sl|both] [--steps 20]
    python bench/tinker_cookbook.py --cookbook-python ... --recipe distill --teacher CHECKPOINT [--steps 10]

The cookbook needs its own environment (it pins transformers <= 5.5 and needs Python 3.11+):
    python3 -m venv cookbook-venv && cookbook-venv/bin/pip install "torch==2.13.0" \\
        "tinker-cookbook==0.5.8" "tinker==0.38.0" sympy pylatexenc math-verify

Recipes (no dataset download: this machine has no Hugging Face hub):
    rl  tinker_cookbook.recipes.math_rl.train env=arithmetic (two-number addition, reward 1 for the right sum, 0.1
        less without the stop token), importance_sampling, LoRA rank 32, 32 groups of 4 per step
    sl  tinker_cookbook.supervised.train (sl_basic's trainer) on the cookbook's example_data/conversations.jsonl,
        LoRA rank 32, 16 conversations per step
    distill  the on-policy distillation trainer (tinker_cookbook.distillation.train_on_policy) as its recipe
        configures it (importance_sampling, per-token reverse KL to the teacher as the advantage, no reward), by
        bench/cookbook_distill_driver.py on the quick-start's questions (the recipe's datasets are on the hub);
        the teacher (--teacher, a checkpoint of the demo model, e.g. tutorial/algorithms' SFT) is a second base of
        the same server (astuner.models.teacher), scored with compute_logprobs; LoRA rank 32, 8 prompts x 4 per step
Both render with the cookbook's `qwen3_instruct` renderer (ChatML, as SmolLM2's template). The server is this
checkout's `astuner serve` on tutorial/quickstart/quickstart.yaml's model. Printed: each recipe's metrics by step
from its own metrics.jsonl, and its wall time; `--plot FILE` draws them. Run it alone: two cores.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CONF = REPO / "tutorial/quickstart/quickstart.yaml"
CURVES = {"rl": ("env/all/correct", "env/all/reward/total", "env/all/format"), "sl": ("train_mean_nll",),
          "distill": ("teacher_kl", "optim/entropy")}


def start_server(out: Path, port: int, overrides: tuple[str, ...] = ()) -> subprocess.Popen:
    env = {**os.environ, "TINKER_TELEMETRY": "0"}
    cmd = [sys.executable, "-m", "astuner.cli", "serve", "--conf", str(CONF), f"astuner.experiment_dir={out}",
           "--port", str(port), *overrides]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True)
    for line in proc.stderr:
        print(line, end="", file=sys.stderr)
        if "serving the Tinker API at" in line:
            return proc
    raise SystemExit(f"astuner serve did not start (exit {proc.wait()})")


def recipe_command(name: str, args, model: str, url: str, log_path: Path) -> list[str]:
    common = [f"model_name={model}", "renderer_name=qwen3_instruct", f"base_url={url}", f"log_path={log_path}",
              "lora_rank=32", "save_every=0"]
    if name == "distill":
        # -P: bench/ is not put on the path, where this file would shadow the tinker_cookbook package.
        return [args.cookbook_python, "-P", str(REPO / "bench" / "cookbook_distill_driver.py"), "teacher_model=teacher",
                f"prompts_file={CONF.parent / 'data' / 'train.jsonl'}", "groups_per_batch=8", "group_size=4",
                f"learning_rate={args.distill_lr}", "max_tokens=48", f"max_steps={args.steps}", *common]
    if name == "rl":
        return [args.cookbook_python, "-m", "tinker_cookbook.recipes.math_rl.train", "env=arithmetic",
                "loss_fn=importance_sampling", "groups_per_batch=32", "group_size=4", f"learning_rate={args.rl_lr}",
                f"max_steps={args.steps}", "eval_every=0", "behavior_if_log_dir_exists=delete", *common]
    data = Path(subprocess.check_output([args.cookbook_python, "-c", "import tinker_cookbook, os; print(os.path."
                                         "dirname(tinker_cookbook.__file__))"], text=True).strip())
    # The cookbook's supervised trainer, configured from the command line as sl_basic does (its own __main__ does
    # not start in 0.5.8: a lambda entrypoint).
    driver = ("import asyncio, sys, chz; from tinker_cookbook.supervised import train; "
              "asyncio.run(train.main(chz.Blueprint(train.Config).make_from_argv(sys.argv[1:])))")
    return [args.cookbook_python, "-c", driver, "recipe_name=sl_bench",
            f"learning_rate={args.sl_lr}",
            "lr_schedule=linear", "num_epochs=4", "eval_every=0", f"max_steps={args.steps}",
            "dataset_builder=tinker_cookbook.supervised.data:FromConversationFileBuilder",
            f"dataset_builder.file_path={data / 'example_data/conversations.jsonl'}",
            f"dataset_builder.common_config.model_name_for_tokenizer={model}",
            "dataset_builder.common_config.renderer_name=qwen3_instruct",
            "dataset_builder.common_config.batch_size=16", "dataset_builder.common_config.max_length=512",
            *common]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cookbook-python", required=True, help="python of an environment with tinker-cookbook")
    parser.add_argument("--recipe", choices=("rl", "sl", "both", "distill"), default="both")
    parser.add_argument("--teacher", help="the distillation teacher: a checkpoint folder of the demo model")
    parser.add_argument("--distill-lr", type=float, default=1e-4)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rl-lr", type=float, default=1e-4)
    parser.add_argument("--sl-lr", type=float, default=2e-4)
    parser.add_argument("--port", type=int, default=8017)
    parser.add_argument("--out", default="/tmp/astuner_bench_tinker_cookbook")
    parser.add_argument("--plot", help="draw the curves into this PNG (matplotlib)")
    args = parser.parse_args()
    sys.path.insert(0, str(REPO))
    from astuner.model_cache import resolve_model_path

    model = resolve_model_path("demo:smollm2-135m-instruct")
    out = Path(args.out)
    if args.recipe == "distill" and not args.teacher:
        parser.error("--recipe distill needs --teacher CHECKPOINT")
    teacher = (f"+astuner.models.teacher.path={Path(args.teacher).resolve()}",) if args.recipe == "distill" else ()
    server = start_server(out / "serve", args.port, teacher)
    results = {}
    try:
        for name in (("rl", "sl") if args.recipe == "both" else (args.recipe,)):
            log_path = out / name
            shutil.rmtree(log_path, ignore_errors=True)
            cmd = recipe_command(name, args, model, f"http://127.0.0.1:{args.port}", log_path)
            env = {**os.environ, "TINKER_TELEMETRY": "0", "TINKER_API_KEY": "tml-local", "HF_HUB_OFFLINE": "1"}
            start = time.monotonic()
            subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL, stderr=open(out / f"{name}.log", "w"))
            rows = [json.loads(line) for line in (log_path / "metrics.jsonl").read_text().splitlines()]
            results[name] = {"minutes": (time.monotonic() - start) / 60, "rows": rows}
            print(f"\n{name}: {len(rows)} steps in {results[name]['minutes']:.1f} min")
            keys = [k for k in CURVES[name] if any(k in r for r in rows)]
            print("step  " + "  ".join(f"{k:>22}" for k in keys))
            for r in rows:
                if any(k in r for k in keys):
                    print(f"{r['step']:>4}  " + "  ".join(f"{r.get(k, float('nan')):>22.4f}" for k in keys))
    finally:
        os.killpg(server.pid, signal.SIGTERM)  # SIGINT is ignored in a job started in the background
        server.wait(timeout=120)
    (out / "curves.json").write_text(json.dumps(results))
    if args.plot:
        plot(results, args.plot)


def plot(results: dict, path: str) -> None:
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(5 * len(results), 3.5), squeeze=False)
    for ax, (name, result) in zip(axes[0], results.items()):
        for key in CURVES[name]:
            points = [(r["step"], r[key]) for r in result["rows"] if key in r]
            if points:
                ax.plot(*zip(*points), marker=".", label=key)
        ax.set_title(f"tinker-cookbook {name} on astuner serve ({result['minutes']:.0f} min)")
        ax.set_xlabel("step")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
