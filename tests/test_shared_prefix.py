"""The shared-prefix forward: samples whose inputs begin alike forward that prefix once (step_plan.prefix_groups,
trainer/forward.py). The grouping by hand; on the tiny Llama, the same logprobs and gradients as the plain path
with the prefix's tokens embedded once; models whose cache does not keep the whole prefix take the plain path."""

from __future__ import annotations

import pytest
import torch

from astuner.step_plan import PrefixGroup, even_parts, prefix_groups, split_shared_micro_batches
from astuner.trainer import Trainer
from astuner.types import Sample
from tolerances import assert_close_normwise


def test_prefix_groups_by_hand():
    a, b, c = [1, 2, 3, 4, 5], [1, 2, 3, 4, 6, 7], [9, 9]
    # a and b share 4 tokens (>= 2); c alone joins the unshared group, listed first.
    assert prefix_groups([a, b, c], 2) == [PrefixGroup((2,), 0), PrefixGroup((0, 1), 4)]
    assert prefix_groups([a, b, c], 5) == [PrefixGroup((0, 1, 2), 0)]
    assert prefix_groups([a, b, c], 0) == [PrefixGroup((0, 1, 2), 0)]
    # One input the other's prefix: capped one short of the shorter, so each forwards a token of its own.
    assert prefix_groups([[1, 2, 3], [1, 2, 3, 4]], 1) == [PrefixGroup((0, 1), 2)]


def test_a_run_takes_a_sample_only_when_it_saves_more_than_the_others_lose():
    head = list(range(100, 110))  # 10 shared tokens
    run3 = [head + [1], head + [2], head + [3]]
    # A fourth that shares 3: (3 - 1) * (10 - 3) = 14 tokens lost > 3 saved: it stays out.
    out = head[:3] + [50, 51]
    assert prefix_groups(run3 + [out], 2) == [PrefixGroup((3,), 0), PrefixGroup((0, 1, 2), 10)]
    # Beside a run of two, one that shares 8 joins: (2 - 1) * (10 - 8) = 2 < 8; the run then shares 8.
    near = head[:8] + [60]
    assert prefix_groups(run3[:2] + [near], 2) == [PrefixGroup((0, 1, 2), 8)]


def test_shared_micro_batches_keep_a_group_within_the_budget():
    prefix = list(range(1000, 1010))
    inputs = [prefix + [k] * n for k, n in ((1, 2), (2, 5), (3, 3))] + [[7, 8, 9]]
    # Tokens of a sample: input + 1 (13, 16, 14, 4). The group counts as the plain path's padded tokens,
    # 3 * 16 = 48: one micro-batch at budget 50, the unshared sample in its own.
    mbs = split_shared_micro_batches(inputs, 50, 4)
    assert mbs == [([1, 2, 0], [PrefixGroup((0, 1, 2), 10)]), ([3], [PrefixGroup((0,), 0)])]
    # Budget 40: cut longest first, 2 * 16 = 32 fits, 3 * 16 = 48 does not: the part of one left (sample 0) goes
    # unshared, packed with sample 3 (2 * 13 = 26 <= 40).
    mbs = split_shared_micro_batches(inputs, 40, 4)
    assert mbs == [([1, 2], [PrefixGroup((0, 1), 10)]), ([0, 3], [PrefixGroup((0, 1), 0)])]


def _trainer(model_dir, **kw) -> Trainer:
    return Trainer(str(model_dir), lr=1e-3, weight_decay=0.0, grad_clip=None, loss_agg_mode="token-mean",
                   norm_length=16, max_token_len_per_micro_batch=4096, device="cpu", **kw)


def _batch(trainer: Trainer, tok) -> list[Sample]:
    system = tok("You are a careful assistant. Look the badge up, then the code, then answer with the code.",
                 add_special_tokens=False)["input_ids"]
    out = []
    for k, (question, answer) in enumerate([("Who is Ada?", " Ada is a badge holder."), ("Who is Ada?", " 7983"),
                                            ("Who is Tomas?", " I do not know who Tomas is, sorry."),
                                            ("Hi", " hello")]):
        p = system + tok(question, add_special_tokens=False)["input_ids"]
        r = tok(answer, add_special_tokens=False)["input_ids"]
        out.append(Sample(p, r, trainer.compute_logprobs(p, r, 1.0), 1.0 - k, 1.0, f"e{k}"))
    out.append(Sample([5, 6], [7, 8, 9], trainer.compute_logprobs([5, 6], [7, 8, 9], 1.0), 0.5, 1.0, "e9"))
    return out


