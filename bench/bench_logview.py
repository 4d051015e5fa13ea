"""The log viewer on a large run: store size, write time per step, and the endpoints' latency.

    python bench/bench_logview.py [--steps 100] [--episodes 256] [--calls 4] [--tokens 256]

Builds a synthetic run with the monitor's own writer (steps x episodes x calls, each call with `--tokens`
response tokens and token-level data) and times what the viewer's pages ask for: the steps summary, one page of
a step's episodes (filtered and sorted), and one episode with all its tokens, through the real Starlette app.
Not a test: nothing here asserts a speed.
"""

from __future__ import annotations

import argparse
import random
import tempfile
import time
from pathlib import Path


def synthetic_records(rng: random.Random, episodes: int, calls: int, tokens: int) -> list[dict]:
    out = []
    for e in range(episodes):
        reward = rng.random()
        out.append({
            "uid": f"train:t{e // 8}#{e % 8}", "task_id": f"t{e // 8}", "query": "What is 17 * 23?" * 4,
            "reward": reward, "success": reward > 0.5, "flags": ["overflow"] if rng.random() < 0.05 else [],
            "error": None, "seconds": rng.random() * 30, "advantage": reward - 0.5, "output": {"final_answer": "391"},
            "calls": [{
                "agent": "", "trainable": True, "messages": [{"role": "user", "content": "x" * 400},
                                                             {"role": "assistant", "content": "y" * 600}],
                "response_text": "y" * 600, "finish_reason": "stop", "flags": [], "prompt_tokens": 900,
                "tokens": {"ids": [rng.randrange(50000) for _ in range(tokens)],
                           "text": ["tok"] * tokens,
                           "logprob": [round(-rng.random() * 3, 5) for _ in range(tokens)],
                           "trainer_logprob": [round(-rng.random() * 3, 5) for _ in range(tokens)],
                           "mask": [1] * tokens, "advantage": reward - 0.5},
            } for _ in range(calls)],
        })
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--episodes", type=int, default=256)
    parser.add_argument("--calls", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=256)
    args = parser.parse_args()

    from starlette.testclient import TestClient

    from astuner.logview.app import build_app
    from astuner.logview.store import FILE_NAME, StepWriter

    rng = random.Random(0)
    with tempfile.TemporaryDirectory() as tmp:
        run = Path(tmp) / "big_run"
        run.mkdir()
        (run / "metrics.jsonl").write_text("".join(
            f'{{"step": {s}, "train/reward_mean": {rng.random():.3f}}}\n' for s in range(1, args.steps + 1)))
        writer = StepWriter(run)
        write_s = []
        for step in range(1, args.steps + 1):
            records = synthetic_records(rng, args.episodes, args.calls, args.tokens)
            start = time.perf_counter()
            writer.write("train", step, records)
            write_s.append(time.perf_counter() - start)
        writer.close()
        size_mb = (run / FILE_NAME).stat().st_size / 2**20
        total = args.steps * args.episodes
        print(f"store      {args.steps} steps x {args.episodes} episodes x {args.calls} calls x {args.tokens} tokens "
              f"= {total} episodes, {size_mb:.0f} MiB; writing a step takes {sorted(write_s)[len(write_s) // 2]:.2f} s "
              "(median)")

        client = TestClient(build_app(Path(tmp)))
        middle = args.steps // 2
        cases = [
            ("runs", "/api/runs", {}),
            ("metrics", "/api/runs/big_run/metrics", {}),
            ("steps summary", "/api/runs/big_run/steps", {}),
            ("episodes page", "/api/runs/big_run/episodes", {"step": middle, "page": 2, "page_size": 50}),
            ("... sorted+filtered", "/api/runs/big_run/episodes",
             {"step": middle, "sort": "-reward", "min_reward": 0.3, "flag": "none"}),
        ]
        first = client.get("/api/runs/big_run/episodes", params={"step": middle}).json()["items"][0]["id"]
        cases.append(("one episode", f"/api/runs/big_run/episodes/{first}", {}))
        for name, path, params in cases:
            times = []
            for _ in range(5):
                start = time.perf_counter()
                response = client.get(path, params=params)
                times.append(time.perf_counter() - start)
                assert response.status_code == 200, (path, response.text[:200])
            print(f"endpoint   {name:<20} {min(times) * 1000:7.1f} ms  ({len(response.content) / 1024:.0f} KiB)")


if __name__ == "__main__":
    main()
