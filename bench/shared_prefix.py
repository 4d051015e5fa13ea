"""The shared-prefix forward (trainer_common.shared_prefix_min_tokens) on the demo model: one mini-batch's forward
and backward with and without it, on the agent quick-start's shape (4 tasks x 8 repeats of a 350-token prompt,
responses of 30-110 tokens, micro_batch_token_budget 4096) and on 32 prompts that share nothing (the plain path's
cost, unchanged); the logprobs' and gradients' differences between the two.

    python bench/shared_prefix.py [--repeats 3]

The floor is the plain path: every sample its whole prompt, padded batches packed longest first. Not a test:
nothing here asserts a figure.
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from timing import best_of  # noqa: E402

from astuner.model_cache import resolve_model_path  # noqa: E402
from astuner.trainer import Trainer  # noqa: E402
from astuner.types import Sample  # noqa: E402


def samples(tasks: int, repeats: int, seed: int = 0) -> list[Sample]:
    rng = random.Random(seed)
    prompts = [[rng.randrange(1000, 40000) for _ in range(350)] for _ in range(tasks)]
    out = []
    for t, prompt in enumerate(prompts):
        for r in range(repeats):
            response = [rng.randrange(1000, 40000) for _ in range(rng.randrange(30, 111))]
            adv = 1.0 if r % 2 else -1.0
            out.append(Sample(prompt, response, [0.0] * len(response), adv, 1.0, f"t{t}r{r}"))
    return out


def trainer(path: str, min_tokens: int) -> Trainer:
    return Trainer(path, lr=1e-6, weight_decay=0.0, grad_clip=None, loss_agg_mode="token-mean", norm_length=128,
                   max_token_len_per_micro_batch=4096, device="cpu", shared_prefix_min_tokens=min_tokens)


def measure(path: str, batch: list[Sample], repeats: int) -> None:
    plain, shared = trainer(path, 0), trainer(path, 16)
    print(f"  shared-prefix forward checked: {bool(shared.head.shared_prefix)}")
    with torch.no_grad():
        lp = plain.forward_logprobs(batch)[0]
        batch = [Sample(s.prompt_ids, s.response_ids, x, s.advantage, 1.0, s.episode_uid)
                 for s, x in zip(batch, _split(lp, batch))]
    grads = {}
    for name, t in (("plain", plain), ("shared", shared)):
        def step(t=t):
            t.zero_grad()
            t.forward_backward(batch, "policy")
        seconds = best_of(step, repeats)
        grads[name] = torch.cat([p.grad.flatten() for p in t.model.parameters() if p.grad is not None])
        mbs = list(t.micro_batches(batch))
        print(f"  {name:6s}: forward + backward {seconds:6.2f} s (best of {repeats}), {len(mbs)} micro-batches")
        grads[name + "_s"] = seconds
    with torch.no_grad():
        diff = (plain.forward_logprobs(batch)[0] - shared.forward_logprobs(batch)[0]).abs().max().item()
    rel = ((grads["plain"] - grads["shared"]).norm() / grads["plain"].norm()).item()
    print(f"  speed-up {grads['plain_s'] / grads['shared_s']:.2f}x; logprobs max |diff| {diff:.2e}; gradient "
          f"relative difference {rel:.2e}")


def _split(flat: torch.Tensor, batch: list[Sample]) -> list[list[float]]:
    out, at = [], 0
    for s in batch:
        out.append(flat[at: at + len(s.response_ids)].tolist())
        at += len(s.response_ids)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    path = resolve_model_path("demo:smollm2-135m-instruct")
    torch.manual_seed(0)
    print("agent quick-start shape: 4 tasks x 8 repeats, 350-token prompts, 30-110-token responses")
    measure(path, samples(4, 8), args.repeats)
    print("nothing shared: 32 tasks x 1")
    measure(path, samples(32, 1), args.repeats)


if __name__ == "__main__":
    main()
