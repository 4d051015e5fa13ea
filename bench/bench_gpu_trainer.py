"""The trainer on one GPU with a random-weight model in Qwen2.5-0.5B's shape: train-step tokens/s, model FLOPs
utilisation, peak memory with and without gradient checkpointing, and the trainer side of a weight sync (fp32
master weights -> bf16 in the shared-memory file the vLLM worker reads, and back onto the GPU as the worker does).

    python bench/bench_gpu_trainer.py [--samples 64] [--prompt 512] [--response 512]

Needs CUDA; prints figures, asserts none. Model FLOPs per step (forward + backward = 3 x forward):
    6 * (N - N_emb) * T_fed  +  6 * N_emb * T_resp  +  6 * L * d * sum_s(len_s^2)
(T_fed: tokens fed, T_resp: response tokens, the only positions whose logits the trainer computes; the last term
is causal attention, QK^T and AV at half the square each). MFU = that / step time / bf16 dense peak.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from pathlib import Path

import torch

from astuner.engine.shared_weights import SharedWeightFile, pin_host_memory
from astuner.trainer.lora import LoraSettings
from astuner.trainer import Trainer
from astuner.trainer.step import recompute_old_logprobs
from astuner.types import Sample

PEAK_BF16 = {"H100": 989e12, "H200": 989e12, "A100": 312e12}  # dense, no sparsity


SHAPES = {  # Qwen2.5 shapes: hidden, intermediate, layers, heads, kv heads, tied embeddings
    "0.5b": (896, 4864, 24, 14, 2, True),
    "1.5b": (1536, 8960, 28, 12, 2, True),
    "7b": (3584, 18944, 28, 28, 4, False),
}


def qwen25_05b_shape(path: Path, shape: str = "0.5b") -> None:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    hidden, inter, layers, heads, kv, tied = SHAPES[shape]
    config = Qwen2Config(vocab_size=151936, hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=32768,
                         tie_word_embeddings=tied, rope_theta=1e6, rms_norm_eps=1e-6, attention_dropout=0.0)
    torch.manual_seed(0)
    # Built on the GPU in bf16 (a 7B model initialised on the CPU takes minutes); the trainer loads it as usual.
    with torch.device("cuda"):
        model = Qwen2ForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(path)
    del model
    torch.cuda.empty_cache()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--response", type=int, default=512)
    ap.add_argument("--budget", type=int, default=16384, help="max_token_len_per_micro_batch")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="0.5b")
    ap.add_argument("--gc", choices=["both", "on", "off"], default="both", help="gradient checkpointing")
    ap.add_argument("--lora-rank", type=int, default=0, help="LoRA rank on all linear layers (0: full fine-tuning)")
    args = ap.parse_args()
    name = torch.cuda.get_device_name()
    peak = next((v for k, v in PEAK_BF16.items() if k in name), None)
    out = {"device": name, "shape": args.shape, "lora_rank": args.lora_rank}
    with tempfile.TemporaryDirectory() as tmp:
        qwen25_05b_shape(Path(tmp), args.shape)
        rng = random.Random(0)
        for gc in {"both": (False, True), "on": (True,), "off": (False,)}[args.gc]:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            t = Trainer(tmp, lr=1e-6, weight_decay=0.0, lr_warmup_steps=0, grad_clip=1.0, clip_ratio_low=0.2,
                        clip_ratio_high=0.28, use_kl_loss=False, kl_loss_coef=0.0, kl_loss_type="k3",
                        loss_agg_mode="token-mean", norm_length=args.response,
                        max_token_len_per_micro_batch=args.budget, gradient_checkpointing=gc,
                        lora=LoraSettings(args.lora_rank, 2.0 * args.lora_rank, 0.0, "all-linear")
                        if args.lora_rank else None)
            n_all = sum(p.numel() for n, p in t.model.named_parameters() if ".lora_" not in n)
            n_emb = t.model.get_input_embeddings().weight.numel()
            cfg = t.model.config
            samples = []
            for i in range(args.samples):
                prompt = [rng.randrange(1000, 100000) for _ in range(args.prompt)]
                resp = [rng.randrange(1000, 100000) for _ in range(args.response)]
                samples.append(Sample(prompt, resp, [-11.0] * len(resp), 1.0 if i % 2 else -1.0, 1.0, f"e{i}"))
            fed = sum(len(s.prompt_ids) + len(s.response_ids) - 1 for s in samples)
            resp_tokens = sum(len(s.response_ids) for s in samples)
            flops = (6 * (n_all - n_emb) * fed + 6 * n_emb * resp_tokens
                     + 6 * cfg.num_hidden_layers * cfg.hidden_size * sum(
                         (len(s.prompt_ids) + len(s.response_ids)) ** 2 for s in samples))
            t.train_step(samples)  # warm-up (allocator, kernels)
            torch.cuda.synchronize()
            times = []
            for _ in range(3):
                t0 = time.perf_counter()
                t.train_step(samples)
                torch.cuda.synchronize()
                times.append(time.perf_counter() - t0)
            step = min(times)
            row = {
                "params": n_all, "tokens_per_step": fed, "step_s": round(step, 3),
                "train_tokens_per_s": round(fed / step), "model_tflops": round(flops / step / 1e12, 1),
                "mfu": round(flops / step / peak, 3) if peak else None,
                "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2),
            }
            # Forward-only logprobs (old_logprobs: trainer), the same samples.
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            recompute_old_logprobs(t, samples)
            torch.cuda.synchronize()
            row["logprob_pass_tokens_per_s"] = round(fed / (time.perf_counter() - t0))
            out[f"gradient_checkpointing={gc}"] = row
            if args.lora_rank:
                row["trainable_params"] = sum(p.numel() for p in t.master.masters)
                row["note"] = "model_tflops counts the base model's 6N per token; LoRA skips weight gradients of W"
            if not gc and not args.lora_rank:
                shared = SharedWeightFile("bfloat16")
                shared.write(t.named_parameters_for_sync())  # sizes the file
                writes, reads = [], []
                for _ in range(3):
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    path, manifest = shared.write(t.named_parameters_for_sync())
                    writes.append(time.perf_counter() - t0)
                    # What the worker does with it: map, view, copy onto the GPU.
                    buf = torch.from_file(path, shared=True, size=manifest[-1][4] + manifest[-1][3], dtype=torch.uint8)
                    pinned = pin_host_memory(buf)
                    dst = {n: torch.empty(s, dtype=torch.bfloat16, device="cuda") for n, _, s, _, _ in manifest}
                    torch.cuda.synchronize()
                    t0 = time.perf_counter()
                    for n, _, shape, nb, off in manifest:
                        dst[n].copy_(buf[off:off + nb].view(torch.bfloat16).view(shape), non_blocking=pinned)
                    torch.cuda.synchronize()
                    reads.append(time.perf_counter() - t0)
                    if pinned:
                        torch.cuda.cudart().cudaHostUnregister(buf.data_ptr())
                shared.close()
                out["sync_via_shm"] = {"gib": round(sum(m[3] for m in manifest) / 2**30, 3),
                                       "trainer_write_s": round(min(writes), 3),
                                       "worker_read_to_gpu_s": round(min(reads), 3)}
            del t
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
