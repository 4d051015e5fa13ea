"""Gradient checkpointing on the demo model: bytes autograd keeps for the backward pass and step time, for one
2400-token micro-batch (8 samples of 100 prompt + 200 response tokens), with and without it.

    python bench/bench_gradient_checkpointing.py

Not a test: nothing here asserts a figure.
"""
import time, torch, random
from astuner.model_cache import resolve_model_path
from astuner.trainer import Trainer
from astuner.types import Sample


def main() -> None:
    p = resolve_model_path("demo:smollm2-135m-instruct")
    rng = random.Random(0)
    def mk(t):
        out=[]
        for i in range(8):
            pr=[rng.randrange(1000,20000) for _ in range(100)]; r=[rng.randrange(1000,20000) for _ in range(200)]
            lp = t.compute_logprobs(pr, r, 1.0)
            out.append(Sample(pr, r, lp, 1.0 if i%2 else -1.0, 1.0, f"e{i}"))
        return out
    for gc in (False, True):
        t = Trainer(p, lr=1e-6, weight_decay=0.0, lr_warmup_steps=0, grad_clip=1.0, clip_ratio_low=0.2, clip_ratio_high=0.28,
                    use_kl_loss=False, kl_loss_coef=0.0, kl_loss_type="k3", loss_agg_mode="token-mean", norm_length=200,
                    max_token_len_per_micro_batch=2400, device="cpu", gradient_checkpointing=gc)
        samples = mk(t)
        tot=[0]
        def pack(x):
            tot[0]+=x.numel()*x.element_size(); return x
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda x: x):
            t.train_step(samples)
        t0=time.perf_counter(); t.train_step(samples); dt=time.perf_counter()-t0
        print(f"gradient_checkpointing={gc}: saved for backward {tot[0]/2**30:.2f} GiB per 2400-token step, step {dt:.1f} s")


if __name__ == "__main__":
    main()
