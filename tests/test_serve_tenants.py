"""`astuner serve` for a team: keys isolate tenants, refused requests take their turn, silent sessions expire,
what one client can make the server hold is bounded, the data trained on is checked against what was sampled.

The real `tinker` SDK where a user's script is the subject; raw HTTP (the SDK's wire format) where a hostile or
careless client is. One server per module (HF engine, tiny random-weight model), with keys.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import httpx
import numpy as np
import pytest

tinker = pytest.importorskip("tinker") if sys.version_info < (3, 11) else __import__("tinker")
from tinker import types  # noqa: E402

from test_serve_tinker import TOKENS, datum, write_yaml  # noqa: E402

os.environ["TINKER_TELEMETRY"] = "0"


@pytest.fixture(scope="module")
def team(tmp_path_factory, tiny_model_dir):
    """A server with keys for alice, bob and carol, and small bounds (so a test reaches them cheaply)."""
    from astuner.config import load_config
    from astuner.serve import build_service, tinker_server
    from astuner.serve.keys import KeyStore
    from astuner.serve.limits import ServeLimits

    folder = tmp_path_factory.mktemp("team")
    keys = KeyStore(folder / "keys.json")
    tokens = {name: keys.create(name) for name in ("alice", "bob", "carol")}
    limits = ServeLimits(max_training_clients=6, seq_window=8, held_mib=1, pending_samples=8, max_lora_rank=64)
    service = build_service(load_config(str(write_yaml(folder, tiny_model_dir)), []), limits)
    server = tinker_server(service, keys, poll_wait_s=2.0)
    url = server.start()
    yield {"service": service, "server": server, "url": url, "keys": keys, "tokens": tokens, "folder": folder}
    server.stop()


class Raw:
    """A client that speaks the wire format itself: a session, training clients, requests by seq_id."""

    def __init__(self, url: str, key: str):
        self.http = httpx.Client(base_url=url, headers={"X-API-Key": key}, timeout=60)
        self.session = None
        self.seq: dict[str, int] = {}

    def post(self, path: str, body: dict | None = None, **kw) -> httpx.Response:
        return self.http.post(f"/api/v1/{path}", json=body, **kw) if "content" not in kw else \
            self.http.post(f"/api/v1/{path}", **kw)

    def result(self, request_id: str, timeout: float = 120.0):
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            got = self.post("retrieve_future", {"request_id": request_id})
            assert got.status_code == 200, got.text
            if got.headers["content-type"].startswith("application/json") and got.json().get("type") == "try_again":
                continue
            return got
        raise AssertionError(f"{request_id} did not finish in {timeout:g} s")

    def new_session(self) -> str:
        self.session = self.post("create_session", {}).json()["session_id"]
        return self.session

    def new_model(self, model: str, rank: int = 4, seq: int = 0) -> str:
        made = self.post("create_model", {"session_id": self.session or self.new_session(), "model_seq_id": seq,
                                          "base_model": model, "lora_config": {"rank": rank}})
        assert made.status_code == 200, made.text
        assert "error" not in self.result(made.json()["request_id"]).json()
        self.seq[made.json()["model_id"]] = 1
        return made.json()["model_id"]

    def optim(self, model_id: str, lr: float = 1e-3, seq: int | None = None, **extra) -> httpx.Response:
        seq = self.seq[model_id] if seq is None else seq
        self.seq[model_id] = max(self.seq.get(model_id, 1), seq + 1)
        return self.post("optim_step", {"model_id": model_id, "seq_id": seq,
                                        "adam_params": {"learning_rate": lr}, **extra})


def fb_body(model_id: str, seq_id: int, data: list[types.Datum], loss_fn: str = "cross_entropy") -> bytes:
    """A forward_backward body exactly as the SDK encodes it."""
    from tinker.proto.request_conv import forward_backward_request_to_proto

    request = types.ForwardBackwardRequest(forward_backward_input=types.ForwardBackwardInput(
        data=data, loss_fn=loss_fn), model_id=model_id, seq_id=seq_id)
    return forward_backward_request_to_proto(request).SerializeToString()


def sdk(team, who: str):
    return tinker.ServiceClient(base_url=team["url"], api_key=team["tokens"][who])


@pytest.mark.slow
def test_keys_isolate_tenants(team, tiny_model_dir):
    """bob, with his own key, can neither read, load, step nor close anything of alice's: every such request is
    the API's 404, as for an id that never existed; alice trains on, unchanged. Ids are random."""
    alice, bob = sdk(team, "alice"), sdk(team, "bob")
    tc = alice.create_lora_training_client(base_model=str(tiny_model_dir), rank=4).result()
    tc.forward_backward([datum(TOKENS)], "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    state = tc.save_state("a1").result().path
    sampler_path = tc.save_weights_for_sampler("s1").result().path
    before = tc.forward([datum(TOKENS)], "cross_entropy").result().metrics["loss:sum"]
    session, model_id = tc.model_id.split(":")[0], tc.model_id
    assert re.fullmatch(r"s[0-9a-f]+-[0-9a-f]{24}", session), session

    raw_alice, raw_bob = Raw(team["url"], team["tokens"]["alice"]), Raw(team["url"], team["tokens"]["bob"])
    sampling = raw_alice.post("create_sampling_session", {"session_id": raw_alice.new_session(),
                                                          "sampling_session_seq_id": 0, "model_path": sampler_path})
    sampler_id = sampling.json()["sampling_session_id"]
    asked = raw_alice.post("asample", {"sampling_session_id": sampler_id, "num_samples": 1, "prompt": {
        "chunks": [{"type": "encoded_text", "tokens": TOKENS}]}, "sampling_params": {"max_tokens": 2}})
    rid = asked.json()["request_id"]
    assert re.fullmatch(r"req-[0-9a-f]{32}", rid), rid

    # bob reaches nothing of alice's, whatever he names
    assert raw_bob.post("retrieve_future", {"request_id": rid}).status_code == 404
    assert raw_bob.optim(model_id, lr=10.0, seq=tc._request_id_counter + 1).status_code == 404
    assert raw_bob.post(f"sessions/{session}/finish", {}).status_code == 404
    assert raw_bob.post("session_heartbeat", {"session_id": session}).status_code == 404
    assert raw_bob.post("get_info", {"model_id": model_id}).status_code == 404
    assert raw_bob.http.get(f"/api/v1/samplers/{sampler_id}").status_code == 404
    assert raw_bob.post("asample", {"sampling_session_id": sampler_id, "num_samples": 1, "prompt": {
        "chunks": [{"type": "encoded_text", "tokens": TOKENS}]}, "sampling_params": {"max_tokens": 2}}).status_code == 404
    assert raw_bob.post("create_model", {"session_id": session, "model_seq_id": 7, "base_model": str(tiny_model_dir),
                                         "lora_config": {"rank": 4}}).status_code == 404
    with pytest.raises(tinker.NotFoundError):
        bob.create_training_client_from_state_with_optimizer(state).result()
    with pytest.raises(tinker.NotFoundError):
        bob.create_sampling_client(model_path=sampler_path).sample(
            types.ModelInput.from_ints(TOKENS), 1, types.SamplingParams(max_tokens=2)).result()

    # alice: her future answers, her client trains on, its weights untouched by bob's lr 10 step
    assert "error" not in str(raw_alice.result(rid).status_code)
    assert tc.forward([datum(TOKENS)], "cross_entropy").result().metrics["loss:sum"] == before
    tc.forward_backward([datum(TOKENS)], "cross_entropy").result()
    restored = alice.create_training_client_from_state_with_optimizer(state).result()
    assert restored.forward([datum(TOKENS)], "cross_entropy").result().metrics["loss:sum"] == before
    alice.close("success").result()
    bob.close("success").result()


def test_a_refused_request_takes_its_turn(team, tiny_model_dir):
    """The SDK moves past a failed request: an optim_step with Dimuon's parameters, a datum with an image, a zstd
    body, a request under a revoked key: each takes its seq_id's turn, so the requests after it run."""
    alice = sdk(team, "alice")
    tc = alice.create_lora_training_client(base_model=str(tiny_model_dir), rank=4).result()
    with pytest.raises(Exception, match="AdamW only"):
        tc.optim_step(types.DimuonParams(learning_rate=0.1)).result()
    image = types.Datum(model_input=types.ModelInput(chunks=[types.ImageChunk(data=b"\x89PNG", format="png")]),
                        loss_fn_inputs={"target_tokens": [1], "weights": [1.0]})
    with pytest.raises(Exception, match="text tokens only"):
        tc.forward_backward([image], "cross_entropy").result()
    # the requests after them answer (before the fix, this waited forever)
    assert tc.optim_step(types.AdamParams(learning_rate=1e-3)).result(timeout=60) is not None
    assert tc.forward([datum(TOKENS)], "cross_entropy").result(timeout=60).metrics["loss:sum"] > 0
    alice.close("success").result()

    # a zstd body (the SDK's compressed forward_backward) is read, and runs in its turn
    import zstandard

    raw = Raw(team["url"], team["tokens"]["alice"])
    model_id = raw.new_model(str(tiny_model_dir))
    body = zstandard.ZstdCompressor().compress(fb_body(model_id, 1, [datum(TOKENS)]))
    sent = raw.post("forward_backward", content=body, headers={"Content-Type": "application/x-protobuf",
                                                                "Content-Encoding": "zstd"})
    assert sent.status_code == 200, sent.text
    assert raw.result(sent.json()["request_id"]).headers["content-type"] == "application/x-protobuf"
    raw.seq[model_id] = 2

    # carol's key is revoked while her client has requests to send: each is refused (401) and takes its turn, so
    # with a new key of hers the client goes on at once
    keys = team["keys"]
    carol = Raw(team["url"], team["tokens"]["carol"])
    carols = carol.new_model(str(tiny_model_dir))
    time.sleep(0.01)
    keys.revoke("carol")
    refused = carol.optim(carols, seq=1)
    assert refused.status_code == 401 and "revoked" in refused.json()["detail"]
    new = Raw(team["url"], keys.create("carol"))
    team["tokens"]["carol"] = new.http.headers["X-API-Key"]
    stepped = new.optim(carols, seq=2)
    assert stepped.status_code == 200, stepped.text
    assert "error" not in new.result(stepped.json()["request_id"], timeout=60).json()


def test_what_one_client_can_hold_is_bounded(team, tiny_model_dir):
    """Requests far ahead of their turn, bodies held while they wait, pending samples and LoRA ranks are bounded:
    a 429 (the SDK backs off and sends it again) or a 400, and nothing is held for them."""
    raw = Raw(team["url"], team["tokens"]["alice"])
    model_id = raw.new_model(str(tiny_model_dir))
    queue = team["server"].tinker.queue
    far = raw.post("forward_backward", content=fb_body(model_id, 1000, [datum(TOKENS)]),
                   headers={"Content-Type": "application/x-protobuf"})
    assert far.status_code == 429 and "ahead" in far.json()["detail"]
    big = [datum(TOKENS * 4000)] * 3  # ~1.5 MB of tokens, waiting for seq 1: over the 1 MiB the client may hold
    held = raw.post("forward_backward", content=fb_body(model_id, 2, big), headers={"Content-Type":
                                                                                    "application/x-protobuf"})
    assert held.status_code == 429 and "MiB" in held.json()["detail"]
    assert queue.held(model_id) == 0
    assert raw.optim(model_id, seq=1).status_code == 200  # the next to run is always taken

    sampling = raw.post("create_sampling_session", {"session_id": raw.session, "sampling_session_seq_id": 0,
                                                    "base_model": str(tiny_model_dir)}).json()["sampling_session_id"]
    flood = raw.post("asample", {"sampling_session_id": sampling, "num_samples": 9, "prompt": {
        "chunks": [{"type": "encoded_text", "tokens": TOKENS}]}, "sampling_params": {"max_tokens": 2}})
    assert flood.status_code == 429 and "pending" in flood.json()["detail"] + "waiting"
    assert team["server"].tinker.pending.get("key:alice", 0) == 0

    for rank, words in [(65, "--max-lora-rank 64"), (10**6, "0 \\(the whole model\\) to 64")]:
        made = raw.post("create_model", {"session_id": raw.session, "model_seq_id": rank, "base_model":
                                         str(tiny_model_dir), "lora_config": {"rank": rank}})
        assert made.status_code == 400 and re.search(words, made.json()["detail"]), made.text
    dimuon = raw.post("create_model", {"session_id": raw.session, "model_seq_id": 99, "base_model":
                                       str(tiny_model_dir), "optimizer_config": {"type": "dimuon", "version": 1}})
    assert dimuon.status_code == 400 and "AdamW only" in dimuon.json()["detail"]  # refused at creation


def test_the_sdk_is_refused_dimuon_at_creation_and_over_long_data(team, tiny_model_dir):
    alice = sdk(team, "alice")
    with pytest.raises(tinker.BadRequestError, match="AdamW only"):
        alice.create_lora_training_client(base_model=str(tiny_model_dir), rank=4,
                                          optimizer=types.DimuonOptimizerConfig()).result()
    tc = alice.create_lora_training_client(base_model=str(tiny_model_dir), rank=4).result()
    with pytest.raises(Exception, match="exceed the model's context"):
        tc.forward([datum(list(range(2049)))], "cross_entropy").result()
    with pytest.raises(Exception, match="letters, digits"):
        tc.save_state("name\n").result()  # `$` would take a trailing newline
    alice.close("success").result()


def test_top_k_prompt_logprobs_are_the_engines(team, tiny_model_dir):
    alice = sdk(team, "alice")
    sampler = alice.create_sampling_client(base_model=str(tiny_model_dir))
    got = sampler.sample(types.ModelInput.from_ints(TOKENS), 1, types.SamplingParams(max_tokens=2),
                         include_prompt_logprobs=True, topk_prompt_logprobs=3).result()
    engine = team["service"].policy.get_engine()
    expected = engine.prompt_logprobs(TOKENS, 3)
    assert got.topk_prompt_logprobs[0] is None and len(got.topk_prompt_logprobs) == len(TOKENS)
    for position, (want, have) in enumerate(zip(expected.topk, got.topk_prompt_logprobs[1:]), start=1):
        assert [t for t, _ in have] == [t for t, _ in want], position
        assert np.allclose([lp for _, lp in have], [lp for _, lp in want], atol=1e-6)
        assert have[0][1] >= got.prompt_logprobs[position] - 1e-6  # the likeliest is at least the prompt's token
    alice.close("success").result()


def _provenance_datum(prompt: list[int], seq, tamper: str | None = None) -> types.Datum:
    """prompt + sampled tokens as one datum, its spans naming where each position came from."""
    tokens = list(prompt) + list(seq.tokens)
    targets = tokens[1:]
    logprobs = [0.0] * (len(prompt) - 1) + list(seq.logprobs)
    if tamper == "token":
        targets[-1] = (targets[-1] + 1) % 1000
    if tamper == "logprob":
        logprobs[-1] += 0.25
    d = types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs={
        "target_tokens": targets, "logprobs": logprobs, "advantages": [0.0] * (len(prompt) - 1) + [1.0] * len(seq.tokens)})
    return d.with_provenance(
        model_input=[types.PromptProvenanceSpan(sequence_id=seq.sequence_id, length=len(prompt)),
                     types.SampledProvenanceSpan(sequence_id=seq.sequence_id, length=len(seq.tokens) - 1)],
        loss_fn_inputs=[types.PromptProvenanceSpan(sequence_id=seq.sequence_id, offset=1, length=len(prompt) - 1),
                        types.SampledProvenanceSpan(sequence_id=seq.sequence_id, length=len(seq.tokens))])


