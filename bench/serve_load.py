"""`astuner serve` on loopback: what the service adds to a call, and how it holds under concurrent clients.

    python bench/serve_load.py [--model demo:smollm2-135m-instruct] [--calls 30] [--clients 4] [--concurrency 16]

1. Added latency: the same request in-process (HF engine `generate`, Trainer `forward_backward` of the same datum)
   and through the `tinker` SDK against the server in this process (HTTP on 127.0.0.1, the SDK's futures and
   long polls, protobuf); `--calls` sequential calls each, medians and their difference.
2. Load: `--clients` processes, each a ServiceClient with `--concurrency` sample requests in flight (a thread pool),
   `--per-client` requests each: requests/s, latency p50/p95/max, errors.
Run it alone: two cores.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
os.environ.setdefault("TINKER_TELEMETRY", "0")
PROMPT = "The three primary colours are"


def median_ms(fn, calls: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1000


def client_process(url: str, model: str, n: int, concurrency: int, max_tokens: int) -> None:
    """One load client: n sample requests, `concurrency` in flight; prints a JSON line of latencies and errors."""
    from concurrent.futures import ThreadPoolExecutor

    import tinker
    from tinker import types

    service = tinker.ServiceClient(base_url=url, api_key="tml-local")
    sampler = service.create_sampling_client(base_model=model).result()
    tokens = json.loads(os.environ["BENCH_TOKENS"])
    params = types.SamplingParams(max_tokens=max_tokens, temperature=1.0, stop=[])

    def one(_):
        start = time.perf_counter()
        try:
            sampler.sample(types.ModelInput.from_ints(tokens), 1, params).result()
            return time.perf_counter() - start, None
        except Exception as exc:  # noqa: BLE001 - counted and reported
            return time.perf_counter() - start, f"{type(exc).__name__}: {exc}"[:200]

    begin = time.time()
    with ThreadPoolExecutor(concurrency) as pool:
        results = list(pool.map(one, range(n)))
    print(json.dumps({"latencies": [r[0] for r in results], "errors": [r[1] for r in results if r[1]],
                      "begin": begin, "end": time.time()}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="demo:smollm2-135m-instruct")
    parser.add_argument("--calls", type=int, default=30)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--per-client", type=int, default=64)
    parser.add_argument("--client", nargs=5, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.client:
        url, model, n, concurrency, max_tokens = args.client
        return client_process(url, model, int(n), int(concurrency), int(max_tokens))
    sys.path.insert(0, str(REPO))
    import tinker
    from tinker import types

    from astuner.config import load_config
    from astuner.serve import build_service, tinker_server
    from astuner.serve.limits import ServeLimits
    from astuner.serve.keys import KeyStore
    from astuner.types import Sample, SamplingParams

    folder = Path(tempfile.mkdtemp(prefix="astuner_serve_load_"))
    yaml = (f"astuner:\n  experiment_dir: {folder / 'out'}\n  model: {{path: {args.model}}}\n"
            f"  rollout: {{engine: hf, max_env_worker: 64}}\n")
    (folder / "serve.yaml").write_text(yaml)
    service = build_service(load_config(str(folder / "serve.yaml"), []), ServeLimits(max_training_clients=1))
    server = tinker_server(service, KeyStore(folder / "keys.json"))
    url = server.start()
    tokens = service.tokenizer.encode(PROMPT)
    sdk = tinker.ServiceClient(base_url=url, api_key="tml-local")
    sampler = sdk.create_sampling_client(base_model=args.model).result()
    params = SamplingParams(temperature=1.0, max_tokens=args.max_tokens)
    loop = asyncio.new_event_loop()
    engine_ms = median_ms(lambda: loop.run_until_complete(service.engine.generate(tokens, params)), args.calls)
    sdk_params = types.SamplingParams(max_tokens=args.max_tokens, temperature=1.0, stop=[])
    sample_ms = median_ms(lambda: sampler.sample(types.ModelInput.from_ints(tokens), 1, sdk_params).result(),
                          args.calls)

    trainer_client = sdk.create_lora_training_client(base_model=args.model, rank=16).result()
    model_id = trainer_client.get_info().model_id
    trainer = service.models[model_id].trainer
    text = service.tokenizer.encode("The three primary colours are red, yellow and blue. " * 4)
    datum = types.Datum(model_input=types.ModelInput.from_ints(text[:-1]),
                        loss_fn_inputs={"target_tokens": text[1:], "weights": [1.0] * (len(text) - 1)})
    sample = Sample([text[0]], text[1:], [0.0] * (len(text) - 1), 0.0, 1.0, "bench")
    direct_ms = median_ms(lambda: trainer.forward_backward([sample], "sft"), args.calls)
    remote_ms = median_ms(lambda: trainer_client.forward_backward([datum], "cross_entropy").result(), args.calls)
    trainer.zero_grad()
    print(f"model {args.model}, {args.max_tokens} tokens sampled, a {len(text)}-token datum, medians of "
          f"{args.calls} sequential calls:")
    print(f"  sample            in-process {engine_ms:8.1f} ms   via the SDK {sample_ms:8.1f} ms   added "
          f"{sample_ms - engine_ms:6.1f} ms")
    print(f"  forward_backward  in-process {direct_ms:8.1f} ms   via the SDK {remote_ms:8.1f} ms   added "
          f"{remote_ms - direct_ms:6.1f} ms")

    env = {**os.environ, "BENCH_TOKENS": json.dumps(tokens), "PYTHONPATH": str(REPO)}
    procs = [subprocess.Popen([sys.executable, __file__, "--client", url, args.model, str(args.per_client),
                               str(args.concurrency), str(args.max_tokens)], stdout=subprocess.PIPE, text=True,
                              env=env) for _ in range(args.clients)]
    outs = [json.loads(p.communicate()[0].strip().splitlines()[-1]) for p in procs]
    wall = max(o["end"] for o in outs) - min(o["begin"] for o in outs)  # the requests' span, not the start-up
    latencies = sorted(x for o in outs for x in o["latencies"])
    errors = [e for o in outs for e in o["errors"]]
    q = statistics.quantiles(latencies, n=20)
    print(f"load: {args.clients} client processes x {args.concurrency} in flight, {len(latencies)} sample requests "
          f"in {wall:.1f} s: {len(latencies) / wall:.1f} requests/s ({len(latencies) * args.max_tokens / wall:.0f} "
          f"tokens/s); latency p50 {statistics.median(latencies) * 1000:.0f} ms, p95 {q[18] * 1000:.0f} ms, max "
          f"{latencies[-1] * 1000:.0f} ms; errors {len(errors)}" + (f" (first: {errors[0]})" if errors else ""))
    server.stop()


if __name__ == "__main__":
    main()
