"""How far a bf16 trainer's logprobs drift from an fp32 copy of the same model along a long sequence, with the
rotary `inv_freq` kept fp32 (what the trainer does) and, for contrast, rounded to bf16 (the bug it avoids).

    python bench/rope_drift.py [--tokens 3000] [--layers 30] [--device cuda]

No vLLM needed (the doctor's long-sequence parity check compares against the engine; this one checks the trainer
alone). Random weights in SmolLM2-135M's shape, with initializer_range raised so attention is not uniform. Prints
the mean and max |bf16 - fp32| logprob per position band: with inv_freq fp32 the mean stays flat along the
sequence; rounded to bf16 it grows with position. Not a test: nothing here asserts a figure.
"""

from __future__ import annotations

import argparse
import tempfile

import torch

from astuner.trainer import Trainer


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=3000)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = ap.parse_args()
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=args.layers,
                         num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                         rope_theta=100000, tie_word_embeddings=True, initializer_range=0.041)
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as folder:
        LlamaForCausalLM(config).save_pretrained(folder)
        trainer = Trainer(folder, lr=1e-6, precision="bf16", device=args.device)
        rotary = trainer.model.model.rotary_emb
        print(f"trainer precision {trainer.precision}, parameters {next(trainer.model.parameters()).dtype}, "
              f"inv_freq {rotary.inv_freq.dtype}")
        ref = LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32).to(args.device).eval()
        ids = torch.randint(100, 40000, (args.tokens,), generator=torch.Generator().manual_seed(1)).tolist()
        prompt, response = ids[:8], ids[8:]
        with torch.no_grad():
            logits = ref(torch.tensor([ids], device=args.device)).logits[0, len(prompt) - 1:-1].float()
            want = torch.log_softmax(logits, -1).gather(-1, torch.tensor(response, device=args.device)[:, None])
        want = want[:, 0].cpu()
        bands = [(0, len(response) // 6), (len(response) // 6, len(response) // 2), (len(response) // 2, len(response))]
        for label in ("inv_freq fp32 (as trained)", "inv_freq rounded to bf16"):
            if label.startswith("inv_freq rounded"):
                rotary.inv_freq.data = rotary.inv_freq.to(torch.bfloat16).float()
            drift = (torch.tensor(trainer.compute_logprobs(prompt, response, 1.0)) - want).abs()
            print(label + ": " + ", ".join(f"positions {a}-{b} mean {drift[a:b].mean():.4f} max {drift[a:b].max():.4f}"
                                           for a, b in bands))


if __name__ == "__main__":
    main()