def test_provenance_spans_are_checked_against_what_was_sampled(team, tiny_model_dir):
    """A datum that names the sequence it came from trains when its tokens and logprobs are what the server
    sampled, and is refused when a token or a logprob differs (or, with --provenance flag, trained and counted).
    Another tenant's sequence is not on record for bob: counted as unverified, never refused."""
    alice, bob = sdk(team, "alice"), sdk(team, "bob")
    sampler = alice.create_sampling_client(base_model=str(tiny_model_dir))
    seq = sampler.sample(types.ModelInput.from_ints(TOKENS), 1, types.SamplingParams(max_tokens=6, temperature=1.0,
                                                                                        seed=1)).result().sequences[0]
    tc = alice.create_lora_training_client(base_model=str(tiny_model_dir), rank=4).result()
    ok = tc.forward([_provenance_datum(TOKENS, seq)], "importance_sampling").result()
    assert ok.metrics["provenance_mismatch:sum"] == 0 and ok.metrics["provenance_unverified:sum"] == 0
    for tamper, words in [("token", "holds token"), ("logprob", "has logprob")]:
        with pytest.raises(Exception, match=f"differ from what this server sampled.*{words}"):
            tc.forward([_provenance_datum(TOKENS, seq, tamper)], "importance_sampling").result()
    service = team["service"]
    limits = service.limits
    service.limits = replace(limits, provenance="flag")
    try:
        flagged = tc.forward([_provenance_datum(TOKENS, seq, "token")], "importance_sampling").result()
        assert flagged.metrics["provenance_mismatch:sum"] == 1
    finally:
        service.limits = limits
    bobs = bob.create_lora_training_client(base_model=str(tiny_model_dir), rank=4).result()
    theirs = bobs.forward([_provenance_datum(TOKENS, seq)], "importance_sampling").result()
    assert theirs.metrics["provenance_unverified:sum"] == 1 and theirs.metrics["provenance_mismatch:sum"] == 0
    alice.close("success").result()
    bob.close("success").result()


