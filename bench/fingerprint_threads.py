"""How long a sync's weight fingerprint takes: on one host thread (a Ray actor's torch), with torch's threads raised
(`FingerprintBuilder`), and on the GPU.

    python bench/fingerprint_threads.py [--shape qwen2.5-7b] [--threads 16]

Random bf16 tensors of a real model's shapes (made on the GPU when there is one, then copied to host memory), then
`fingerprint.fingerprint` of them with torch on one thread per kernel (as Ray sets it for an actor), and with
`--threads` threads per kernel (what `FingerprintBuilder` raises it to); the prints are checked to agree. With a
GPU, the same tensors fingerprinted there too. Prints seconds and elements per second.
"""

from __future__ import annotations

import argparse
import time

import torch

SHAPES = {  # Qwen2.5 (hidden, intermediate, layers, kv heads x head dim, vocab)
    "qwen2.5-0.5b": (896, 4864, 24, 128, 151936),
    "qwen2.5-3b": (2048, 11008, 36, 256, 151936),
    "qwen2.5-7b": (3584, 18944, 28, 512, 152064),
}


def model_tensors(shape: str, device: str) -> list[tuple[str, torch.Tensor]]:
    hidden, inter, layers, kv, vocab = SHAPES[shape]
    make = (lambda *dims: torch.randn(*dims, device="cuda", dtype=torch.bfloat16).cpu()) if device == "cuda" else \
        (lambda *dims: torch.randn(*dims, dtype=torch.bfloat16))
    out = [("model.embed_tokens.weight", make(vocab, hidden)), ("lm_head.weight", make(vocab, hidden))]
    for i in range(layers):
        p = f"model.layers.{i}."
        out += [(p + "self_attn.q_proj.weight", make(hidden, hidden)), (p + "self_attn.k_proj.weight", make(kv, hidden)),
                (p + "self_attn.v_proj.weight", make(kv, hidden)), (p + "self_attn.o_proj.weight", make(hidden, hidden)),
                (p + "mlp.gate_proj.weight", make(inter, hidden)), (p + "mlp.up_proj.weight", make(inter, hidden)),
                (p + "mlp.down_proj.weight", make(hidden, inter))]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="qwen2.5-7b", choices=sorted(SHAPES))
    parser.add_argument("--threads", type=int, default=16)
    args = parser.parse_args()
    from astuner.engine.fingerprint import differences, fingerprint

    gpu = torch.cuda.is_available()
    tensors = model_tensors(args.shape, "cuda" if gpu else "cpu")
    n = sum(t.numel() for _, t in tensors)
    torch.set_num_threads(1)  # as in a Ray actor (OMP_NUM_THREADS=1)
    times, prints = {}, {}
    for threads in (1, args.threads):
        start = time.perf_counter()
        prints[threads] = fingerprint(tensors, threads=threads)
        times[threads] = time.perf_counter() - start
        print(f"{args.shape} ({n / 1e9:.2f}B elements), host, {threads} thread(s): {times[threads]:.1f} s "
              f"({n / times[threads] / 1e6:.0f} M elements/s)", flush=True)
    assert not differences(prints[1], prints[args.threads]), "the prints on several threads differ from one's"
    print(f"  {times[1] / times[args.threads]:.1f}x faster on {args.threads} threads; the prints agree")
    if gpu:
        on_device = [(name, t.cuda()) for name, t in tensors]
        fingerprint(on_device[:2])  # the device's sign pattern, once
        torch.cuda.synchronize()
        start = time.perf_counter()
        fingerprint(on_device)
        torch.cuda.synchronize()
        took = time.perf_counter() - start
        print(f"  on {torch.cuda.get_device_name()}: {took:.2f} s ({n / took / 1e9:.1f} G elements/s)")


if __name__ == "__main__":
    main()
