"""Remote agents measured: what the service adds to a model call, and a run whose episodes 4 processes serve.

    python bench/remote_load.py [--model demo:smollm2-135m-instruct] [--calls 30] [--clients 4] [--concurrency 16]

1. Added latency: one episode at a time makes --calls sequential model calls of 8 tokens (the same prompt, only
   calls that produced all 8 tokens counted) in three ways, each a 1-step run of the same YAML and HF engine:
   `model_tuner.chat` in a local workflow (in-process, no HTTP), the local workflow's `get_openai_client()` (the
   run's loopback OpenAI endpoint), and a remote client process through `astuner serve` (`RemoteClient`, the
   episode's `openai_client()`). Medians of the client-side wall time of each call.
2. Load: `astuner serve` with --clients processes x --concurrency episodes at once (64 by default: a step's
   train_batch_size 8 x num_repeat 8), --steps steps, each episode two model calls of up to 16 tokens: wall time,
   episodes/s, call latency p50/p95/max as the clients saw it, client errors and flagged episodes.
Run it alone: two cores. Not a test: nothing here asserts a speed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from astuner.workflow import Workflow, WorkflowOutput  # light: no torch

REPO = Path(__file__).resolve().parents[1]
PROMPT = [{"role": "user", "content": "Count slowly from one to fifty, one number per line."}]
TOKENS = 8


def yaml(folder: Path, model: str, workflow: str, batch: int, repeat: int, steps: int, max_tokens: int) -> Path:
    budget = 2 * int(os.environ["BENCH_CALLS"]) * max_tokens + 64  # an episode's token budget: no overflow
    val = folder / "val.jsonl"
    val.write_text((REPO / "tutorial/agent_quickstart/data/val.jsonl").read_text().splitlines()[0] + "\n")
    text = f"""astuner:
  project_name: remote_load
  experiment_dir: {folder / 'out'}
  model: {{path: {model}}}
  task_reader:
    type: jsonl_dataset_file
    jsonl_dataset_file:
      training: {{file_path: {REPO / 'tutorial/agent_quickstart/data/train.jsonl'}}}
      validation: {{file_path: {val}}}
    task_id_field: id
  data: {{train_batch_size: {batch}, max_prompt_length: 512, max_response_length: {budget}}}
  rollout:
    agentscope_workflow: {workflow}
    engine: hf
    episode_timeout: 600
    temperature: 1.0
    num_repeat: {repeat}
    max_env_worker: {batch * repeat}
    max_response_length_in_one_turn: {max_tokens}
    max_model_len: 1024
  task_judge: {{judge_protocol: {REPO / 'tutorial/agent_quickstart/lookup_task.py'}->CodeJudge}}
  trainer_common: {{total_training_steps: {steps}, test_freq: 1000, val_before_train: false, optim: {{lr: 1.0e-6}}}}
