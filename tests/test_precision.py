"""bf16 trainer with fp32 master weights (astuner/trainer/precision.py), exercised on CPU with the tiny model."""

from __future__ import annotations

import pytest
import torch

from astuner.trainer.precision import resolve_precision
from tests.test_trainer import _sample, _trainer


def test_resolve_precision():
    assert resolve_precision("auto", "cuda") == "bf16" and resolve_precision("auto", "cpu") == "fp32"
    assert resolve_precision("bf16", "cpu") == "bf16"
    with pytest.raises(ValueError, match="fp16"):
        resolve_precision("fp16", "cuda")


def test_bf16_weights_fp32_masters_and_small_updates_accumulate(tiny_model_dir, demo_tokenizer, tmp_path):
    # lr 1e-6 moves a weight by ~1e-6 per step: far below bf16's resolution (~4e-3 relative), so rounding every
    # step into bf16 weights would lose it; the masters keep it.
    t = _trainer(tiny_model_dir, precision="bf16", lr=1e-6)
    assert all(p.dtype == torch.bfloat16 for p in t.model.parameters())
    assert all(p.dtype == torch.float32 for g in t.optimizer.param_groups for p in g["params"])
    before = [m.clone() for m in t.master.masters]
    bf16_before = [p.detach().clone() for p in t.model.parameters()]
    samples = [_sample(t, demo_tokenizer, "Hi there", " general kenobi", 1.0, "a"),
               _sample(t, demo_tokenizer, "Hi there", " hello", -1.0, "b")]
    for _ in range(3):
        t.train_step(samples)
    moved = sum(int((m != b).sum()) for m, b in zip(t.master.masters, before))
    assert moved > 0.5 * sum(m.numel() for m in before)  # Adam moves (almost) every weight
    # The model's weights are exactly the masters rounded to bf16 ...
    for m, p in zip(t.master.masters, t.model.parameters()):
        assert torch.equal(m.to(torch.bfloat16), p.detach())
    # ... and most of them did not change at all in bf16: only the masters hold these updates.
    unchanged = sum(int((p.detach() == b).sum()) for p, b in zip(t.model.parameters(), bf16_before))
    assert unchanged > 0.8 * sum(b.numel() for b in bf16_before)
    assert all(p.grad is None for p in t.model.parameters())

    # Checkpoints hold the fp32 masters: a resumed trainer continues from exactly the same numbers.
    t.save_checkpoint(tmp_path / "ckpt", tokenizer=demo_tokenizer, run_state={"step": 3})
    resumed = _trainer(tiny_model_dir, precision="bf16", lr=1e-6)
    resumed.load_checkpoint(tmp_path / "ckpt")
    for a, b in zip(resumed.master.masters, t.master.masters):
        assert torch.equal(a, b)
    loss_a = t.train_step(samples)["policy_loss"]
    loss_b = resumed.train_step(samples)["policy_loss"]
    assert loss_a == pytest.approx(loss_b, abs=1e-6)
