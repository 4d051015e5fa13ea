"""The device memory a bf16 LoRA trainer takes to start: its peak and what stays resident, on CUDA.

    python bench/lora_load_peak.py [--shape qwen2.5-7b] [--rank 16] [--folder DIR]

Writes random bf16 weights of a real model's shape (config.json + safetensors shards; generated on the GPU, so in
seconds), then measures, each from an empty device:
  fp32 first  the model loaded in fp32, moved to the device, then cast to bf16: how the trainer started before
  trainer     astuner's Trainer with LoRA (q, k, v, o), precision bf16: the frozen base cast on the host
and prints each one's peak (torch.cuda.max_memory_allocated) and resident GiB. A 7B LoRA beside an awake engine on
an 80 GB card fits only when the peak is the bf16 weights' (2 bytes a parameter), not the fp32 load's (4).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

SHAPES = {  # Qwen2.5 configs (hidden, intermediate, layers, heads, kv heads, vocab, tied embeddings)
    "qwen2.5-0.5b": (896, 4864, 24, 14, 2, 151936, True),
    "qwen2.5-3b": (2048, 11008, 36, 16, 2, 151936, True),
    "qwen2.5-7b": (3584, 18944, 28, 28, 4, 152064, False),
}
GIB = 2**30


def write_random_model(folder: Path, shape: str) -> int:
    """Random bf16 weights of `shape` in `folder` (as from_pretrained reads them); the parameter count."""
    from safetensors.torch import save_file
    from transformers import Qwen2Config, Qwen2ForCausalLM

    hidden, inter, layers, heads, kv, vocab, tied = SHAPES[shape]
    config = Qwen2Config(hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers,
                         num_attention_heads=heads, num_key_value_heads=kv, vocab_size=vocab,
                         tie_word_embeddings=tied, max_position_embeddings=4096, torch_dtype="bfloat16")
    with torch.device("meta"):
        skeleton = Qwen2ForCausalLM(config)
    folder.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(folder)
    shard, shards, index, count, size = {}, 0, {}, 0, 0
    names = [n for n, _ in skeleton.named_parameters()]
    for i, (name, p) in enumerate(skeleton.named_parameters()):
        shard[name] = (torch.randn(p.shape, device="cuda", dtype=torch.bfloat16) * 0.02).cpu()
        count, size = count + p.numel(), size + 2 * p.numel()
        if size > 4 * GIB or i == len(names) - 1:
            file = f"model-{shards:05d}.safetensors"
            save_file(shard, str(folder / file), metadata={"format": "pt"})
            index.update({n: file for n in shard})
            shard, shards, size = {}, shards + 1, 0
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index}))
    return count


def measured(fn) -> tuple[float, float, float, object]:
    """(peak GiB, resident GiB, seconds, result) of fn() from an empty device."""
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() / GIB, torch.cuda.memory_allocated() / GIB,
            time.perf_counter() - start, out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="qwen2.5-7b", choices=sorted(SHAPES))
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--folder", default=None)
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM

    from astuner.trainer import Trainer
    from astuner.trainer.lora import LoraSettings
    from astuner.trainer.precision import cast_parameters

    folder = Path(args.folder or tempfile.mkdtemp(prefix="lora_load_")) / args.shape
    start = time.perf_counter()
    params = write_random_model(folder, args.shape)
    print(f"{args.shape}: {params / 1e9:.2f}B parameters, written in {time.perf_counter() - start:.0f} s; "
          f"{torch.cuda.get_device_name()}")

    def fp32_first():
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).to("cuda")
        cast_parameters(model, torch.bfloat16)
        return model

    peak, resident, seconds, model = measured(fp32_first)
    del model
    print(f"  fp32 first: peak {peak:.1f} GiB, resident {resident:.1f} GiB ({seconds:.0f} s)")
    lora = LoraSettings(rank=args.rank, alpha=2.0 * args.rank, dropout=0.0,
                        target_modules=("q_proj", "k_proj", "v_proj", "o_proj"))
    peak, resident, seconds, trainer = measured(lambda: Trainer(str(folder), lr=1e-5, lora=lora, precision="bf16",
                                                                device="cuda"))
    adapters = sum(p.numel() for p in trainer.params)
    print(f"  trainer (LoRA rank {args.rank}, {adapters / 1e6:.1f}M adapter parameters): peak {peak:.1f} GiB, "
          f"resident {resident:.1f} GiB ({seconds:.0f} s); bf16 weights alone: {2 * params / GIB:.1f} GiB")


if __name__ == "__main__":
    main()