# A script that trains, then is killed before it could call ServiceClient.close() (as a crash or Ctrl-C leaves it).
ABANDONED = """
import sys, time
import tinker
from tinker import types
sys.path.insert(0, {tests!r})
from test_serve_tinker import TOKENS, datum

sc = tinker.ServiceClient(base_url=sys.argv[1], api_key=sys.argv[2])
tc = sc.create_lora_training_client(base_model=sys.argv[3], rank=4).result()
tc.forward_backward([datum(TOKENS)], "cross_entropy").result()
tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
print(tc.model_id, tc.forward([datum(TOKENS)], "cross_entropy").result().metrics["loss:sum"], flush=True)
time.sleep(600)
"""


@pytest.mark.slow
def test_a_silent_session_expires_saved_and_frees_its_slot(tmp_path, tiny_model_dir, caplog):
    """A script killed mid-run never closes its session: once it is silent for the timeout, the server saves its
    training client as at shutdown, logs the tinker:// path and frees the slot (here the only one), so the next
    script trains; the saved state loads with the training client's weights; the dead session hears 410."""
    from astuner.config import load_config
    from astuner.serve import build_service, tinker_server
    from astuner.serve.keys import KeyStore
    from astuner.serve.limits import ServeLimits

    keys = KeyStore(tmp_path / "keys.json")
    key = keys.create("dana")
    service = build_service(load_config(str(write_yaml(tmp_path, tiny_model_dir)), []),
                            ServeLimits(max_training_clients=1, session_timeout_s=12.0))
    server = tinker_server(service, keys, poll_wait_s=2.0)
    url = server.start()
    script = tmp_path / "abandoned.py"
    script.write_text(ABANDONED.format(tests=str(Path(__file__).parent)))
    proc = subprocess.Popen([sys.executable, str(script), url, key, str(tiny_model_dir)], stdout=subprocess.PIPE,
                            text=True, env={**os.environ, "TINKER_TELEMETRY": "0"})
    try:
        model_id, loss = proc.stdout.readline().split()
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        with caplog.at_level("WARNING", logger="astuner.serve.app"):
            deadline = time.monotonic() + 60
            while service.models and time.monotonic() < deadline:
                time.sleep(0.5)
            assert not service.models, "the silent session was not expired"
        lines = [r.getMessage() for r in caplog.records if "expired after 12 s" in r.getMessage()]
        assert lines and f"tinker://{model_id}/weights/at_expiry" in lines[0], caplog.text
        raw = Raw(url, key)
        beat = raw.post("session_heartbeat", {"session_id": model_id.split(":")[0]})
        assert beat.status_code == 410 and "at_expiry" in beat.json()["detail"]
        sc = tinker.ServiceClient(base_url=url, api_key=key)
        back = sc.create_training_client_from_state_with_optimizer(f"tinker://{model_id}/weights/at_expiry").result()
        assert back.forward([datum(TOKENS)], "cross_entropy").result().metrics["loss:sum"] == float(loss)
        sc.close("success").result()
    finally:
        proc.kill()
        server.stop()


