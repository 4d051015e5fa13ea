"""The LM head on trained tokens alone (`trained_only`, trainer/forward.py) against the head over every response
token, on an agent's conversations: the long-horizon tutorial's warm-start demonstrations (tool outputs carry no
loss), on the demo model (SmolLM2-135M, fp32, CPU) or any other.

    python bench/trained_only_head.py [--model PATH] [--rows 4] [--repeats 3]

Prints, for each way, the best seconds of one forward_backward of the same SFT batch, its tokens per second,
the peak resident memory it added, and the two losses (the same up to rounding).
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
from pathlib import Path

from timing import best_of

REPO = Path(__file__).resolve().parents[1]
DEMOS = REPO / "tutorial" / "long_horizon" / "logs" / "demos.jsonl"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="demo:smollm2-135m-instruct")
    parser.add_argument("--rows", type=int, default=4, help="conversations in the batch (the warm start's 4)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--mode", choices=("full", "trained"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    sys.path.insert(0, str(REPO))
    import torch

    from astuner.model_cache import resolve_model_path
    from astuner.model_tuner import ChatRenderer
    from astuner.task_reader.offline_data import tokenize_conversation
    from astuner.tokenizer import load_tokenizer
    from astuner.trainer import Trainer

    torch.manual_seed(0)
    path = resolve_model_path(args.model)
    tokenizer = load_tokenizer(path)
    renderer = ChatRenderer(tokenizer)
    rows = [json.loads(line) for line in DEMOS.read_text().splitlines()[: args.rows]]
    samples = [tokenize_conversation(renderer, r["messages"], r.get("tools"), ("<|im_end|>",)).as_sample(str(i))
               for i, r in enumerate(rows)]
    response = sum(len(s.response_ids) for s in samples)
    trained = sum(s.num_trained_tokens for s in samples)
    tokens = sum(s.num_tokens for s in samples)
    if args.mode is None:
        print(f"{args.model}: {len(samples)} conversations, {tokens} tokens, {response} response tokens of which "
              f"{trained} trained ({trained / response:.0%})")
        # each way in a process of its own, so that each peak is its own
        for mode in ("full", "trained"):
            subprocess.run([sys.executable, __file__, "--mode", mode, *sys.argv[1:]], check=True)
        return
    trainer = Trainer(path, lr=1e-6, device="cpu", max_token_len_per_micro_batch=8192, precision="fp32")
    trained_only = args.mode == "trained"
    loss = []

    def step():
        trainer.zero_grad()
        loss.append(trainer.forward_backward(samples, "sft", trained_only=trained_only)["loss"])

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    seconds = best_of(step, args.repeats)
    grown = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 2**20
    print(f"  head on {'trained tokens' if trained_only else 'every response token'}: {seconds:.2f} s, "
          f"{tokens / seconds:.0f} tokens/s, peak memory +{grown:.2f} GiB, loss {loss[-1]:.6f}")


if __name__ == "__main__":
    main()
