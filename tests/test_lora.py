"""LoRA (PEFT) on the tiny model: only adapters train, the engine gets merged weights, checkpoints hold the
adapter, resume is exact, and `astuner export` writes a merged model folder with the trainer's logprobs."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM

from astuner.cli import main
from astuner.trainer.lora import LoraSettings
from astuner.types import SamplingParams
from tests.test_trainer import _sample, _trainer
from tolerances import LOGPROB_ATOL

LORA = LoraSettings(rank=4, alpha=8.0, dropout=0.0, target_modules=("q_proj", "v_proj", "down_proj"))


def _trained(model_dir, tok, steps=2, **kw):
    t = _trainer(model_dir, lora=LORA, lr=1e-2, **kw)
    samples = [_sample(t, tok, "Hi there", " general kenobi", 1.0, "a"),
               _sample(t, tok, "Hi there", " hello", -1.0, "b")]
    for _ in range(steps):
        t.train_step(samples)
    return t, samples


def test_only_adapters_train_and_the_engine_gets_merged_weights(tiny_model_dir, demo_tokenizer):
    from astuner.engine.hf_engine import HFEngine

    base = dict(AutoModelForCausalLM.from_pretrained(tiny_model_dir).named_parameters())
    t, _ = _trained(tiny_model_dir, demo_tokenizer)
    optimized = [p for g in t.optimizer.param_groups for p in g["params"]]
    trainable = [n for n, p in t.model.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert len(optimized) == len(trainable) == 2 * 2 * 3  # A and B, 2 layers, 3 target modules
    merged = dict(t.named_parameters_for_sync())
    assert set(merged) == set(base)  # the base model's own names, no adapter tensors
    for name, tensor in merged.items():
        frozen_same = torch.equal(tensor, base[name].detach())
        # Targeted weights moved by (alpha/r) B A; every other weight is the untouched base.
        assert frozen_same != any(m in name for m in ("q_proj", "v_proj", "down_proj")), name
    for name, p in t.model.named_parameters():
        if ".base_layer." in name:
            assert torch.equal(p, base[name.replace(".base_layer.", ".")])  # W itself is frozen

    engine = HFEngine(str(tiny_model_dir), device="cpu", seed=0)
    engine.load_weights(t.named_parameters_for_sync())
    prompt = demo_tokenizer("Hi there", add_special_tokens=False)["input_ids"]
    res = engine.generate_batch([prompt], SamplingParams(temperature=1.0, max_tokens=8))[0]
    want = t.compute_logprobs(prompt, res.token_ids, 1.0)
    assert max(abs(a - b) for a, b in zip(res.logprobs, want)) < LOGPROB_ATOL
    engine.shutdown()


def test_adapter_checkpoint_resume_and_export(tiny_model_dir, demo_tokenizer, tmp_path, capsys):
    t, samples = _trained(tiny_model_dir, demo_tokenizer)
    ckpt = tmp_path / "global_step_2"
    t.save_checkpoint(ckpt, tokenizer=demo_tokenizer, run_state={"step": 2})
    assert (ckpt / "adapter_model.safetensors").is_file() and (ckpt / "adapter_config.json").is_file()
    assert not (ckpt / "model.safetensors").exists()  # the adapter only

    resumed = _trainer(tiny_model_dir, lora=LORA, lr=1e-2)
    resumed.load_checkpoint(ckpt)
    for (n, a), (_, b) in zip(resumed.model.named_parameters(), t.model.named_parameters()):
        assert torch.equal(a, b), n
    assert resumed.train_step(samples)["policy_loss"] == t.train_step(samples)["policy_loss"]

    out = tmp_path / "merged"
    assert main(["export", str(ckpt), "--out", str(out)]) == 0
    model = AutoModelForCausalLM.from_pretrained(out).eval()
    prompt = demo_tokenizer("Hi there", add_special_tokens=False)["input_ids"]
    response = demo_tokenizer(" general kenobi", add_special_tokens=False)["input_ids"]
    with torch.no_grad():
        logits = model(torch.tensor([prompt + response])).logits[0, len(prompt) - 1 : -1].log_softmax(-1)
    exported = logits.gather(-1, torch.tensor(response)[:, None]).squeeze(-1).tolist()
    # The exported folder is the policy at the checkpoint: t has trained one more step since, `resumed` too.
    fresh = _trainer(tiny_model_dir, lora=LORA)
    fresh.load_checkpoint(ckpt)
    want = fresh.compute_logprobs(prompt, response, 1.0)
    assert max(abs(a - b) for a, b in zip(exported, want)) < LOGPROB_ATOL
    assert main(["export", str(ckpt), "--out", str(out)]) == 2  # not empty: refused, nothing overwritten
    assert main(["export", str(tmp_path / "nope"), "--out", str(tmp_path / "o2")]) == 2
    assert "neither an adapter checkpoint" in capsys.readouterr().err


def test_a_merged_sync_makes_each_delta_only_when_its_weight_is_yielded(tiny_model_dir, demo_tokenizer,
                                                                        monkeypatch):
    """A sync streams one tensor at a time into shared memory: the adapters' full-size deltas (W's shape each)
    must not all be computed before the first weight leaves."""
    from peft.tuners.lora.layer import Linear

    t = _trainer(tiny_model_dir, lora=LORA)
    made = []
    real = Linear.get_delta_weight
    monkeypatch.setattr(Linear, "get_delta_weight", lambda self, name: made.append(1) or real(self, name))
    merged = 0
    for name, _ in t.named_parameters_for_sync():
        merged += any(m in name for m in ("q_proj", "v_proj", "down_proj"))
        assert len(made) == merged, name  # one delta per merged weight so far, never ahead of it
    assert merged == 2 * 3


def test_a_bf16_lora_trainer_never_puts_an_fp32_base_on_its_device(tiny_model_dir, demo_tokenizer, monkeypatch):
    """The frozen base of a bf16 LoRA trainer is cast on the host: what moves to the device is bf16 (2 bytes a
    parameter, as the memory plan counts), never the fp32 load (4). The adapters still start from the seed alone,
    with fp32 masters, and train."""
    moved: list[set] = []
    to = torch.nn.Module.to

    def recording_to(module, *args, **kwargs):
        if any(isinstance(a, (str, torch.device)) for a in args) or "device" in kwargs:
            moved.append({p.dtype for p in module.parameters()})
        return to(module, *args, **kwargs)

    monkeypatch.setattr(torch.nn.Module, "to", recording_to)
    t = _trainer(tiny_model_dir, lora=LORA, lr=1e-3, precision="bf16")
    monkeypatch.undo()
    assert moved and moved[0] == {torch.bfloat16}, moved  # the whole model's first move: bf16 already
    assert {p.dtype for n, p in t.model.named_parameters() if ".base_layer." in n} == {torch.bfloat16}
    assert all(p.dtype == torch.float32 for g in t.optimizer.param_groups for p in g["params"])
    samples = [_sample(t, demo_tokenizer, "Hi there", " general kenobi", 1.0, "a")]
    before = [m.clone() for m in t.master.masters]
    t.train_step(samples)
    assert any(not torch.equal(a, b) for a, b in zip(before, t.master.masters))