def test_a_stop_saves_every_tenants_clients_each_in_its_own_folder(team, tiny_model_dir):
    """Checkpoints remember their tenant in their folder (a `tenant` file): a server restarted later refuses
    another tenant's path the same way."""
    alice = sdk(team, "alice")
    tc = alice.create_lora_training_client(base_model=str(tiny_model_dir), rank=4).result()
    path = tc.save_state("mine").result().path
    folder = team["service"].state_dir / tc.model_id.replace(":", "_")
    assert (folder / "tenant").read_text() == "key:alice"
    with pytest.raises(Exception):
        team["service"].saved.file_of(path, "weights", "key:bob")
    assert team["service"].saved.file_of(path, "weights", "key:alice").exists()
    alice.close("success").result()


def test_bases_sharing_a_folder_name_are_named_apart():
    from astuner.serve.bases import ServedBase, base_of
    from astuner.serve.futures import RequestError

    bases = {"a/model": ServedBase("a/model", "/x/a/model", ("policy",), None, None),
             "b/model": ServedBase("b/model", "/x/b/model", ("critic",), None, None)}
    with pytest.raises(RequestError, match="names 2 models"):
        base_of(bases, "model")
    assert base_of(bases, "critic").name == "b/model" and base_of(bases, "/x/a/model").name == "a/model"


def test_revoking_the_last_key_closes_the_server_and_says_so(tmp_path, capsys):
    from astuner.cli import main
    from astuner.serve.keys import KeyStore

    yaml = tmp_path / "s.yaml"
    yaml.write_text(f"astuner:\n  experiment_dir: {tmp_path / 'out'}\n  model: {{path: x}}\n")
    assert main(["serve-key", "create", "erin", "--conf", str(yaml)]) == 0
    capsys.readouterr()
    assert main(["serve-key", "revoke", "erin", "--conf", str(yaml)]) == 0
    said = capsys.readouterr().err
    assert "no key is left, so the server refuses every request (it does not reopen" in said, said
    store = KeyStore(tmp_path / "out/serve/keys.json")
    assert not store.open_access() and not store.any()


def test_json_results_of_the_wire(team):
    """Every refusal is a 4xx with a JSON detail (the API's shape), also for a route that does not exist."""
    raw = Raw(team["url"], team["tokens"]["alice"])
    for response in (raw.post("nope", {}), raw.post("get_info", {"model_id": "x"}),
                     raw.http.post("/api/v1/create_session", content=b"[1]")):
        assert 400 <= response.status_code < 500 and isinstance(json.loads(response.text)["detail"], str)
