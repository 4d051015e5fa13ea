"""A refactor's check: a 3-step run of each algorithm type, reduced to a fingerprint of its final weights and of
its metrics, to compare between two checkouts (before and after a change that must not change behaviour).

    python bench/identical_runs.py --repo /path/to/old/checkout --out before.json
    python bench/identical_runs.py --out after.json             # this checkout
    python bench/identical_runs.py --compare before.json after.json

Each run is `astuner --conf ... --backbone debug` in its own process on the same tiny random-weight model (the
demo tokenizer, 2 layers, seeded), the HF engine and fixed seeds: grpo (plain, with the KL loss and a cosine
schedule, with RLOO and GSPO) and rft on the quick-start's additions, judged by the answer's length, sft and
dpo/orpo on tutorial/algorithms' data, and tutorial/multi_agent's two models and two adapters on one base
(every model's weights in the digest). Metrics that measure time or speed are left out of the fingerprint;
everything else (losses, rewards, grad norms, logprob gaps) must match exactly.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TIMED = ("time/", "perf/", "_per_s", "seconds", "timing", "wall", "_s_")
# Run name -> (algorithm.type, extra overrides): every type, and GRPO under the settings whose keys other
# settings switch off (config/effective.py).
RUNS = {
    "grpo": ("grpo", []),
    "grpo_kl_cosine": ("grpo", ["astuner.trainer_common.use_kl_loss=true", "astuner.trainer_common.kl_loss_coef=0.1",
                                "astuner.trainer_common.optim.lr_scheduler_type=cosine",
                                "astuner.trainer_common.optim.min_lr_ratio=0.2"]),
    "rloo_gspo": ("grpo", ["astuner.trainer_common.algorithm.adv_estimator=rloo",
                           "astuner.trainer_common.policy_loss.loss_mode=gspo"]),
    "rft": ("rft", ["astuner.trainer_common.algorithm.rft_reward_threshold=0.05"]),
    "sft": ("sft", []),
    # Validation on the training pairs: the pair losses' no-gradient path too.
    "dpo": ("dpo", ["astuner.offline_data.val_file=data/dpo_train.jsonl"]),
    "orpo": ("orpo", ["astuner.offline_data.val_file=data/dpo_train.jsonl"]),
    # Several models (tutorial/multi_agent): two models, and two LoRA adapters on one base.
    "two_models": ("grpo", []),
    "two_adapters": ("grpo", []),
}
SEVERAL = {"two_models": "two_agents.yaml", "two_adapters": "two_adapters.yaml"}
# A random model never boxes the right sum: the reward is the answer's length, so that groups differ.
JUDGE = """
from astuner.task_judge.base_judge import BaseJudge

class LengthJudge(BaseJudge):
    def compute_reward(self, workflow_task, workflow_output):
        n = len(workflow_output.metadata.get("final_answer") or "")
        return n / 100.0, n > 40
