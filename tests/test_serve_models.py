"""`astuner serve` with several models (astuner.model and astuner.models): a Tinker client picks one as
`base_model`; each trains, samples and saves on its own weights. The real `tinker` SDK, two tiny models."""

from __future__ import annotations

import shutil
import sys

import numpy as np
import pytest
import torch

tinker = pytest.importorskip("tinker") if sys.version_info < (3, 11) else __import__("tinker")
from tinker import types  # noqa: E402

from test_serve_tinker import TOKENS, datum, write_yaml  # noqa: E402
from tolerances import assert_close_normwise  # noqa: E402


@pytest.fixture(scope="module")
def two_models(tmp_path_factory, tiny_model_dir):
    """A server of the tiny model (`policy`, and `twin` on the same folder) and a copy with other weights
    (`critic`)."""
    from safetensors.torch import load_file, save_file

    from astuner.config import load_config
    from astuner.serve import build_service, tinker_server
    from astuner.serve.limits import ServeLimits
    from astuner.serve.keys import KeyStore

    folder = tmp_path_factory.mktemp("serve_models")
    other = folder / "critic_model"
    shutil.copytree(tiny_model_dir, other)
    weights = load_file(str(other / "model.safetensors"))
    generator = torch.Generator().manual_seed(1)
    save_file({n: t + 0.05 * torch.randn(t.shape, generator=generator) for n, t in weights.items()},
              str(other / "model.safetensors"), metadata={"format": "pt"})
    roster = f"  models: {{critic: {{path: {other}}}, twin: {{path: {tiny_model_dir}}}}}\n"
    loaded = load_config(str(write_yaml(folder, tiny_model_dir, roster)), [])
    service = build_service(loaded, ServeLimits(max_training_clients=4))
    server = tinker_server(service, KeyStore(folder / "keys.json"), poll_wait_s=2.0)
    url = server.start()
    sc = tinker.ServiceClient(base_url=url, api_key="tml-local")
    yield service, sc, other
    sc.close("success").result()
    server.stop()


def logprobs_of(tc) -> np.ndarray:
    return tc.forward([datum(TOKENS)], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()


def test_each_model_trains_and_samples_its_own_weights(two_models, tiny_model_dir):
    service, sc, other = two_models
    assert [m.model_name for m in sc.get_server_capabilities().supported_models] == [str(tiny_model_dir), str(other)]
    critic_base = service.bases[str(other)]
    assert critic_base.engine is None  # no engine until its first sampling request

    critic = sc.create_lora_training_client(base_model="critic", rank=4).result()  # its roster name
    policy = sc.create_lora_training_client(base_model="twin", rank=4).result()  # same folder: the policy's base
    assert critic.get_info().model_data.model_name == str(other)
    assert policy.get_info().model_data.model_name == str(tiny_model_dir)
    before = {"critic": logprobs_of(critic), "policy": logprobs_of(policy)}
    assert not np.allclose(before["critic"], before["policy"])  # two models, not one twice

    sampler = sc.create_sampling_client(base_model="critic").result()
    scored = sampler.compute_logprobs(types.ModelInput.from_ints(TOKENS)).result()
    assert critic_base.engine is not None
    assert_close_normwise(torch.tensor(scored[1:]), torch.tensor(before["critic"]), what="the critic's engine")

    for _ in range(2):  # training the critic leaves the policy where it was
        critic.forward_backward([datum(TOKENS)], "cross_entropy").result()
        critic.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    assert not np.array_equal(logprobs_of(critic), before["critic"])
    np.testing.assert_array_equal(logprobs_of(policy), before["policy"])

    trained = critic.save_weights_and_get_sampling_client().result()
    scored = trained.compute_logprobs(types.ModelInput.from_ints(TOKENS)).result()
    assert_close_normwise(torch.tensor(scored[1:]), torch.tensor(logprobs_of(critic)), what="the trained critic")
    greedy = types.SamplingParams(max_tokens=4, temperature=0.0, stop=[])
    base_policy = sc.create_sampling_client(base_model=str(tiny_model_dir)).result()
    first = base_policy.sample(types.ModelInput.from_ints(TOKENS[:5]), 1, greedy).result().sequences[0].tokens
    trained.sample(types.ModelInput.from_ints(TOKENS[:5]), 1, greedy).result()  # the critic's engine, not the policy's
    assert base_policy.sample(types.ModelInput.from_ints(TOKENS[:5]), 1, greedy).result().sequences[0].tokens == first

    # A saved state and a named sampler remember their model.
    path = critic.save_state("critic2").result().path
    again = sc.create_training_client_from_state_with_optimizer(path).result()
    assert again.get_info().model_data.model_name == str(other)
    np.testing.assert_array_equal(logprobs_of(again), logprobs_of(critic))
    named = critic.save_weights_for_sampler("critic2").result().path
    for samplers in service.samplers.values():
        samplers.snapshots.pop(named, None)  # as after a restart: only the file knows its model
    reopened = sc.create_sampling_client(model_path=named).result()
    scored = reopened.compute_logprobs(types.ModelInput.from_ints(TOKENS)).result()
    assert_close_normwise(torch.tensor(scored[1:]), torch.tensor(logprobs_of(critic)), what="the named sampler")


def test_an_unknown_model_is_refused_with_the_served_names(two_models):
    _, sc, other = two_models
    with pytest.raises(Exception, match="not served here.*critic"):
        sc.create_lora_training_client(base_model="Qwen/Qwen3-8B", rank=4).result()


def test_the_summary_lists_every_model_with_its_roster_names(two_models, tmp_path, tiny_model_dir):
    from astuner.serve import serve_summary
    from astuner.serve.keys import KeyStore

    service, _, other = two_models
    summary = serve_summary(service, "http://127.0.0.1:0", KeyStore(tmp_path / "keys.json"))
    assert f"served as '{tiny_model_dir}' (policy, twin)" in summary and f"served as '{other}' (critic)" in summary


@pytest.mark.parametrize("engine", ["vllm", "hf"])
def test_vllm_bases_split_the_gpu_share_and_all_start_before_serving(tmp_path, tiny_model_dir, monkeypatch, engine):
    """On CUDA, each vLLM engine asks for rollout.gpu_memory_utilization of the card: two bases split it, and both
    start with the server (one started at its first sampling request, beside trainers, would find its share
    taken). The HF engine keeps starting a base's engine at its first sampling request."""
    from astuner.config import load_config
    from astuner.engine import build
    from astuner.serve import build_service

    other = tmp_path / "critic_model"
    shutil.copytree(tiny_model_dir, other)
    built = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(build, "build_engine", lambda typed, path, tokenizer, max_len, engine, gpu_share=None:
                        built.append((path, gpu_share)) or object())
    roster = f"  models: {{critic: {{path: {other}}}}}\n"
    yaml = write_yaml(tmp_path, tiny_model_dir, roster).read_text().replace("engine: hf", f"engine: {engine}")
    (tmp_path / "serve.yaml").write_text(yaml)
    build_service(load_config(str(tmp_path / "serve.yaml"), ["astuner.rollout.gpu_memory_utilization=0.6"]))
    if engine == "vllm":
        assert built == [(str(tiny_model_dir), 0.3), (str(other), 0.3)]
    else:
        assert built == [(str(tiny_model_dir), None)]  # the config's share, unsplit
