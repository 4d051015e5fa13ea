"""`astuner serve`'s parts: the hand-written protobuf against the SDK's generated one, fuzzed; the losses by hand;
the training queue's order; keys; the command's refusals and its save at Ctrl-C."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from astuner.serve import wire_proto as wp
from astuner.serve.futures import Futures, Outcome, TrainingQueue
from astuner.serve.tinker_losses import cispo, cross_entropy, dro, gspo, importance_sampling, ppo

pb = pytest.importorskip("tinker.proto.tinker_public_pb2") if sys.version_info < (3, 11) else \
    __import__("tinker.proto.tinker_public_pb2", fromlist=["x"])
os.environ["TINKER_TELEMETRY"] = "0"


def _request(sparse: bool) -> bytes:
    r = pb.ForwardBackwardRequest(model_id="s-1:train:0", seq_id=7, loss_fn="ppo", forward_only=True)
    r.loss_fn_config["clip_low_threshold"] = 0.5
    r.loss_fn_config_v2["clip_low_threshold"].number = 0.7  # v2 wins
    d = r.data.add()
    d.model_input.add().encoded_text.tokens = np.array([7, 8], "<i4").tobytes()
    d.model_input.add().encoded_text.tokens = np.array([300000], "<i4").tobytes()
    t = d.loss_fn_inputs["target_tokens"]
    t.dtype, t.dense = pb.DTYPE_INT64, np.array([8, 300000, 5], "<i8").tobytes()
    t.shape.extend([3])
    w = d.loss_fn_inputs["weights"]
    w.dtype = pb.DTYPE_FLOAT32
    if sparse:  # [[0, 2.5], [0, 0]] as CSR
        w.shape.extend([2, 2])
        w.sparse_csr.values = np.array([2.5], "<f4").tobytes()
        w.sparse_csr.crow_indices = np.array([0, 1, 1], "<i8").tobytes()
        w.sparse_csr.col_indices = np.array([1], "<i8").tobytes()
    else:
        w.shape.extend([3])
        w.dense = np.array([0, 1, 0.5], "<f4").tobytes()
    return r.SerializeToString()


def test_a_forward_backward_request_reads_as_the_sdk_wrote_it():
    req = wp.read_forward_backward(_request(sparse=False))
    assert (req.model_id, req.seq_id, req.loss_fn, req.forward_only) == ("s-1:train:0", 7, "ppo", True)
    assert req.config == {"clip_low_threshold": 0.7}
    assert req.data[0].tokens.tolist() == [7, 8, 300000]
    assert req.data[0].inputs["target_tokens"].tolist() == [8, 300000, 5]
    assert req.data[0].inputs["weights"].tolist() == [0, 1, 0.5]
    sparse = wp.read_forward_backward(_request(sparse=True)).data[0].inputs["weights"]
    assert sparse.tolist() == [[0, 2.5], [0, 0]]


def test_results_parse_with_the_sdks_messages():
    out = pb.ForwardBackwardOutput()
    out.ParseFromString(wp.forward_backward_output({"logprobs": [np.array([-1.0, -2.0]), np.array([-3.0])]}, 2,
                                                   {"loss:sum": 3.5}))
    record = out.loss_fn_outputs[0]
    assert record.num_datums == 2 and dict(out.metrics) == {"loss:sum": 3.5}
    assert np.frombuffer(record.fields["logprobs"].data, "<f4").tolist() == [-1, -2, -3]
    assert np.frombuffer(record.fields["logprobs"].offsets, "<i8").tolist() == [0, 8, 12]
    sample = pb.SampleResponse()
    sample.ParseFromString(wp.sample_response([([1, 2], [-0.5, -0.25], "length"), ([3], [-1.0], "stop")],
                                              [float("nan"), -1.0]))
    assert [s.stop_reason for s in sample.sequences] == [pb.STOP_REASON_LENGTH, pb.STOP_REASON_STOP]
    assert np.frombuffer(sample.sequences[0].tokens, "<i4").tolist() == [1, 2]
    assert np.isnan(np.frombuffer(sample.prompt_logprobs, "<f4")[0])


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=200))
def test_any_body_reads_or_fails_as_a_proto_error(body):
    try:
        wp.read_forward_backward(body)
    except wp.ProtoError:
        pass


@settings(max_examples=300, deadline=None)
@given(st.integers(0, len(_request(False)) - 1), st.integers(0, 255))
def test_a_corrupted_request_reads_or_fails_as_a_proto_error(pos, byte):
    body = bytearray(_request(False))
    body[pos] = byte
    try:
        wp.read_forward_backward(bytes(body))
    except wp.ProtoError:
        pass


def test_losses_by_hand():
    logp = torch.tensor([-1.0, -2.0], requires_grad=True)
    q = torch.tensor([-1.0, -2.5])
    adv = torch.tensor([1.0, 1.0])
    assert cross_entropy(logp, torch.tensor([1.0, 0.5])).item() == pytest.approx(2.0)
    # ratio [1, e^0.5 = 1.6487]: IS -(1 + 1.6487); PPO clips the second at 1.2: -(1 + 1.2)
    assert importance_sampling(logp, q, adv).item() == pytest.approx(-(1 + np.exp(0.5)), rel=1e-6)
    assert ppo(logp, q, adv, 0.8, 1.2).item() == pytest.approx(-2.2, rel=1e-6)
    # with a negative advantage the unclipped (larger) loss is kept: -min(-1.6487, -1.2) = 1.6487
    assert ppo(logp, q, -adv, 0.8, 1.2).item() == pytest.approx(-(-1) + np.exp(0.5), rel=1e-6)
    loss = cispo(logp, q, adv, 0.8, 1.2)  # -(1 * -1 + 1.2 * -2) = 3.4; gradient -clip(ratio) * A, no ratio grad
    assert loss.item() == pytest.approx(3.4, rel=1e-6)
    loss.backward()
    assert logp.grad.tolist() == pytest.approx([-1.0, -1.2])
    # DRO, beta 0.1: -((-1)(1) - 0.05 * 0 + (-2)(1) - 0.05 * 0.25) = 3.0125; gradient -(A - beta (logp - q)) =
    # [-1, -(1 - 0.1 * 0.5)] = [-1, -0.95]
    logp.grad = None
    loss = dro(logp, q, adv, 0.1)
    assert loss.item() == pytest.approx(3.0125, rel=1e-6)
    loss.backward()
    assert logp.grad.tolist() == pytest.approx([-1.0, -0.95])


def test_gspo_by_hand():
    """One datum of two sampled tokens: log-ratios 0 and 0.5, so s = exp(0.25) = 1.2840 for both. Clipped at 1.2,
    each token gives min(1.284, 1.2) = 1.2: L = -2.4 and no gradient; with hi 1.5, L = -2 * 1.284 and each token's
    gradient is -s * A = -1.284 (the sequence's ratio, GSPO-token). A masked-out token counts neither in s nor in
    L; two data have a ratio each."""
    logp = torch.tensor([-1.0, -2.0], requires_grad=True)
    q, adv, mask, seq = torch.tensor([-1.0, -2.5]), torch.tensor([1.0, 1.0]), torch.ones(2), torch.zeros(2, dtype=torch.long)
    s = float(np.exp(0.25))
    loss = gspo(logp, q, adv, mask, seq, 0.8, 1.2)
    assert loss.item() == pytest.approx(-2.4, rel=1e-6)
    loss.backward()
    assert logp.grad.tolist() == pytest.approx([0.0, 0.0])
    logp.grad = None
    loss = gspo(logp, q, adv, mask, seq, 0.8, 1.5)
    assert loss.item() == pytest.approx(-2 * s, rel=1e-6)
    loss.backward()
    assert logp.grad.tolist() == pytest.approx([-s, -s], rel=1e-6)
    # the first token masked out: s = exp(0.5) over the second alone, and only the second is in L
    assert gspo(logp, q, adv, torch.tensor([0.0, 1.0]), seq, 0.8, 2.0).item() == pytest.approx(-np.exp(0.5), rel=1e-6)
    # two data, one token each: ratios exp(0) and exp(0.5), each its own
    got = gspo(logp, q, adv, mask, torch.tensor([0, 1]), 0.5, 2.0).item()
    assert got == pytest.approx(-(1.0 + np.exp(0.5)), rel=1e-6)


def test_training_requests_run_in_seq_order_and_repeats_get_one_id():
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    queue = TrainingQueue(Futures(loop))
    queue.open("m", "local")
    ran: list[int] = []

    def job(i):
        return lambda: (ran.append(i), Outcome(json={"i": i}))[1]

    ids = [queue.submit("m", seq, job(seq)) for seq in (3, 2)]
    time.sleep(0.2)
    assert ran == []  # 1 has not come
    assert queue.submit("m", 3, job(99)) == ids[0]  # a retry of 3: the same request
    queue.submit("m", 1, job(1))
    deadline = time.monotonic() + 10
    while len(ran) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    queue.shutdown()
    assert ran == [1, 2, 3]
    loop.call_soon_threadsafe(loop.stop)


def test_the_training_thread_takes_tenants_in_turn():
    """A tenant with ten requests ready does not hold another's behind them: the thread alternates."""
    from astuner.serve.futures import FairWorker

    gate, ran, done = threading.Event(), [], threading.Event()
    worker = FairWorker()
    worker.submit("first", gate.wait)  # holds the thread while the rest arrive
    for i in range(10):
        worker.submit("flood", ran.append, f"flood{i}")
    for i in range(2):
        worker.submit("quiet", ran.append, f"quiet{i}")
    worker.submit("quiet", done.set)
    gate.set()
    assert done.wait(10)
    worker.shutdown()
    assert ran[:4] == ["flood0", "quiet0", "flood1", "quiet1"], ran


def test_a_tenants_samples_hold_a_bounded_share_of_the_engine():
    """At most `share` sequences of one tenant in the engine at once; another tenant's request goes in meanwhile."""
    from astuner.serve.tinker_sampling import EngineShares

    shares, inside, order = EngineShares(4), {"a": 0, "b": 0}, []

    async def request(tenant, n):
        async with shares.hold(tenant, n):
            inside[tenant] += n
            assert inside["a"] <= 4
            order.append(tenant)
            await asyncio.sleep(0.02)
            inside[tenant] -= n

    async def main():
        flood = [asyncio.create_task(request("a", 4)) for _ in range(5)]
        await asyncio.sleep(0.005)
        await request("b", 1)  # waits for none of a's queue
        await asyncio.gather(*flood)

    asyncio.run(main())
    assert order.index("b") <= 1, order


def test_a_stream_of_one_snapshots_requests_does_not_starve_another():
    """Requests for snapshot A keep arriving (each holds the engine 5 ms); one for B arrives among them. The engine
    drains A's, switches to B and serves it, then A's later requests; without the fairness B waits for the end."""
    from astuner.serve.snapshots import EngineGate, Snapshot

    class Engine:
        def __init__(self):
            self.loads = []

        def load_weights(self, tensors):
            self.loads.append(dict(tensors)["w"])

    engine, order = Engine(), []
    gate = EngineGate(lambda: engine)
    gate._base = {"w": "base"}
    a, b = Snapshot("a", "m", tensors={"w": "a"}), Snapshot("b", "m", tensors={"w": "b"})

    async def request(snapshot, name):
        async with gate.serving(snapshot):
            order.append(name)
            await asyncio.sleep(0.005)

    async def main():
        tasks = []
        for i in range(40):
            tasks.append(asyncio.create_task(request(a, f"a{i}")))
            if i == 5:
                tasks.append(asyncio.create_task(request(b, "b")))
            await asyncio.sleep(0.001)  # a new A request before the last one is done
        await asyncio.gather(*tasks)

    asyncio.run(main())
    assert order.index("b") < 15, order  # served in its turn, not after all 40
    assert engine.loads[:2] == ["a", "b"] and len(engine.loads) <= 3  # A's requests kept together around it


def test_keys_are_stored_as_digests_and_revoked_at_once(tmp_path):
    from astuner.serve.keys import KeyStore

    store = KeyStore(tmp_path / "keys.json")
    assert not store.any()
    key = store.create("laptop")
    assert key.startswith("tml-") and key not in (tmp_path / "keys.json").read_text()
    assert oct((tmp_path / "keys.json").stat().st_mode & 0o777) == "0o600"
    server_view = KeyStore(tmp_path / "keys.json")
    assert server_view.owner(key) == "laptop" and server_view.owner("tml-guess") is None
    time.sleep(0.01)
    assert store.revoke("laptop") == 0
    assert server_view.owner(key) is None and server_view.revoked(key) == "laptop"
    assert server_view.revoked("tml-guess") is None
    # The last key revoked: the server stays closed to every key, on loopback too (it never silently reopens)...
    assert not server_view.any() and not server_view.open_access()
    (tmp_path / "keys.json").unlink()  # ...until the file is deleted
    assert KeyStore(tmp_path / "keys.json").open_access()


def test_serve_refuses_another_host_without_keys(tmp_path, tiny_model_dir, capsys):
    from astuner.cli import main
    from test_serve_tinker import write_yaml

    yaml = write_yaml(tmp_path, tiny_model_dir)
    assert main(["serve", "--conf", str(yaml), "--host", "0.0.0.0"]) == 2
    assert "needs keys" in capsys.readouterr().err
    assert main(["serve", "--conf", str(yaml), "--with-logview"]) == 2
    assert "applies with remote agents" in capsys.readouterr().err
    assert main(["serve-key", "create", "laptop", "--conf", str(yaml)]) == 0
    assert capsys.readouterr().out.strip().startswith("tml-")
    assert main(["serve-key", "list", "--conf", str(yaml)]) == 0
    assert capsys.readouterr().out.split() == ["laptop"]
    assert main(["serve-key", "revoke", "nobody", "--conf", str(yaml)]) == 2
    assert "the keys are: laptop" in capsys.readouterr().err


# The SDK's side of the served-run test, in a process of its own: a ServiceClient's session sends heartbeats from
# a background thread for as long as the process lives, and would warn into later tests once the server is gone.
SDK_CLIENT = """
import os
import sys
import tinker
from tinker import types
sys.path.insert(0, {tests!r})
from test_serve_tinker import TOKENS, datum

url, key, model, mode = sys.argv[1:5]
if mode == "denied":
    try:
        tinker.ServiceClient(base_url=url, api_key="tml-wrong").get_server_capabilities()
    except tinker.AuthenticationError:
        print("denied", flush=True)
    os._exit(0)
sc = tinker.ServiceClient(base_url=url, api_key=key)
if mode == "train":
    tc = sc.create_lora_training_client(base_model=model, rank=4).result()
    tc.forward_backward([datum(TOKENS)], "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
else:  # a saved state's path
    tc = sc.create_training_client_from_state_with_optimizer(mode).result()
print(tc.forward([datum(TOKENS)], "cross_entropy").result().metrics["loss:sum"], flush=True)
# The session is left open on purpose (the server saves open clients at shutdown), so the SDK's daemon loop
# thread still runs at interpreter teardown, where it once aborted the process after the answer was printed.
os._exit(0)
"""


@pytest.mark.slow
def test_a_served_run_needs_a_key_once_keys_exist(tmp_path, tiny_model_dir, capsys):
    """Started as a user would (the command, in the background), with a key: a wrong key is a 401;
    Ctrl-C saves the open training client, and a restarted server trains on from it; SIGTERM saves too."""
    from astuner.cli import main
    from test_serve_tinker import write_yaml

    yaml = write_yaml(tmp_path, tiny_model_dir)
    main(["serve-key", "create", "ci", "--conf", str(yaml)])
    key = capsys.readouterr().out.strip()
    script = tmp_path / "sdk_client.py"
    script.write_text(SDK_CLIENT.format(tests=str(Path(__file__).parent)))

    def sdk(url: str, mode: str) -> str:
        env = {**os.environ, "TINKER_TELEMETRY": "0"}
        done = subprocess.run([sys.executable, str(script), url, key, str(tiny_model_dir), mode], env=env,
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        return done.stdout.strip().splitlines()[-1]

    def start():
        # SIGINT as a terminal's Ctrl-C delivers it (a test run started in the background would pass it on ignored)
        proc = subprocess.Popen([sys.executable, "-m", "astuner.cli", "serve", "--conf", str(yaml), "--port", "0"],
                                stderr=subprocess.PIPE, text=True, start_new_session=True,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
        for line in proc.stderr:
            if "serving the Tinker API at" in line:
                return proc, line.split(" at ")[1].split(";")[0]
        raise AssertionError(f"the server did not start (exit {proc.wait()})")

    proc, url = start()
    try:
        assert sdk(url, "denied") == "denied"
        before = float(sdk(url, "train"))
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        rest = proc.stderr.read()
        proc.wait(timeout=60)
    saved = [line.split("saved ")[1].split(" ")[0] for line in rest.splitlines() if "astuner: saved tinker://" in line]
    assert len(saved) == 1, rest
    proc, url = start()
    try:
        after = float(sdk(url, saved[0]))
        assert after == before
    finally:
        os.killpg(proc.pid, signal.SIGTERM)  # a scheduler's stop: saves as Ctrl-C does
        rest = proc.stderr.read()
        assert proc.wait(timeout=60) == 143
    assert "astuner: saved tinker://" in rest
