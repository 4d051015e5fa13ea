"""`astuner serve` under the real `tinker` SDK (PyPI, pinned in pyproject's test extra) on the tiny model.

One server per module (HF engine, tiny random-weight model); each test opens its own ServiceClient.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

tinker = pytest.importorskip("tinker") if sys.version_info < (3, 11) else __import__("tinker")
from tinker import types  # noqa: E402

from tolerances import assert_close_normwise, assert_scalar_close  # noqa: E402

os.environ["TINKER_TELEMETRY"] = "0"  # the SDK's telemetry would post to our server every 10 s


def write_yaml(folder: Path, model_dir: Path, extra: str = "") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    yaml = folder / "serve.yaml"
    yaml.write_text(f"""
astuner:
  project_name: serve
  experiment_dir: {folder / "out"}
  model: {{path: {model_dir}}}
  rollout: {{engine: hf, max_env_worker: 8}}
  trainer_common: {{micro_batch_token_budget: 64}}
{extra}""")
    return yaml


@pytest.fixture(scope="module")
def served(tmp_path_factory, tiny_model_dir):
    from astuner.config import load_config
    from astuner.serve import build_service, tinker_server
    from astuner.serve.limits import ServeLimits
    from astuner.serve.keys import KeyStore

    folder = tmp_path_factory.mktemp("serve")
    loaded = load_config(str(write_yaml(folder, tiny_model_dir)), [])
    service = build_service(loaded, ServeLimits(max_training_clients=4))
    server = tinker_server(service, KeyStore(folder / "keys.json"), poll_wait_s=2.0)
    url = server.start()
    yield service, url, folder
    server.stop()


@pytest.fixture()
def client(served):
    service, url, _ = served
    sc = tinker.ServiceClient(base_url=url, api_key="tml-local")
    yield sc
    # Frees the session's training clients on the server (the limit is per server).
    sc.close("success").result()


def datum(tokens: list[int], weights: list[float] | None = None) -> types.Datum:
    n = len(tokens) - 1
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                       loss_fn_inputs={"target_tokens": tokens[1:], "weights": weights or [1.0] * n})


TOKENS = [1, 504, 2837, 314, 260, 3278, 284, 4102, 30, 216, 37, 38]


def test_capabilities_and_info_name_the_yaml_model(served, client, tiny_model_dir):
    caps = client.get_server_capabilities()
    assert [m.model_name for m in caps.supported_models] == [str(tiny_model_dir)]
    tc = client.create_lora_training_client(base_model=str(tiny_model_dir), rank=4).result()
    info = tc.get_info()
    assert info.is_lora and info.lora_rank == 4 and info.model_data.tokenizer_id == str(tiny_model_dir)
    assert tc.get_tokenizer().encode("hello") == served[0].tokenizer.encode("hello")  # local, no hub


def test_cross_entropy_is_the_weighted_sum_and_its_gradient_is_the_trainers(served, client, tiny_model_dir):
    """The loss is -sum w_i logp_i of the returned logprobs; the gradient equals astuner's own trainer's SFT
    gradient on the same sample times its trained token count (SFT takes the token mean)."""
    from astuner.trainer import Trainer
    from astuner.types import Sample

    service = served[0]
    tc = client.create_lora_training_client(base_model=str(tiny_model_dir), rank=0).result()
    weights = [0.0] * 4 + [1.0] * (len(TOKENS) - 5)
    out = tc.forward_backward([datum(TOKENS, weights)], "cross_entropy").result()
    logprobs = out.loss_fn_outputs[0]["logprobs"].to_numpy()
    assert logprobs.shape == (len(TOKENS) - 1,)
    assert_scalar_close(out.metrics["loss:sum"], float(-(np.asarray(weights) * logprobs).sum()))

    served_trainer = service.models[tc.get_info().model_id].trainer
    got = {n: p.grad.clone() for n, p in served_trainer.model.named_parameters()}
    own = Trainer(service.model_path, served_trainer.settings)
    n = len(TOKENS) - 1
    sample = Sample([TOKENS[0]], TOKENS[1:], [0.0] * n, 0.0, 1.0, "e", loss_mask=[int(w) for w in weights])
    own.forward_backward([sample], "sft")
    for name, p in own.model.named_parameters():
        assert_close_normwise(got[name], p.grad * sum(weights), what=name)


def test_policy_losses_match_their_formulas(served, client, tiny_model_dir):
    tc = client.create_lora_training_client(base_model=str(tiny_model_dir), rank=4).result()
    n = len(TOKENS) - 1
    base = tc.forward([datum(TOKENS)], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
    q = base + np.linspace(-0.5, 0.5, n).astype(np.float32)  # sampling logprobs off the current ones
    adv = np.linspace(-1, 2, n).astype(np.float32)
    adv[:2] = 0  # prompt-like positions: out of gspo's sequence ratio
    rl = types.Datum(model_input=types.ModelInput.from_ints(TOKENS[:-1]),
                     loss_fn_inputs={"target_tokens": TOKENS[1:], "logprobs": q.tolist(), "advantages": adv.tolist()})
    ratio = np.exp(base - q)
    sampled = adv != 0  # gspo's sequence ratio: over the tokens with an advantage (no sequence_ratio_mask sent)
    s = np.exp((base - q)[sampled].mean())
    clip = {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}
    expected = {
        "importance_sampling": (None, -(ratio * adv).sum()),
        "ppo": (clip, -np.minimum(ratio * adv, np.clip(ratio, 0.9, 1.1) * adv).sum()),
        "cispo": (clip, -(np.clip(ratio, 0.9, 1.1) * base * adv).sum()),
        "dro": ({"beta": 0.3}, -(base * adv - 0.15 * (base - q) ** 2).sum()),
        "gspo": (clip, -(sampled * np.minimum(s * adv, np.clip(s, 0.9, 1.1) * adv)).sum()),
    }
    for loss_fn, (config, value) in expected.items():
        got = tc.forward([rl], loss_fn, loss_fn_config=config).result().metrics["loss:sum"]
        assert_scalar_close(got, float(value), what=loss_fn)


def test_train_sample_save_and_load(served, client, tiny_model_dir):
    """A few cross-entropy steps lower the loss; a sampler of the new weights scores the prompt as the trainer
    does; a saved state loads into a new training client with the same logprobs."""
    tc = client.create_lora_training_client(base_model=str(tiny_model_dir), rank=8).result()
    data = [datum(TOKENS)]
    losses = []
    for _ in range(4):
        losses.append(tc.forward_backward(data, "cross_entropy").result().metrics["loss:sum"])
        tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    assert losses[-1] < losses[0] - 1.0, losses

    sampler = tc.save_weights_and_get_sampling_client().result()
    result = sampler.sample(types.ModelInput.from_ints(TOKENS[:5]), num_samples=3,
                            sampling_params=types.SamplingParams(max_tokens=6, temperature=1.0, stop=[])).result()
    assert len(result.sequences) == 3
    assert all(len(s.tokens) == 6 == len(s.logprobs) and s.stop_reason == "length" for s in result.sequences)
    prompt = sampler.compute_logprobs(types.ModelInput.from_ints(TOKENS)).result()
    trained = tc.forward(data, "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
    assert prompt[0] is None
    assert_close_normwise(torch.tensor(prompt[1:]), torch.tensor(trained), what="prompt logprobs")

    saved = tc.save_state("after4").result().path
    assert saved.endswith("/weights/after4")
    again = client.create_training_client_from_state_with_optimizer(saved).result()
    reloaded = again.forward(data, "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
    np.testing.assert_array_equal(reloaded, trained)
    for client_ in (tc, again):  # the AdamW moments came along: one more step moves both alike
        client_.forward_backward(data, "cross_entropy").result()
        client_.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    stepped = [c.forward(data, "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy() for c in (tc, again)]
    np.testing.assert_array_equal(*stepped)

    seeded = sampler.sample(types.ModelInput.from_ints(TOKENS[:5]), num_samples=3, sampling_params=types.SamplingParams(
        max_tokens=6, temperature=1.0, stop=[], seed=7)).result().sequences
    assert len({tuple(s.tokens) for s in seeded}) > 1  # one seed per request, not one sequence three times

    # A name saved again holds the newer weights, and its samplers serve them.
    path = tc.save_weights_for_sampler("latest").result().path
    named = client.create_sampling_client(model_path=path).result()
    old = named.compute_logprobs(types.ModelInput.from_ints(TOKENS)).result()
    tc.forward_backward(data, "cross_entropy").result()
    tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    tc.save_weights_for_sampler("latest").result()
    new = client.create_sampling_client(model_path=path).result().compute_logprobs(
        types.ModelInput.from_ints(TOKENS)).result()
    now = tc.forward(data, "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
    assert new[1:] != old[1:]
    assert_close_normwise(torch.tensor(new[1:]), torch.tensor(now), what="re-saved sampler")

    base = client.create_sampling_client(base_model=str(tiny_model_dir)).result()
    greedy = types.SamplingParams(max_tokens=4, temperature=0.0, stop=[])
    first = base.sample(types.ModelInput.from_ints(TOKENS[:5]), 1, greedy).result().sequences[0].tokens
    sampler.sample(types.ModelInput.from_ints(TOKENS[:5]), 1, greedy).result()  # switches the engine away and back
    assert base.sample(types.ModelInput.from_ints(TOKENS[:5]), 1, greedy).result().sequences[0].tokens == first


def test_bad_requests_fail_with_what_to_do(served, client, tiny_model_dir):
    tc = client.create_lora_training_client(base_model=str(tiny_model_dir), rank=4).result()
    shifted_wrong = types.Datum(model_input=types.ModelInput.from_ints(TOKENS[:-1]),
                                loss_fn_inputs={"target_tokens": TOKENS[:-1], "weights": [1.0] * (len(TOKENS) - 1)})
    cases = [
        (lambda: tc.forward_backward([shifted_wrong], "cross_entropy"), "shifted by one"),
        (lambda: tc.forward_backward([datum(TOKENS)], "stable_reinforce"), "objective is not published"),
        (lambda: tc.forward_backward([datum(TOKENS)], "importance_sampling"), "missing logprobs, advantages"),
        (lambda: tc.forward_backward([datum(TOKENS)], "cross_entropy", {"clip_low_threshold": 0.5}), "does not apply"),
        (lambda: tc.save_state("no/slash"), "letters, digits"),
    ]
    for call, words in cases:
        with pytest.raises(tinker.RequestFailedError, match=words):
            call().result()
    with pytest.raises(tinker.BadRequestError, match="serves"):
        client.create_lora_training_client(base_model="Qwen/Qwen3-8B", rank=4).result()
    sampler = tc.save_weights_and_get_sampling_client().result()
    with pytest.raises(tinker.RequestFailedError, match="one token"):
        sampler.sample(types.ModelInput.from_ints(TOKENS[:4]), 1,
                       types.SamplingParams(max_tokens=2, stop=["two words"])).result()
    # Training still works after the failures.
    assert tc.forward([datum(TOKENS)], "cross_entropy").result().metrics["loss:sum"] > 0


@pytest.mark.slow
def test_http_errors_are_4xx_with_a_message(served):
    import httpx

    url = served[1]
    with httpx.Client(base_url=url, timeout=30) as http:
        bad = http.post("/api/v1/create_session", content=b"{not json", headers={"X-API-Key": "tml-x"})
        assert bad.status_code == 400 and "not JSON" in bad.json()["detail"]
        big = http.post("/api/v1/forward_backward", content=b"x" * (300 << 20), headers={"X-API-Key": "tml-x"})
        assert big.status_code == 413
        garbage = http.post("/api/v1/forward_backward", content=b"\xff\xff\xff", headers={"X-API-Key": "tml-x"})
        assert garbage.status_code == 400 and "varint" in garbage.json()["detail"]
        assert http.post("/api/v1/retrieve_future", json={"request_id": "req-nope"}).status_code == 404
        gone = http.post("/api/v1/load_weights", json={"model_id": "s0-1:train:9", "seq_id": 1, "optimizer": False,
                                                       "path": "tinker://s0-1:train:9/weights/x"})
        assert gone.status_code == 404 and "no training client" in gone.json()["detail"]  # not a poll forever
        assert http.get("/api/v1/nothing").status_code == 404


def test_the_readme_example_runs_as_written(served, tiny_model_dir, capsys):
    """README "Training as a service": its Python block, against this server and the tiny model."""
    import re

    from conftest import REPO

    readme = (REPO / "README.md").read_text()
    text = readme[readme.index("\n## Training as a service"):]
    code = re.search(r"```python\n(.*?)```", text, re.DOTALL).group(1)
    assert "http://127.0.0.1:8000" in code and "demo:smollm2-135m-instruct" in code
    code = code.replace("http://127.0.0.1:8000", served[1]).replace("demo:smollm2-135m-instruct", str(tiny_model_dir))
    namespace: dict = {}
    try:
        exec(compile(code, "README.md", "exec"), namespace)
    finally:  # its session ends here: an open one would send heartbeats (and warnings) after the server stops
        namespace["service"].close("success").result()
    losses = [float(line.split()[1]) for line in capsys.readouterr().out.splitlines()[:5]]
    assert losses[-1] < losses[0], losses


def test_a_custom_loss_runs_through_cross_entropy(served, client, tiny_model_dir):
    """forward_backward_custom (the SDK: a forward, the user's loss on the client, then cross_entropy weighted by
    -dL/dlogp): with L = -sum logp, the gradient is cross_entropy's with unit weights."""
    service = served[0]
    tc = client.create_lora_training_client(base_model=str(tiny_model_dir), rank=0).result()
    trainer = service.models[tc.get_info().model_id].trainer

    def loss_fn(data, logprobs_list):
        loss = sum(-lp.sum() for lp in logprobs_list)
        return loss, {"nll": float(loss)}

    out = tc.forward_backward_custom([datum(TOKENS)], loss_fn).result()
    custom = {n: p.grad.clone() for n, p in trainer.model.named_parameters()}
    trainer.zero_grad()
    plain = tc.forward_backward([datum(TOKENS)], "cross_entropy").result()
    assert_scalar_close(out.metrics["loss:sum"], plain.metrics["loss:sum"])
    assert_scalar_close(out.metrics["surrogate_loss:sum"], plain.metrics["loss:sum"])  # weights -dL/dlogp = 1
    for name, p in trainer.model.named_parameters():
        assert_close_normwise(custom[name], p.grad, what=name)
