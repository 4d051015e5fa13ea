"""LoRA adapters on one shared base (astuner.models naming the policy's folder, both with LoRA): the trainer holds
the base once and updates exactly as two separate LoRA models do, the HF engine serves each model's adapter over
one base, and a whole run trains only the adapter of the agent that called."""

from __future__ import annotations


import pytest
import torch
from safetensors.torch import load_file
from test_several_models import metric_rows, write_run
from tests.test_trainer import _sample, _trainer
from tolerances import LOGPROB_ATOL

from astuner.cli import main
from astuner.trainer.lora import LoraSettings, adapter_tensors, share_frozen_weights
from astuner.types import SamplingParams

LORA = LoraSettings(rank=4, alpha=8.0, dropout=0.0, target_modules=("q_proj", "v_proj", "down_proj"))


def _batch(t, tok):
    return [_sample(t, tok, "Hi there", " general kenobi", 1.0, "a"), _sample(t, tok, "Hi there", " hello", -1.0, "b")]


def test_a_shared_base_gives_the_same_update_as_two_separate_lora_models(tiny_model_dir, demo_tokenizer):
    torch.manual_seed(0)
    a_alone, b_alone = _trainer(tiny_model_dir, lora=LORA, lr=1e-2), _trainer(tiny_model_dir, lora=LORA, lr=1e-2)
    torch.manual_seed(0)
    a, b = _trainer(tiny_model_dir, lora=LORA, lr=1e-2), _trainer(tiny_model_dir, lora=LORA, lr=1e-2)
    freed = share_frozen_weights(b.model, a.model)
    base_bytes = sum(p.numel() * p.element_size() for p in a.model.parameters() if not p.requires_grad)
    assert freed == base_bytes  # every frozen tensor of b is a's now: the base is held once
    shared = {n: p for n, p in a.model.named_parameters() if not p.requires_grad}
    assert all(p is shared[n] for n, p in b.model.named_parameters() if not p.requires_grad)

    before_a = {n: t.clone() for n, t in adapter_tensors(a.model)}
    for _ in range(2):  # b trains; a does not
        b_alone.train_step(_batch(b_alone, demo_tokenizer))
        b.train_step(_batch(b, demo_tokenizer))
    alone, together = dict(adapter_tensors(b_alone.model)), dict(adapter_tensors(b.model))
    assert alone.keys() == together.keys()
    for name in alone:  # same arithmetic on the same numbers: equal to the bit on one machine
        torch.testing.assert_close(together[name], alone[name], rtol=0, atol=0, msg=name)
    assert any(not torch.equal(t, before_a[n]) for n, t in together.items())  # b moved
    assert all(torch.equal(t, before_a[n]) for n, t in adapter_tensors(a.model))  # a did not
    for n, p in a.model.named_parameters():  # nor the shared base
        if not p.requires_grad:
            assert torch.equal(p, dict(a_alone.model.named_parameters())[n]), n


def test_the_engine_serves_each_adapter_over_one_base(tiny_model_dir, demo_tokenizer):
    from astuner.engine.adapters import AdapterHFEngine
    from astuner.engine.hf_engine import HFEngine

    torch.manual_seed(0)
    b = _trainer(tiny_model_dir, lora=LORA, lr=1e-2)
    for _ in range(2):
        b.train_step(_batch(b, demo_tokenizer))
    shared = AdapterHFEngine(str(tiny_model_dir), {"policy": LORA, "critic": LORA}, device="cpu", seed=0)
    report = shared.view("critic").load_weights(adapter_tensors(b.model))
    assert report.verified == 1.0
    merged = HFEngine(str(tiny_model_dir), device="cpu", seed=0)
    merged.load_weights(b.named_parameters_for_sync())
    plain = HFEngine(str(tiny_model_dir), device="cpu", seed=0)

    prompt = demo_tokenizer("Hi there", add_special_tokens=False)["input_ids"]
    greedy = SamplingParams(temperature=0.0, max_tokens=8)
    critic = shared.generate_batch([prompt], greedy, adapter="critic")[0]
    policy = shared.generate_batch([prompt], greedy, adapter="policy")[0]
    want_critic = merged.generate_batch([prompt], greedy)[0]
    want_policy = plain.generate_batch([prompt], greedy)[0]
    assert critic.token_ids == want_critic.token_ids and policy.token_ids == want_policy.token_ids
    assert max(abs(x - y) for x, y in zip(critic.logprobs, want_critic.logprobs)) < LOGPROB_ATOL
    assert max(abs(x - y) for x, y in zip(policy.logprobs, want_policy.logprobs)) < LOGPROB_ATOL
    assert critic.logprobs != policy.logprobs  # two models, not one

    with pytest.raises(KeyError, match="left 12 of its tensors out"):  # a partial sync is refused
        shared.view("policy").load_weights([])
    for e in (shared, merged, plain):
        e.shutdown()


@pytest.mark.slow
def test_two_adapters_on_one_base_a_run_trains_only_the_caller(tmp_path, tiny_model_dir):
    roster = (f"models: {{critic: {{path: {tiny_model_dir}}}}}\n  agents: {{critic: {{model: critic}}}}")
    yaml = write_run(tmp_path, tiny_model_dir, "CriticOnly", roster=roster)
    yaml.write_text(yaml.read_text().replace("optim: {lr: 1.0e-3}", "optim: {lr: 1.0e-2}, lora: {rank: 4}"))
    assert main(["--conf", str(yaml), "--backbone", "debug"]) == 0
    out = tmp_path / "out" / "global_step_2"
    policy = load_file(str(out / "policy" / "adapter_model.safetensors"))
    critic = load_file(str(out / "critic" / "adapter_model.safetensors"))
    assert not (out / "critic" / "model.safetensors").exists()  # an adapter only
    assert all(not t.any() for n, t in policy.items() if "lora_B" in n)  # B starts at 0 and never trained
    assert any(t.any() for n, t in critic.items() if "lora_B" in n)
    rows = metric_rows(tmp_path / "out")
    assert all(r["sync/verified"] == 1.0 for r in rows)
    log = (tmp_path / "out" / "astuner.log").read_text()
    assert "model critic: a LoRA adapter on the policy's base" in log
    assert "LoRA adapter on the policy's base; trainer" in log  # the memory estimate knows it is shared
