"""`astuner serve` for a team, measured: good tenants train and sample at once while a bad one misbehaves.

    python bench/serve_tenants.py [--model PATH] [--steps 6] [--tenants 4]

A server process (HF engine, keys, the command's own bounds), then three phases:
  solo      each good tenant alone: its losses (the exact reference) and request latencies
  together  the good tenants at once, no bad tenant: their latencies (the floor the bad tenant is measured against)
  attacked  the good tenants at once again, while a fifth tenant, with a key of its own, names their ids, sends
            requests far ahead of its turn, oversized bodies, a flood of samples, abandons a session mid-step and is
            killed mid-request
Printed: every good tenant's losses against its solo run (exact), the bad tenant's refusals by status, the server's
memory before the bad tenant and after its sessions expired, and p50 / p95 request latency in each phase (the
bad tenant's cost: p95 attacked - p95 together). tests/test_serve_team.py runs the same scenario, smaller, in CI.
Run it alone: two cores.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
os.environ.setdefault("TINKER_TELEMETRY", "0")
GOOD_LR = 1e-2

# A client of the bad tenant's, killed while its large forward_backward is in flight.
KILLED_CLIENT = """
import sys, tinker
from tinker import types
sc = tinker.ServiceClient(base_url=sys.argv[1], api_key=sys.argv[2])
tc = sc.create_lora_training_client(base_model=sys.argv[3], rank=4).result()
tokens = list(range(1, 200))
datum = types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                    loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)})
print("sending", flush=True)
while True:  # killed while one of these is in flight
    tc.forward_backward([datum] * 2, "cross_entropy").result()