def _embedded_tokens(owner, fn) -> int:
    """Tokens the model of `owner` (a trainer, an engine) embedded while `fn` ran."""
    count = [0]
    handle = owner.model.get_input_embeddings().register_forward_hook(
        lambda m, args, out: count.__setitem__(0, count[0] + args[0].numel()))
    try:
        fn()
    finally:
        handle.remove()
    return count[0]


def test_the_shared_forward_gives_the_plain_forwards_logprobs_and_gradients(tiny_model_dir, demo_tokenizer):
    plain, shared = _trainer(tiny_model_dir, shared_prefix_min_tokens=0), _trainer(tiny_model_dir)
    assert shared.head.shared_prefix == 16 and plain.head.shared_prefix == 0
    batch = _batch(plain, demo_tokenizer)
    lengths = [len(s.prompt_ids) + len(s.response_ids) - 1 for s in batch]
    system = len(batch[2].prompt_ids) - 5  # "Who is Tomas?" and "Who is Ada?" part after "Who is"
    groups = shared.head.groups(batch)
    assert any(g.shared >= system for g in groups), groups
    with torch.no_grad():
        expected = plain.forward_logprobs(batch)[0]
        got = shared.forward_logprobs(batch)[0]
    assert_close_normwise(got, expected, what="logprobs")
    grads = []
    for t in (plain, shared):
        t.zero_grad()
        grads.append(_embedded_tokens(t, lambda t=t: t.forward_backward(batch, "policy")))
        grads.append(torch.cat([p.grad.flatten() for p in t.model.parameters() if p.grad is not None]))
    plain_tokens, plain_grad, shared_tokens, shared_grad = grads
    assert_close_normwise(shared_grad, plain_grad, what="gradient")
    # Planned by split_shared_micro_batches: the grouped samples' prefix embedded once (the plain path pads each
    # micro-batch to its longest sample).
    cost = sum(g.cost([n + 1 for n in lengths]) for _, gs in shared.micro_batches(batch) for g in gs if g.shared)
    assert shared_tokens < plain_tokens and shared_tokens <= cost + sum(lengths)


def test_gradient_checkpointing_and_sliding_windows_take_the_plain_path(tiny_model_dir, tmp_path):
    assert _trainer(tiny_model_dir, gradient_checkpointing=True).head.shared_prefix == 0
    from transformers import AutoConfig, MistralConfig, MistralForCausalLM

    llama = AutoConfig.from_pretrained(tiny_model_dir)
    config = MistralConfig(vocab_size=llama.vocab_size, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                           num_attention_heads=2, num_key_value_heads=1, head_dim=64, sliding_window=4)
    torch.manual_seed(0)
    MistralForCausalLM(config).save_pretrained(tmp_path)
    trainer = _trainer(tmp_path)
    assert trainer.head.fast and trainer.head.shared_prefix == 0


@pytest.mark.parametrize("min_tokens", [0, 16])
def test_a_train_step_is_the_same_either_way(tiny_model_dir, demo_tokenizer, min_tokens):
    """Through Trainer.train (old logprobs recomputed: the second call site of the plan)."""
    t = _trainer(tiny_model_dir, shared_prefix_min_tokens=min_tokens, old_logprobs="trainer")
    metrics = t.train(_batch(t, demo_tokenizer), "policy").metrics
    assert metrics["num_micro_batches"] == (2.0 if min_tokens else 1.0)
    assert metrics["logprob_abs_diff_max"] < 1e-4