"""
    path = folder / "bench.yaml"
    path.write_text(text)
    return path


class TimedCalls(Workflow):
    """The local workflow of part 1: sequential calls through `chat` or the loopback OpenAI client, timed."""

    async def execute(self, workflow_task, model_tuner) -> WorkflowOutput:
        calls, use_client = int(os.environ["BENCH_CALLS"]), os.environ["BENCH_PATH"] == "client"
        client = model_tuner.get_openai_client() if use_client else None
        times = []
        for _ in range(calls if not workflow_task.is_validation else 1):
            start = time.perf_counter()
            if use_client:
                await client.chat.completions.create(model="policy", messages=PROMPT)
            else:
                await model_tuner.chat(PROMPT)
            times.append(time.perf_counter() - start)
        return WorkflowOutput(reward=0.0, metadata={"call_s": times})


async def remote_sequential(episode) -> dict:
    client, times = episode.openai_client(), []
    for _ in range(int(os.environ["BENCH_CALLS"]) if not episode.is_validation else 1):
        start = time.perf_counter()
        await client.chat.completions.create(model=episode.model, messages=PROMPT)
        times.append(time.perf_counter() - start)
    return {"reward": 0.0, "metadata": {"call_s": times}}


def counted_times(out: Path) -> list[float]:
    """The timed calls of the training episodes that produced all TOKENS tokens."""
    times = []
    for line in (out / "trajectories/train_step_000001.jsonl").read_text().splitlines():
        episode = json.loads(line)
        for seconds, call in zip(episode["output_metadata"]["call_s"], episode["calls"]):
            if call["response_tokens"] == TOKENS:
                times.append(seconds)
    return times


def start_serve(conf: Path, port: int, log: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "astuner.cli", "serve", "--conf", str(conf), "--port", str(port)],
                            stdout=open(log, "w"), stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True)


def clients(url: str, n: int, concurrency: int, mode: str, env: dict) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, __file__, "--client", url, str(concurrency), mode],
                             stdout=subprocess.PIPE, text=True, env=env, cwd=REPO) for _ in range(n)]


def client_process(url: str, concurrency: int, mode: str) -> None:
    """A remote client: runs episodes until the run is over; prints a JSON line of call latencies and errors."""
    from astuner.remote import RemoteClient

    latencies, errors = [], []

    async def load_agent(episode) -> dict:
        client = episode.openai_client()
        messages = [{"role": "user", "content": episode.task["query"]}]
        for _ in range(2):
            start = time.perf_counter()
            try:
                reply = await client.chat.completions.create(model=episode.model, messages=messages)
            except Exception as exc:
                errors.append(f"{type(exc).__name__}: {exc}"[:200])
                raise
            latencies.append(time.perf_counter() - start)
            messages += [{"role": "assistant", "content": reply.choices[0].message.content or ""},
                         {"role": "user", "content": "Say it in other words."}]
        return {"reward": float(len(reply.choices[0].message.content or "") % 2)}

    agent = remote_sequential if mode == "sequential" else load_agent
    begin = time.time()
    done = RemoteClient(url, reconnect_s=60).run(agent, concurrency=concurrency, idle_exit_s=300)
    print(json.dumps({"episodes": done, "latencies": latencies, "errors": errors, "begin": begin,
                      "end": time.time()}))


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def part1(args, env: dict) -> None:
    medians = {}
    for path in ("chat", "client", "remote"):
        folder = Path(tempfile.mkdtemp(prefix=f"astuner_remote_load_{path}_"))
        if path == "remote":
            conf = yaml(folder, args.model, "astuner.serve.remote_board->RemoteAgents", 1, 1, 1, TOKENS)
            port = free_port()
            procs = clients(f"http://127.0.0.1:{port}", 1, 1, "sequential", env)
            server = start_serve(conf, port, folder / "serve.log")
            assert server.wait(timeout=1800) == 0, (folder / "serve.log").read_text()[-3000:]
            for p in procs:
                p.communicate(timeout=120)
        else:
            conf = yaml(folder, args.model, f"{Path(__file__).resolve()}->TimedCalls", 1, 1, 1, TOKENS)
            subprocess.run([sys.executable, "-m", "astuner.cli", "--conf", str(conf), "--backbone", "debug"],
                           env={**env, "BENCH_PATH": path}, cwd=REPO, check=True, capture_output=True)
        times = counted_times(folder / "out")
        medians[path] = statistics.median(times) * 1000
        print(f"  {path:7s} {len(times):3d} calls of {TOKENS} tokens, median {medians[path]:7.1f} ms", flush=True)
    print(f"added by the service over model_tuner.chat: {medians['remote'] - medians['chat']:+.1f} ms; over the "
          f"local loopback OpenAI client: {medians['remote'] - medians['client']:+.1f} ms", flush=True)


def part2(args, env: dict) -> None:
    folder = Path(tempfile.mkdtemp(prefix="astuner_remote_load_"))
    batch = args.clients * args.concurrency // 8
    conf = yaml(folder, args.model, "astuner.serve.remote_board->RemoteAgents", batch, 8, args.steps, 16)
    port = free_port()
    procs = clients(f"http://127.0.0.1:{port}", args.clients, args.concurrency, "load", env)
    start = time.time()
    server = start_serve(conf, port, folder / "serve.log")
    code = server.wait(timeout=3600)
    wall = time.time() - start
    outs = [json.loads(p.communicate(timeout=300)[0].strip().splitlines()[-1]) for p in procs]
    latencies = sorted(x for o in outs for x in o["latencies"])
    errors = [e for o in outs for e in o["errors"]]
    episodes = [json.loads(line) for f in sorted((folder / "out/trajectories").glob("train_step_*.jsonl"))
                for line in f.read_text().splitlines()]
    flagged = [e for e in episodes if e["flags"]]
    q = statistics.quantiles(latencies, n=20)
    print(f"load: serve exit {code}; {args.clients} client processes x {args.concurrency} concurrent episodes, "
          f"{args.steps} steps of {batch} tasks x 8 in {wall:.0f} s (with model load and training): "
          f"{len(episodes)} training episodes ({[o['episodes'] for o in outs]} per client, validation included), "
          f"{len(latencies)} model calls; call latency p50 {statistics.median(latencies) * 1000:.0f} ms, "
          f"p95 {q[18] * 1000:.0f} ms, max {latencies[-1] * 1000:.0f} ms; client errors {len(errors)}"
          + (f" (first: {errors[0]})" if errors else "") + f"; flagged episodes {len(flagged)}"
          + (f" (first: {flagged[0]['flags']} {flagged[0].get('error', '')[:200]})" if flagged else ""), flush=True)
    print(f"  the run's folder: {folder}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="demo:smollm2-135m-instruct")
    parser.add_argument("--calls", type=int, default=30)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--only", choices=["latency", "load"], default=None)
    parser.add_argument("--client", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.client:
        url, concurrency, mode = args.client
        return client_process(url, int(concurrency), mode)
    os.environ["BENCH_CALLS"] = str(args.calls)  # the episodes' token budget (`yaml`) and the timed workflows
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1"}
    if args.only != "load":
        print(f"added latency, model {args.model}, {args.calls} sequential calls per path:", flush=True)
        part1(args, env)
    if args.only != "latency":
        part2(args, env)


if __name__ == "__main__":
    main()
