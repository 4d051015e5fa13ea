"""Where a GPU train step spends its time (torch.profiler, top CUDA kernels), for the model of bench_gpu_trainer.

    python bench/profile_gpu_trainer.py
"""

from __future__ import annotations

import random
import tempfile
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from astuner.trainer import Trainer
from astuner.types import Sample
from bench_gpu_trainer import qwen25_05b_shape  # its sibling: a script's folder is first on sys.path


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        qwen25_05b_shape(Path(tmp))
        t = Trainer(tmp, lr=1e-6, weight_decay=0.0, lr_warmup_steps=0, grad_clip=1.0, clip_ratio_low=0.2,
                    clip_ratio_high=0.28, use_kl_loss=False, kl_loss_coef=0.0, kl_loss_type="k3",
                    loss_agg_mode="token-mean", norm_length=512, max_token_len_per_micro_batch=16384)
        rng = random.Random(0)
        samples = [Sample([rng.randrange(1000, 100000) for _ in range(512)],
                          [rng.randrange(1000, 100000) for _ in range(512)],
                          [-11.0] * 512, 1.0 if i % 2 else -1.0, 1.0, f"e{i}") for i in range(64)]
        t.train_step(samples)  # warm-up (allocator, kernels)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            t.train_step(samples)
            torch.cuda.synchronize()
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=60))


if __name__ == "__main__":
    main()