def test_the_hf_engine_scores_a_sequence_that_begins_as_the_last_from_where_they_part(tiny_model_dir):
    from astuner.engine.hf_engine import HFEngine

    engine, fresh = HFEngine(str(tiny_model_dir)), HFEngine(str(tiny_model_dir))
    head = [(k * 131 + 7) % 5000 for k in range(30)]
    first, second = head + [11, 12, 13], head[:24] + [21, 22, 23, 24]
    try:
        engine.prompt_logprobs(first, topk=3)
        scored = []
        tokens = _embedded_tokens(engine, lambda: scored.append(engine.prompt_logprobs(second, topk=3)))
        got, want = scored[0], fresh.prompt_logprobs(second, topk=3)
        # Forwarded from token 23 (one short of the 24 shared, whose logits predict the first that differs).
        assert tokens == len(second) - 23
        assert_close_normwise(got.values, want.values, what="prompt logprobs")
        assert [[t for t, _ in row] for row in got.topk] == [[t for t, _ in row] for row in want.topk]
        # Another top-k, or a prefix under 16 tokens: the whole sequence again.
        assert _embedded_tokens(engine, lambda: engine.prompt_logprobs(second, topk=2)) == len(second)
        assert _embedded_tokens(engine, lambda: engine.prompt_logprobs(head[:10] + [1, 2], topk=2)) == 12
        # New weights: nothing computed with the old ones is reused.
        engine.prompt_logprobs(first)
        engine.load_weights((n, p * 1.01) for n, p in fresh.model.named_parameters())
        assert _embedded_tokens(engine, lambda: engine.prompt_logprobs(second)) == len(second)
    finally:
        engine.shutdown()
        fresh.shutdown()


def test_a_model_teacher_scores_alike_sequences_in_a_row_and_answers_in_their_order(tiny_model_dir):
    from astuner.distill.teachers import EngineTeacher
    from astuner.engine.hf_engine import HFEngine

    head = [(k * 131 + 7) % 5000 for k in range(20)]
    seqs = [head + [9, 9, 9], [3, 1, 4, 1, 5], head + [1, 2], head[:18] + [7, 7, 7, 7]]
    engine, fresh = HFEngine(str(tiny_model_dir)), HFEngine(str(tiny_model_dir))
    try:
        teacher = EngineTeacher(engine, 30, "local")
        # Sorted: [3, 1, ...], then the three that begin with the head (head[18] = 2365 > 7): the first whole,
        # each next from one short of what it shares with the one before (18, then 20 tokens).
        tokens = _embedded_tokens(engine, lambda: teacher.score(seqs, topk=2))
        assert tokens == 5 + len(seqs[3]) + (len(seqs[2]) - 17) + (len(seqs[0]) - 19)
        for got, seq in zip(teacher.score(seqs, topk=2), seqs):
            want = fresh.prompt_logprobs(seq, topk=2)
            assert len(got.values) == len(seq) - 1
            assert_close_normwise(got.values, want.values, what="teacher logprobs")
    finally:
        engine.shutdown()
        fresh.shutdown()


def test_even_parts_by_hand():
    # Longest first: 10, then 9 (padding 1 of 20), 8 (3 of 30), 4 (9 of 40: 22% <= 25%), then 2 opens a new part
    # (10 * 5 - 33 = 17 of 50), and 1 joins it (1 of 4).
    assert even_parts([4, 10, 2, 8, 9, 1]) == [[1, 4, 3, 0], [2, 5]]
    assert even_parts([5, 5, 5], max_padding=0.0) == [[0, 1, 2]]
    assert even_parts([]) == []


def test_the_hf_engine_keeps_no_cache_larger_than_its_bound(tiny_model_dir, monkeypatch):
    from astuner.engine import hf_engine

    engine = hf_engine.HFEngine(str(tiny_model_dir))
    head = [(k * 131 + 7) % 5000 for k in range(30)]
    try:
        # The tiny Llama's cache: 2 layers x (keys + values) x 64 floats a token; 33 tokens are 33 KiB.
        monkeypatch.setattr(hf_engine, "REUSE_MAX_BYTES", 32 << 10)
        engine.prompt_logprobs(head + [1, 2, 3])
        assert _embedded_tokens(engine, lambda: engine.prompt_logprobs(head + [4])) == 31
        monkeypatch.setattr(hf_engine, "REUSE_MAX_BYTES", 64 << 10)
        engine.prompt_logprobs(head + [1, 2, 3])
        assert _embedded_tokens(engine, lambda: engine.prompt_logprobs(head + [4])) == 2
    finally:
        engine.shutdown()
