"""Every weight sync is verified: the engine's fingerprint of what it serves against the fingerprint of what it
was sent (astuner/engine/fingerprint.py)."""

from __future__ import annotations

import pytest
import torch

from astuner.engine.fingerprint import SyncMismatch, differences, fingerprint, group_of


def test_groups_and_sums_by_hand():
    assert group_of("model.layers.3.self_attn.q_proj.weight") == "model.layers.3.self_attn"
    assert group_of("model.layers.3.input_layernorm.weight") == "model.layers.3"
    assert group_of("lm_head.weight") == "<top>"
    fp = fingerprint([("m.l.q.weight", torch.tensor([1.0, -2.0])), ("m.l.k.weight", torch.tensor([[0.5], [-0.25]])),
                      ("m.n.weight", torch.tensor([3.0]))])
    assert fp == {"m": (3.0, 3.0), "m.l": (-0.75, 3.75)}  # m.l: 1 - 2 + 0.5 - 0.25; |.|: 1 + 2 + 0.5 + 0.25


def test_a_fused_layout_holds_the_same_fingerprint_and_a_skipped_tensor_does_not():
    torch.manual_seed(0)
    q, k, v = torch.randn(8, 4), torch.randn(2, 4), torch.randn(2, 4)
    sent = fingerprint([("m.layers.0.attn.q_proj.weight", q), ("m.layers.0.attn.k_proj.weight", k),
                        ("m.layers.0.attn.v_proj.weight", v)])
    fused = fingerprint([("m.layers.0.attn.qkv_proj.weight", torch.cat([q, k, v]))])  # as vLLM holds them
    assert differences(sent, fused) == []
    stale_k = k - 1e-4  # the engine missed k's update of 1e-4
    problems = differences(sent, fingerprint([("m.layers.0.attn.qkv_proj.weight", torch.cat([q, stale_k, v]))]))
    assert len(problems) == 1 and problems[0].startswith("m.layers.0.attn: sent sum")
    assert differences(sent, {}) == ["m.layers.0.attn: sent, but the engine holds no such weights"]


def test_the_hf_engine_verifies_each_sync_and_catches_a_skipped_tensor(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    from astuner.engine.hf_engine import HFEngine

    class SkipsOne(HFEngine):  # a loader that silently drops one tensor
        def _copy_in(self, name, param, value):
            if name != "model.layers.1.mlp.down_proj.weight":
                super()._copy_in(name, param, value)

    new = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    with torch.no_grad():
        for p in new.parameters():
            p.add_(1e-3)  # one training step's worth of change everywhere
    engine = HFEngine(str(tiny_model_dir), device="cpu")
    engine.load_weights(new.named_parameters())
    assert engine.last_sync["verified"] == 1.0 and engine.last_sync["verify_s"] > 0
    faulty = SkipsOne(str(tiny_model_dir), device="cpu")
    with pytest.raises(SyncMismatch, match=r"(?s)hf engine does not serve.*\n  model.layers.1.mlp: sent sum") as info:
        faulty.load_weights(new.named_parameters())
    assert "model.layers.0" not in str(info.value)  # only the group that missed its update
