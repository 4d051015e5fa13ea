"""Trainer-group strategies side by side: what each worker holds, and what a step and a weight gather cost.

    python bench/bench_fsdp.py [--model demo:smollm2-135m-instruct] [--workers 2] [--episodes 16]

Each strategy runs `--workers` trainer processes (torch.distributed: NCCL on GPU, gloo on CPU, one thread each on
CPU), every worker with the same step of `--episodes` synthetic samples (a 192-token prompt, a 64-token response,
advantages of both signs), 1 warm-up step and 2 timed ones. Per strategy it prints, for rank 0:
    held_mb       bytes of its parameters, gradients and AdamW moments after a step (local shards under fsdp2)
    peak_rss_mb   the process's peak resident memory (CPU) or peak allocated GPU memory
    step_s        the mean train_step over the timed steps (forward, backward, gradient reduction, AdamW)
    gather_s      one pass of named_parameters_for_sync (what an engine sync or a checkpoint reads; fsdp2 gathers)
Not a test: nothing here asserts a number.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def step_samples(n: int):
    from astuner.types import Sample

    out = []
    for e in range(n):
        prompt = [(31 * i + 7 * e) % 40000 + 100 for i in range(192)]
        response = [(17 * i + 5 * e) % 40000 + 100 for i in range(64)]
        out.append(Sample(prompt, response, [-2.0] * len(response), 1.0 if e % 2 else -1.0, 1.0, f"ep{e}"))
    return out


def held_bytes(trainer) -> int:
    import torch

    def local(t):
        return t.to_local() if hasattr(t, "to_local") else t

    total = 0
    for p in trainer.model.parameters():
        total += local(p).numel() * local(p).element_size()
    for state in trainer.optimizer.state.values():
        total += sum(local(v).numel() * local(v).element_size() for v in state.values()
                     if isinstance(v, torch.Tensor) and v.dim() > 0)
    if trainer.master.separate:
        total += sum(m.numel() * m.element_size() for m in trainer.master.masters)
    return total + sum(local(p).numel() * 4 for p in trainer.params)  # fp32 gradients (held during the step)


def worker(rank: int, world: int, port: int, model: str, strategy: str, episodes: int, out: str) -> None:
    import torch

    from astuner.trainer.data_parallel import DataParallel
    from astuner.trainer import Trainer

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(rank)
    else:
        torch.set_num_threads(1)
    trainer = Trainer(model, lr=1e-6, weight_decay=0.0, lr_warmup_steps=0, grad_clip=1.0, clip_ratio_low=0.2,
                      clip_ratio_high=0.28, use_kl_loss=False, kl_loss_coef=0.0, kl_loss_type="k3",
                      loss_agg_mode="token-mean", norm_length=64, max_token_len_per_micro_batch=2048,
                      strategy=strategy, group_size=world)  # as a Ray worker: fsdp2 reaches the GPU as shards only
    used = trainer.join_group(DataParallel.init(rank, world, "127.0.0.1", port, "cuda" if cuda else "cpu", 600),
                              strategy)
    samples = step_samples(episodes)
    trainer.train_step(samples)
    times = []
    for _ in range(2):
        start = time.perf_counter()
        trainer.train_step(samples)
        times.append(time.perf_counter() - start)
    start = time.perf_counter()
    for _ in trainer.named_parameters_for_sync():
        pass
    gather_s = time.perf_counter() - start
    peak = torch.cuda.max_memory_allocated() if cuda else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    if rank == 0:
        Path(out).write_text(json.dumps({"strategy": used, "held_mb": held_bytes(trainer) / 2**20,
                                         "peak_rss_mb": peak / 2**20, "step_s": sum(times) / len(times),
                                         "gather_s": gather_s}))
    torch.distributed.barrier()  # no worker tears the group down while another still uses it
    DataParallel.close()


def main() -> None:
    import torch.multiprocessing as mp

    from astuner.trainer.data_parallel import free_port
    from astuner.model_cache import resolve_model_path

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="demo:smollm2-135m-instruct")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--episodes", type=int, default=16)
    args = parser.parse_args()
    model = str(resolve_model_path(args.model))
    print(f"model {model}, {args.workers} workers, {args.episodes} samples of 192 + 64 tokens a step")
    print(f"{'strategy':<9}{'held_mb':>10}{'peak_rss_mb':>13}{'step_s':>9}{'gather_s':>10}")
    for strategy in ("ddp", "fsdp2"):
        port = free_port("127.0.0.1")
        out = os.path.join(tempfile.mkdtemp(), "result.json")
        mp.start_processes(worker, args=(args.workers, port, model, strategy, args.episodes, out),
                           nprocs=args.workers, start_method="spawn")
        r = json.loads(Path(out).read_text())
        print(f"{r['strategy']:<9}{r['held_mb']:>10.0f}{r['peak_rss_mb']:>13.0f}{r['step_s']:>9.2f}"
              f"{r['gather_s']:>10.2f}", flush=True)


if __name__ == "__main__":
    main()