"""


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for {pid}")


def start_server(folder: Path, model: str, names: list[str], session_timeout: float) -> tuple[subprocess.Popen, str,
                                                                                                 dict]:
    """`astuner serve` with a key per name; its process, URL and the keys."""
    from astuner.serve.keys import KeyStore

    yaml = folder / "serve.yaml"
    yaml.write_text(f"astuner:\n  project_name: team\n  experiment_dir: {folder / 'out'}\n  model: {{path: {model}}}\n"
                    f"  rollout: {{engine: hf, max_env_worker: 16}}\n  trainer_common: {{micro_batch_token_budget: 256}}\n")
    store = KeyStore(folder / "out/serve/keys.json")
    keys = {name: store.create(name) for name in names}
    cmd = [sys.executable, "-m", "astuner.cli", "serve", "--conf", str(yaml), "--port", "0",
           "--max-training-clients", str(len(names) + 2), "--session-timeout", str(session_timeout),
           "--max-held-mib", "64", "--max-pending-samples", "64"]
    log = open(folder / "server.log", "w")
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=log, text=True, start_new_session=True)
    for line in proc.stderr:
        log.write(line)
        if "serving the Tinker API at" in line:
            threading.Thread(target=lambda: [(log.write(rest), log.flush()) for rest in proc.stderr],
                             daemon=True).start()
            return proc, line.split(" at ")[1].split(";")[0], keys
    raise RuntimeError(f"the server did not start: {(folder / 'server.log').read_text()[-3000:]}")


def tenant_data(index: int, n: int = 4, length: int = 48) -> list:
    from tinker import types

    data = []
    for d in range(n):
        tokens = [1 + (7919 * (index + 1) * (d + 3) * i) % 2000 for i in range(1, length + 1)]
        data.append(types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                                loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (length - 1)}))
    return data


def good_tenant(url: str, key: str, model: str, index: int, steps: int, ready: threading.Event | None = None,
                go: threading.Event | None = None) -> dict:
    """Train `steps` steps on fixed data, sampling 4 tokens after each: losses, latencies, ids (for the bad one)."""
    import tinker
    from tinker import types

    sc = tinker.ServiceClient(base_url=url, api_key=key)
    tc = sc.create_lora_training_client(base_model=model, rank=4).result()
    sampler = sc.create_sampling_client(base_model=model).result()
    data, losses, latencies = tenant_data(index), [], []
    prompt = types.ModelInput.from_ints(data[0].model_input.to_ints()[:16])
    if ready is not None:
        ready.set()
        go.wait()

    def timed(future):
        start = time.perf_counter()
        out = future.result()
        latencies.append(time.perf_counter() - start)
        return out

    for _ in range(steps):
        losses.append(timed(tc.forward_backward(data, "cross_entropy")).metrics["loss:sum"])
        timed(tc.optim_step(types.AdamParams(learning_rate=GOOD_LR)))
        timed(sampler.sample(prompt, 1, types.SamplingParams(max_tokens=4, temperature=0.0)))
    path = tc.save_state("final").result().path
    final = tc.forward(data, "cross_entropy").result().metrics["loss:sum"]
    ids = {"model_id": tc.model_id, "session": tc.model_id.split(":")[0], "state": path}
    sc.close("success").result()
    return {"losses": losses, "final": final, "latencies": latencies, "ids": ids}


class BadTenant:
    """Everything a hostile or careless client tries. `prepare` does its client-side work (a session, a training
    client, request bodies encoded) before the good tenants start, so what `attack` costs them is the server's."""

    def __init__(self, url: str, key: str, model: str, folder: Path):
        import httpx

        self.url, self.key, self.model, self.folder = url, key, model, folder
        self.http = httpx.Client(base_url=f"{url}/api/v1", headers={"X-API-Key": key}, timeout=120)
        self.seen: Counter = Counter()

    def note(self, kind: str, response) -> None:
        shaped = "json" if response.headers.get("content-type", "").startswith("application/json") and \
            isinstance(response.json().get("detail"), str) else "bare"
        self.seen[f"{kind} {response.status_code} {shaped}"] += 1

    def prepare(self) -> None:
        from tinker import types
        from tinker.proto.request_conv import forward_backward_request_to_proto

        http = self.http
        self.session = http.post("/create_session", json={}).json()["session_id"]
        made = http.post("/create_model", json={"session_id": self.session, "model_seq_id": 0,
                                                "base_model": self.model, "lora_config": {"rank": 4}}).json()
        while http.post("/retrieve_future", json={"request_id": made["request_id"]}).json().get("type") == "try_again":
            pass
        model_id = made["model_id"]

        def fb(seq: int, data: list) -> bytes:
            request = types.ForwardBackwardRequest(forward_backward_input=types.ForwardBackwardInput(
                data=data, loss_fn="cross_entropy"), model_id=model_id, seq_id=seq)
            return forward_backward_request_to_proto(request).SerializeToString()

        tokens = list(range(1, 2000))
        big = [types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs={
            "target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)})] * 800
        small = types.Datum(model_input=types.ModelInput.from_ints(tokens[:63]),
                            loss_fn_inputs={"target_tokens": tokens[1:64], "weights": [1.0] * 63})
        # ~15 MiB each, waiting for seq 1 and 2: held (to the 64 MiB a client may hold) until the session expires
        self.ahead = [fb(seq, big) for seq in range(3, 9)]
        self.far = fb(10**6, big[:1])
        self.abandoned = fb(1, [small])
        sampling = http.post("/create_sampling_session", json={"session_id": self.session, "sampling_session_seq_id": 0,
                                                               "base_model": self.model}).json()["sampling_session_id"]
        self.flood = {"sampling_session_id": sampling, "num_samples": 16, "sampling_params": {"max_tokens": 16},
                      "prompt": {"chunks": [{"type": "encoded_text", "tokens": tokens[:32]}]}}

    def attack(self, victims: list[dict]) -> Counter:
        http, proto = self.http, {"Content-Type": "application/x-protobuf"}
        for victim in victims:  # another tenant's ids: training clients, sessions, checkpoints
            self.note("foreign", http.post("/optim_step", json={"model_id": victim["model_id"], "seq_id": 1,
                                                                "adam_params": {"learning_rate": 10.0}}))
            self.note("foreign", http.post(f"/sessions/{victim['session']}/finish", json={}))
            self.note("foreign", http.post("/get_info", json={"model_id": victim["model_id"]}))
            self.note("foreign", http.post("/load_weights", json={"session_id": self.session, "model_seq_id": 99,
                                                                  "path": victim["state"], "optimizer": True}))
        for body in self.ahead:
            self.note("ahead", http.post("/forward_backward", content=body, headers=proto))
        self.note("far ahead", http.post("/forward_backward", content=self.far, headers=proto))
        self.note("oversized", http.post("/create_session", content=b"{" + b" " * (9 << 20) + b"}"))
        with ThreadPoolExecutor(8) as pool:  # a flood of samples
            for response in pool.map(lambda _: http.post("/asample", json=self.flood), range(40)):
                self.note("flood", response)
        # a session abandoned mid-step: a forward_backward in its turn, then silence (no heartbeat, no close)
        self.note("abandoned", http.post("/forward_backward", content=self.abandoned, headers=proto))
        # a client killed mid-request
        script = self.folder / "killed_client.py"
        script.write_text(KILLED_CLIENT)
        killed = subprocess.Popen([sys.executable, str(script), self.url, self.key, self.model],
                                  stdout=subprocess.PIPE, text=True, env={**os.environ, "TINKER_TELEMETRY": "0"})
        killed.stdout.readline()
        time.sleep(2.0)
        killed.send_signal(signal.SIGKILL)
        killed.wait()
        self.http.close()
        return self.seen


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))] if ordered else float("nan")