"""


def tiny_model(folder: Path) -> Path:
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from astuner.model_cache import ensure_demo_model

    tokenizer = AutoTokenizer.from_pretrained(ensure_demo_model("smollm2-135m-instruct"))
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=64, max_position_embeddings=2048,
                         tie_word_embeddings=True, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def config(name: str, model: Path, out: Path, repo: Path) -> list[str]:
    """The command line of one run."""
    kind, overrides = RUNS[name]
    common = [f"astuner.model.path={model}", f"astuner.experiment_dir={out}", "astuner.seed=1",
              "astuner.trainer_common.total_training_steps=3", "astuner.trainer_common.save_freq=3",
              "astuner.trainer_common.test_freq=99999"]
    if name in SEVERAL:
        conf = repo / "tutorial" / "multi_agent" / SEVERAL[name]
        extra = ["astuner.rollout.engine=hf", "astuner.rollout.num_repeat=4", "astuner.data.train_batch_size=2",
                 "astuner.rollout.max_response_length_in_one_turn=16", f"astuner.models.keeper.path={model}",
                 "astuner.trainer_common.val_before_train=false",
                 f"astuner.task_judge.judge_protocol={model.parent / 'length_judge.py'}->LengthJudge"]
    elif kind in ("grpo", "rft"):
        conf = repo / "tutorial" / "quickstart" / "quickstart.yaml"
        # The tutorial's sampling and judge may change; the bench pins its own, so checkouts stay comparable.
        extra = ["astuner.rollout.engine=hf", "astuner.rollout.temperature=1.0", "astuner.rollout.num_repeat=4",
                 "astuner.data.train_batch_size=2",
                 "astuner.rollout.max_response_length_in_one_turn=16", "astuner.trainer_common.max_idle_steps=99",
                 "astuner.trainer_common.val_before_train=false", f"astuner.trainer_common.algorithm.type={kind}",
                 f"astuner.task_judge.judge_protocol={model.parent / 'length_judge.py'}->LengthJudge"]
    else:
        conf = repo / "tutorial" / "algorithms" / ("sft.yaml" if kind == "sft" else "dpo.yaml")
        extra = [f"astuner.trainer_common.algorithm.type={kind}"]
    return [sys.executable, "-m", "astuner.cli", "--conf", str(conf), "--backbone", "debug", *common, *extra,
            *overrides]


def weights_digest(folder: Path) -> str:
    from safetensors.torch import load_file

    digest = hashlib.sha256()
    for f in sorted(folder.rglob("*.safetensors")):  # other models' folders too
        for name, tensor in sorted(load_file(str(f)).items()):
            digest.update(name.encode())
            digest.update(tensor.float().numpy().tobytes())
    return digest.hexdigest()[:16]


def fingerprint(out: Path, initial: str) -> dict:
    final = sorted(out.glob("global_step_*"), key=lambda p: int(p.name.rsplit("_", 1)[1]))[-1]
    weights = weights_digest(final)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    kept = [{k: v for k, v in row.items() if not any(t in k for t in TIMED)} for row in rows]
    return {"checkpoint": final.name, "weights_sha256": weights, "trained": weights != initial,
            "metrics_sha256": hashlib.sha256(json.dumps(kept, sort_keys=True).encode()).hexdigest()[:16],
            "last_metrics": {k: v for k, v in kept[-1].items() if isinstance(v, (int, float))}, "rows": kept}


def run_all(names: list[str], repo: Path) -> dict:
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        model = tiny_model(Path(tmp) / "model")
        (Path(tmp) / "length_judge.py").write_text(JUDGE)
        initial = weights_digest(model)
        for kind in names:
            out = Path(tmp) / kind
            # The checkout under test comes first on the path (before any installed astuner).
            env = {**os.environ, "PYTHONHASHSEED": "0", "PYTHONPATH": str(repo)}
            done = subprocess.run(config(kind, model, out, repo), capture_output=True, text=True, cwd=repo, env=env,
                                  timeout=1200)
            if done.returncode != 0:
                results[kind] = {"error": done.stderr[-2000:]}
            else:
                results[kind] = fingerprint(out, initial)
            print(kind, json.dumps({k: v for k, v in results[kind].items() if k not in ("last_metrics", "rows")}), flush=True)
    return results


def compare(a: dict, b: dict) -> int:
    differ = 0
    for kind in sorted(set(a) | set(b)):
        x, y = a.get(kind, {}), b.get(kind, {})
        same = all(x.get(k) == y.get(k) for k in ("weights_sha256", "metrics_sha256")) and "error" not in x
        differ += not same
        print(f"{kind:5s} {'identical' if same else 'DIFFERENT'}  weights {x.get('weights_sha256')} / "
              f"{y.get('weights_sha256')}  metrics {x.get('metrics_sha256')} / {y.get('metrics_sha256')}")
        if not same:
            explain(x.get("rows") or [x.get("last_metrics", {})], y.get("rows") or [y.get("last_metrics", {})])
    return differ


def explain(rows_a: list[dict], rows_b: list[dict]) -> None:
    """Which metrics differ: keys logged on one side only, and values that differ (with the largest relative gap)."""
    only_a = sorted({k for r in rows_a for k in r} - {k for r in rows_b for k in r})
    only_b = sorted({k for r in rows_b for k in r} - {k for r in rows_a for k in r})
    if only_a:
        print(f"      only before: {', '.join(only_a)}")
    if only_b:
        print(f"      only after: {', '.join(only_b)}")
    gaps: dict[str, float] = {}
    for ra, rb in zip(rows_a, rows_b):
        for k in set(ra) & set(rb):
            u, v = ra[k], rb[k]
            if u != v:
                rel = (abs(u - v) / max(abs(u), abs(v), 1e-30)
                       if isinstance(u, (int, float)) and isinstance(v, (int, float)) else float("inf"))
                gaps[k] = max(gaps.get(k, 0.0), rel)
    for k, rel in sorted(gaps.items()):
        print(f"      {k}: differs, largest relative gap {rel:.2e}")
    if len(rows_a) != len(rows_b):
        print(f"      {len(rows_a)} rows before, {len(rows_b)} after")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repo", type=Path, default=REPO, help="the checkout whose astuner runs (default: this one)")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--runs", nargs="+", default=list(RUNS), choices=list(RUNS))
    ap.add_argument("--compare", nargs=2, type=Path)
    args = ap.parse_args()
    if args.compare:
        sys.exit(1 if compare(*(json.loads(p.read_text()) for p in args.compare)) else 0)
    results = run_all(args.runs, args.repo.resolve())
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
