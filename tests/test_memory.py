"""The start-up memory estimate counts what a run really holds (astuner/memory.py, astuner/preflight.py): the
trainer's activations and logits for the micro-batch, the engine's KV cache sized from the memory left, and a
refusal with the figures when not even one full-length sequence fits. Hand-computed on the demo model's shape."""

from __future__ import annotations

import pytest
from test_run_contract import write_run

from astuner.config import load_config
from astuner.errors import UserError
from astuner.memory import DeviceFacts, ModelShape, blocks_of
from astuner.preflight import (
    GIB,
    RESERVE,
    VLLM_CPU_RUNTIME,
    ModelFacts,
    check_fits,
    make_plan,
)

# SmolLM2-135M-Instruct's config.json: 30 layers, hidden 576, MLP 1536, vocabulary 49152, 3 KV heads of 64.
DEMO = ModelShape(layers=30, hidden=576, intermediate=1536, vocab=49152, kv_heads=3, head_dim=64)
FACTS = ModelFacts("demo", "LlamaForCausalLM", 134_515_008, 8192, DEMO)


def test_the_formulas_by_hand():
    # fp32: 4 * 30 * (10 * 576 + 4 * 1536) = 1_428_480 layer bytes + 20 * 49152 = 983_040 head bytes a token.
    assert DEMO.activation_bytes(1, 4, checkpointing=False, chunk_rows=None) == 1_428_480 + 983_040
    # Checkpointing: 4 * (4 * 30 * 576 + 10 * 576 + 4 * 1536) = 324_096 a token, plus the same head.
    assert DEMO.activation_bytes(1000, 4, True, None) == 1000 * (324_096 + 983_040)
    # The plain head with top-k / top-p and a trained entropy: 22 bytes an entry of R x V.
    assert DEMO.activation_bytes(1000, 4, True, None, filtered=True, entropy_grad=True) == 1000 * (324_096 + 22 * 49152)
    # The chunked head holds 8 bytes an entry of 4096 rows x V, whatever the token count and the mode, plus the
    # backward's fp32 weight gradient and one bf16 product and its fp32 copy (10 bytes an entry of V x H).
    chunked = 10_000 * 714_240 + 8 * 4096 * 49152 + 10 * 49152 * 576
    assert DEMO.activation_bytes(10_000, 2, False, 4096) == chunked
    assert DEMO.activation_bytes(10_000, 2, False, 4096, filtered=True, entropy_grad=True) == chunked
    assert DEMO.kv_bytes_per_token(4) == 2 * 30 * 3 * 64 * 4 == 46_080
    assert blocks_of(4096) == 4096 and blocks_of(4097) == 4224


def _plan(tmp_path, tiny_model_dir, monkeypatch, available_gib, *overrides):
    monkeypatch.setattr("astuner.preflight.available_memory", lambda device: int(available_gib * GIB))
    monkeypatch.delenv("ASTUNER_SKIP_MEMORY_CHECK", raising=False)
    typed = load_config(write_run(tmp_path, tiny_model_dir), ["astuner.rollout.engine=vllm",
                                                               "astuner.trainer_common.precision=fp32",
                                                               *overrides]).typed
    return make_plan(typed, "debug", FACTS, typed.astuner.rollout.max_model_len, 4)


SMOLAGENTS = ("astuner.rollout.max_model_len=4096", "astuner.rollout.max_num_seqs=64",
              "astuner.data.train_batch_size=8", "astuner.rollout.num_repeat=8",
              "trinity.trainer.max_token_len_per_gpu=13000")


def test_the_kv_cache_and_the_micro_batch_are_fitted_to_the_memory_left(tmp_path, tiny_model_dir, monkeypatch):
    """The run the kernel once killed (demo model, vLLM on CPU, max_model_len 4096): 64 sequences of KV cache
    want 11.25 GiB and a 13000-token micro-batch 24.4 GiB; on 24 GiB both are cut to fit, and said so."""
    plan = _plan(tmp_path, tiny_model_dir, monkeypatch, 24, *SMOLAGENTS)
    per_seq = 46_080 * 4096
    # trainer (fp32 AdamW) + the engine's copy + vLLM's engine-core and worker processes (measured)
    weights = 16 * FACTS.num_params + 4 * FACTS.num_params + VLLM_CPU_RUNTIME
    room = 24 * GIB - RESERVE - weights
    assert plan.kv_cache_bytes == room // 2 and plan.kv_cache_bytes < 64 * per_seq  # half of what is left
    assert plan.kv_sequences == pytest.approx((room // 2) / per_seq)
    assert 4096 <= plan.micro_batch_token_budget < 13000
    assert plan.activation_bytes <= room - room // 2
    assert DEMO.activation_bytes(plan.micro_batch_token_budget + 1, 4, False, None) > room - room // 2  # the largest
    assert plan.total_bytes <= 24 * GIB - RESERVE
    assert any("lowered from 13000" in r for r in plan.resized) and any("KV cache sized" in r for r in plan.resized)
    block = plan.block(FACTS)
    assert "KV cache" in block and "activations" in block and "lowered from 13000" in block
    check_fits(plan, FACTS)  # fits now
    # Plenty of memory: everything as configured.
    roomy = _plan(tmp_path, tiny_model_dir, monkeypatch, 200, *SMOLAGENTS)
    assert (roomy.kv_cache_bytes, roomy.micro_batch_token_budget, roomy.resized) == (64 * per_seq, 13000, ())


def test_a_run_where_one_full_length_sequence_does_not_fit_is_refused_with_the_figures(tmp_path, tiny_model_dir,
                                                                                         monkeypatch):
    plan = _plan(tmp_path, tiny_model_dir, monkeypatch, 8, *SMOLAGENTS)  # 4096 tokens of activations: 7.7 GiB
    with pytest.raises(UserError) as err:
        check_fits(plan, FACTS)
    message = str(err.value)
    assert "activations of one 4096-token micro-batch" in message and "gradient_checkpointing" in message
    assert "KV cache for one sequence" in message
    # Gradient checkpointing (the layers' 1.43 MB a token down to 0.32, beside the plain head's 0.98) fits the same
    # run in 10.5 GiB: 5.0 GiB of activations, where 8 GiB leaves 2.8 beside the weights, vLLM's processes, the KV
    # cache and this process.
    check_fits(_plan(tmp_path, tiny_model_dir, monkeypatch, 10.5, *SMOLAGENTS,
                     "astuner.trainer_common.gradient_checkpointing=true"), FACTS)


def test_distillations_topk_term_is_planned_with_the_plain_heads_logits_on_cuda(tmp_path, tiny_model_dir):
    """The top-k term reads the full logits (trainer/forward.py): on CUDA the plan counts the plain head, not the
    chunked one the trainer then does not take."""
    card = DeviceFacts("cuda", 80 * GIB, 80 * GIB)
    distil = ("astuner.trainer_common.algorithm.type=on_policy_distillation", f"astuner.teacher.model={tiny_model_dir}")

    def plan(*overrides):
        typed = load_config(write_run(tmp_path, tiny_model_dir), list(overrides)).typed
        return make_plan(typed, "debug", FACTS, typed.astuner.rollout.max_model_len, 4, device_facts=card)

    budget = plan(*distil).micro_batch_token_budget
    plain = DEMO.activation_bytes(budget, 2, False, None)
    assert plan(*distil).activation_bytes < plain  # chunked
    assert plan(*distil, "astuner.trainer_common.algorithm.distill_topk=4").activation_bytes == plain