def run(model: str, steps: int = 6, tenants: int = 4, session_timeout: float = 15.0, floor: bool = True) -> dict:
    """The scenario; a dict of what was measured."""
    folder = Path(tempfile.mkdtemp(prefix="serve_tenants_"))
    names = [f"t{i}" for i in range(tenants)] + ["bad"]
    proc, url, keys = start_server(folder, model, names, session_timeout)
    report: dict = {"server_log": str(folder / "server.log")}
    try:
        solo = [good_tenant(url, keys[f"t{i}"], model, i, steps) for i in range(tenants)]

        def together(with_bad: bool) -> tuple[list[dict], Counter | None]:
            ready = [threading.Event() for _ in range(tenants)]
            go = threading.Event()
            with ThreadPoolExecutor(tenants + 1) as pool:
                futures = [pool.submit(good_tenant, url, keys[f"t{i}"], model, i, steps, ready[i], go)
                           for i in range(tenants)]
                for event in ready:
                    event.wait(300)
                bad = None
                if with_bad:
                    villain = BadTenant(url, keys["bad"], model, folder)
                    villain.prepare()
                    report["rss_before_mib"] = rss_mib(proc.pid)
                    bad = pool.submit(villain.attack, [r["ids"] for r in solo])
                go.set()
                results = [f.result() for f in futures]
                return results, (bad.result() if bad else None)

        if floor:
            quiet, _ = together(False)
            report["p50_together_ms"] = 1000 * percentile([x for r in quiet for x in r["latencies"]], 0.5)
            report["p95_together_ms"] = 1000 * percentile([x for r in quiet for x in r["latencies"]], 0.95)
        attacked, refusals = together(True)
        report["p50_attacked_ms"] = 1000 * percentile([x for r in attacked for x in r["latencies"]], 0.5)
        report["p95_attacked_ms"] = 1000 * percentile([x for r in attacked for x in r["latencies"]], 0.95)
        report["p95_solo_ms"] = 1000 * percentile([x for r in solo for x in r["latencies"]], 0.95)
        report["losses_equal"] = [a["losses"] == s["losses"] and a["final"] == s["final"]
                                  for a, s in zip(attacked, solo)]
        report["losses"] = {f"t{i}": (s["losses"], a["losses"]) for i, (s, a) in enumerate(zip(solo, attacked))}
        report["refusals"] = dict(refusals)
        # The bad tenant's two silent sessions (abandoned, killed client) expire: what they held goes with them.
        # Waited for, up to their timeout and a margin, so a run whose sessions already expired goes on at once.
        deadline = time.monotonic() + session_timeout + 8
        while (folder / "server.log").read_text().count("without a heartbeat") < 2 and time.monotonic() < deadline:
            time.sleep(0.5)
        time.sleep(2)  # the server returns freed memory just after it logs the expiry
        report["rss_after_mib"] = rss_mib(proc.pid)
        report["expired"] = (folder / "server.log").read_text().count("without a heartbeat")
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a model folder (default: a tiny random Llama on the demo "
                        "tokenizer, as the tests use)")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--tenants", type=int, default=4)
    args = parser.parse_args()
    from identical_runs import tiny_model  # the tests' tiny model, beside this file

    model = args.model or str(tiny_model(Path(tempfile.mkdtemp(prefix="tiny_"))))
    report = run(model, args.steps, args.tenants)
    print(json.dumps({k: v for k, v in report.items() if k != "losses"}, indent=1))
    print(f"{args.tenants} good tenants, {args.steps} steps each (forward_backward, optim_step, a 4-token sample):")
    print(f"  losses equal to each one's solo run: {report['losses_equal']}")
    print(f"  request latency p95: solo {report['p95_solo_ms']:.0f} ms, together {report['p95_together_ms']:.0f} ms, "
          f"attacked {report['p95_attacked_ms']:.0f} ms (the bad tenant's cost: "
          f"{report['p95_attacked_ms'] - report['p95_together_ms']:+.0f} ms; p50 {report['p50_together_ms']:.0f} -> "
          f"{report['p50_attacked_ms']:.0f} ms)")
    print(f"  server memory: {report['rss_before_mib']:.0f} MiB before the bad tenant, "
          f"{report['rss_after_mib']:.0f} MiB after its sessions expired ({report['expired']} expired)")


if __name__ == "__main__":
    main()
