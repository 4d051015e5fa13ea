"""The PyTorch trainer on the tiny random Llama (CPU, fp32)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from astuner.step_plan import split_micro_batches, split_mini_batches
from astuner.trainer import Trainer
from astuner.types import Sample
from tolerances import LOGPROB_ATOL, assert_close_normwise, assert_scalar_close


def _trainer(model_dir, **overrides) -> Trainer:
    kwargs = dict(
        lr=1e-3, weight_decay=0.0, lr_warmup_steps=0, grad_clip=None, clip_ratio_low=0.2, clip_ratio_high=0.28,
        use_kl_loss=False, kl_loss_coef=0.0, kl_loss_type="k3", loss_agg_mode="token-mean", norm_length=16,
        max_token_len_per_micro_batch=4096, mini_batch_num=1, device="cpu",
    )
    kwargs.update(overrides)
    return Trainer(str(model_dir), **kwargs)


def _sample(trainer: Trainer, tok, prompt: str, response: str, adv: float, uid: str, temperature=1.0) -> Sample:
    p = tok(prompt, add_special_tokens=False)["input_ids"]
    r = tok(response, add_special_tokens=False)["input_ids"]
    return Sample(p, r, trainer.compute_logprobs(p, r, temperature), adv, temperature, uid)


def test_split_micro_batches_rule():
    # Longest first: 8 | 5+3 (5*2 = 10 <= 10) | 2 (5*3 = 15 > 10); an over-budget sample goes alone.
    assert split_micro_batches([5, 3, 8, 2], 10) == [[2], [0, 1], [3]]
    assert split_micro_batches([5, 3, 8, 2], 4) == [[2], [0], [1], [3]]
    assert split_micro_batches([5, 3, 8, 2], 100) == [[2, 0, 1, 3]]


def test_split_mini_batches_keeps_episodes_together():
    uids = ["a", "a", "b", "c", "c", "d", "e"]
    samples = [Sample([1], [2], [0.0], 0.0, 1.0, u) for u in uids]
    parts = split_mini_batches(samples, 2)
    assert [[s.episode_uid for s in p] for p in parts] == [["a", "a", "b", "c", "c"], ["d", "e"]]
    assert len(split_mini_batches(samples, 10)) == 5
    assert split_mini_batches([], 3) == []


def test_compute_logprobs_matches_full_forward(tiny_model_dir):
    trainer = _trainer(tiny_model_dir)
    prompt, response = [5, 17, 300, 42, 9], [77, 1200, 3, 8]
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = trainer.model(input_ids=ids).logits[0]
    for temperature in (0.7, 1.0):
        expected = torch.log_softmax(logits / temperature, dim=-1)
        expected = [expected[len(prompt) + i - 1, t].item() for i, t in enumerate(response)]
        assert trainer.compute_logprobs(prompt, response, temperature) == pytest.approx(expected, abs=LOGPROB_ATOL)
    # Greedy calls are logged under the untempered distribution.
    assert trainer.compute_logprobs(prompt, response, 0.0) == pytest.approx(
        trainer.compute_logprobs(prompt, response, 1.0), abs=1e-6
    )


def _grads(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}


def test_micro_batch_invariance(tiny_model_dir, demo_tokenizer):
    trainer = _trainer(tiny_model_dir, loss_agg_mode="seq-mean-token-mean")
    texts = [
        ("What is 2+2?", " It is 4.", 1.0, "e1"),
        ("Name a color that is warm.", " Red, like fire", 1.0, "e1"),
        ("What is 2+2?", " Five, maybe six or seven.", -1.0, "e2"),
        ("Say hi", " hi", 0.5, "e3"),
    ]
    samples = [_sample(trainer, demo_tokenizer, *t) for t in texts]
    # Move the old logprobs off the current ones so that some tokens are clipped.
    for s in samples:
        s.old_logprobs = [x + (0.4 if i % 2 else -0.1) for i, x in enumerate(s.old_logprobs)]

    results = []
    for budget in (10**6, 1, 24):
        trainer.settings = dataclasses.replace(trainer.settings, max_token_len_per_micro_batch=budget)
        trainer.optimizer.zero_grad(set_to_none=True)
        sums = trainer.forward_backward(samples)
        results.append((sums, _grads(trainer)))
    trainer.optimizer.zero_grad(set_to_none=True)

    (full, full_grads), *others = results
    assert full["num_micro_batches"] == 1
    assert full["clip_fraction"] > 0
    for sums, grads in others:
        assert sums["num_micro_batches"] > 1
        assert_scalar_close(sums["loss"], full["loss"], scale=1.0, what="loss")  # |advantage| <= 1 per token
        assert sums["clip_fraction"] == pytest.approx(full["clip_fraction"], abs=1e-5)
        assert grads.keys() == full_grads.keys()
        for name, g in grads.items():
            assert_close_normwise(g, full_grads[name], what=name)


def test_train_step_moves_logprobs_by_advantage_sign(tiny_model_dir, demo_tokenizer):
    trainer = _trainer(tiny_model_dir, grad_clip=1.0)
    good = _sample(trainer, demo_tokenizer, "Question: 3 + 4 =", " 7", 1.0, "good")
    bad = _sample(trainer, demo_tokenizer, "Question: 3 + 4 =", " 12 apples", -1.0, "bad")
    before = [sum(s.old_logprobs) for s in (good, bad)]
    metrics = trainer.train_step([good, bad])
    after = [sum(trainer.compute_logprobs(s.prompt_ids, s.response_ids, 1.0)) for s in (good, bad)]
    assert after[0] > before[0]
    assert after[1] < before[1]
    # Before the update the policy is the sampling policy: ratio 1, nothing clipped.
    assert metrics["ratio_mean"] == pytest.approx(1.0, abs=LOGPROB_ATOL)
    assert metrics["clip_fraction"] == 0.0
    assert metrics["approx_kl_old"] == pytest.approx(0.0, abs=LOGPROB_ATOL)
    assert metrics["num_samples"] == 2 and metrics["num_micro_batches"] == 1
    assert metrics["train_tokens"] == good.num_tokens + bad.num_tokens
    assert metrics["grad_norm"] > 0 and metrics["entropy"] > 0 and metrics["train_tokens_per_s"] > 0
    assert metrics["lr"] == 1e-3
    assert "kl_ref" not in metrics


def test_zero_advantage_samples_skipped_and_warmup(tiny_model_dir, demo_tokenizer):
    trainer = _trainer(tiny_model_dir, mini_batch_num=2, lr_warmup_steps=4)
    samples = [
        _sample(trainer, demo_tokenizer, "Hello", " there", 1.0, "a"),
        _sample(trainer, demo_tokenizer, "Hello", " world", 0.0, "b"),
        _sample(trainer, demo_tokenizer, "Bye", " now", -1.0, "c"),
    ]
    metrics = trainer.train_step(samples)
    assert metrics["num_optimizer_steps"] == 2
    assert metrics["num_samples_skipped_zero_adv"] == 1
    assert metrics["lr"] == pytest.approx(1e-3 * 2 / 4)  # second warmup step
    # Only zero-advantage samples: no gradient, no step.
    empty = trainer.train_step([samples[1]])
    assert empty["num_optimizer_steps"] == 0 and "policy_loss" not in empty
    assert trainer.optimizer_steps == 2


def test_kl_to_reference(tiny_model_dir, demo_tokenizer):
    trainer = _trainer(tiny_model_dir, use_kl_loss=True, kl_loss_coef=0.1, kl_loss_type="k3")
    samples = [
        _sample(trainer, demo_tokenizer, "Hello", " there friend", 1.0, "a"),
        _sample(trainer, demo_tokenizer, "Hello", " go away", -1.0, "b"),
    ]
    first = trainer.train_step(samples)
    assert first["kl_ref"] == pytest.approx(0.0, abs=1e-7)
    second = trainer.train_step(samples)
    assert second["kl_ref"] > 0
    # The reference stays frozen.
    assert all(not p.requires_grad for p in trainer.ref_model.parameters())


def test_checkpoint_roundtrip(tiny_model_dir, demo_tokenizer, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    trainer = _trainer(tiny_model_dir)
    samples = [_sample(trainer, demo_tokenizer, "Hi", " hello", 1.0, "a"),
               _sample(trainer, demo_tokenizer, "Hi", " no", -1.0, "b")]
    trainer.train_step(samples)
    target = tmp_path / "global_step_1"
    trainer.save_checkpoint(target)
    trainer.train_step(samples)
    trainer.save_checkpoint(target)  # overwrite in place
    assert sorted(p.name for p in tmp_path.iterdir()) == ["global_step_1"]  # no temp folders left

    loaded = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
    trained = trainer.model.state_dict()
    for name, tensor in loaded.state_dict().items():
        torch.testing.assert_close(tensor, trained[name], atol=0, rtol=0, msg=name)
    assert len(AutoTokenizer.from_pretrained(target)) == len(demo_tokenizer)

    synced = dict(trainer.named_parameters_for_sync())
    assert synced.keys() == dict(trainer.model.named_parameters()).keys()
    assert "lm_head.weight" not in synced  # tied to the input embedding


def test_checkpoint_on_a_full_disk_names_the_cause(tiny_model_dir, demo_tokenizer, tmp_path, monkeypatch):
    # torch.save on a full disk fails with "unexpected pos": the error must say the disk is full, and no
    # half-written folder may stay behind.
    import shutil

    import astuner.trainer.checkpoint as checkpoint

    trainer = _trainer(tiny_model_dir)

    def full_disk(*args, **kwargs):
        raise RuntimeError("[enforce fail at inline_container.cc:603] . unexpected pos 64 vs 0")

    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(checkpoint.torch, "save", full_disk)
    monkeypatch.setattr(checkpoint.shutil, "disk_usage", lambda p: usage._replace(free=10 * 2**20))
    with pytest.raises(OSError, match=r"disk nearly full \(0.0 GiB free.*save_freq"):
        trainer.save_checkpoint(tmp_path / "global_step_1", tokenizer=demo_tokenizer, run_state={"step": 1})
    assert list(tmp_path.iterdir()) == []


def test_lr_schedule_by_hand():
    from astuner.step_plan import lr_at

    # Warmup 2 steps to 1.0, then cosine over the remaining 8 (progress p = (step - 2) / 7) down to 0.1.
    assert [lr_at(s, 1.0, 2, 10, "cosine", 0.1) for s in (0, 1)] == [0.5, 1.0]
    assert lr_at(2, 1.0, 2, 10, "cosine", 0.1) == pytest.approx(1.0)
    assert lr_at(9, 1.0, 2, 10, "cosine", 0.1) == pytest.approx(0.1)
    # p = 3.5 / 7 = 0.5: 0.1 + 0.9 * (1 + cos(pi / 2)) / 2 = 0.55
    assert lr_at(5.5, 1.0, 2, 10, "cosine", 0.1) == pytest.approx(0.55)
    assert lr_at(50, 1.0, 0, 10, "constant", 0.1) == 1.0
    # Linear: same progress p; lr = 1 - (1 - 0.1) * p: 1.0 right after warmup, 0.55 halfway, 0.1 at the end.
    assert [lr_at(s, 1.0, 2, 10, "linear", 0.1) for s in (0, 1, 2, 9)] == pytest.approx([0.5, 1.0, 1.0, 0.1])
    assert lr_at(5.5, 1.0, 2, 10, "linear", 0.1) == pytest.approx(0.55)
    assert lr_at(5.5, 1.0, 2, 10, "linear", 0.0) == pytest.approx(0.5)


def test_ppo_epochs_repeat_the_batch_against_the_same_old_logprobs(tiny_model_dir, demo_tokenizer):
    one = _trainer(tiny_model_dir, mini_batch_num=2)
    two = _trainer(tiny_model_dir, mini_batch_num=2, ppo_epochs=2)
    samples = [_sample(one, demo_tokenizer, "Hello", " there", 1.0, "a"),
               _sample(one, demo_tokenizer, "Bye", " now", -1.0, "c")]
    m1, m2 = one.train_step(samples), two.train_step(samples)
    assert (m1["num_optimizer_steps"], m2["num_optimizer_steps"]) == (2, 4)
    # The second epoch sees the policy moved away from the old logprobs: the ratio is no longer exactly 1.
    assert m1["approx_kl_old"] < m2["approx_kl_old"]
    moved_one = one.compute_logprobs(samples[0].prompt_ids, samples[0].response_ids, 1.0)
    moved_two = two.compute_logprobs(samples[0].prompt_ids, samples[0].response_ids, 1.0)
    assert sum(moved_two) > sum(moved_one) > sum(samples[0].old_logprobs)  # A > 0: pushed up, further with 2


def test_entropy_coeff_trains_zero_advantage_samples_toward_higher_entropy(tiny_model_dir, demo_tokenizer):
    trainer = _trainer(tiny_model_dir, entropy_coeff=1.0, lr=1e-4)
    samples = [_sample(trainer, demo_tokenizer, "Hello", " there friend", 0.0, "a")]
    first = trainer.train_step(samples)
    assert first["num_optimizer_steps"] == 1 and first["num_samples_skipped_zero_adv"] == 0
    second = trainer.train_step(samples)
    assert second["entropy"] > first["entropy"]
    without = _trainer(tiny_model_dir).train_step(samples)
    assert without["num_optimizer_steps"] == 0


def test_gspo_trains_through_the_trainer(tiny_model_dir, demo_tokenizer):
    trainer = _trainer(tiny_model_dir, loss_mode="gspo", clip_ratio_low=3e-4, clip_ratio_high=4e-4, ppo_epochs=2)
    samples = [_sample(trainer, demo_tokenizer, "Hello", " there friend", 1.0, "a")]
    metrics = trainer.train_step(samples)
    assert metrics["num_optimizer_steps"] == 2
    # The first pass raised the sequence's logprobs, so in the second its ratio is above 1 + 4e-4: every token is
    # clipped there (half of all the tokens the two passes weighed).
    assert metrics["clip_fraction"] == pytest.approx(0.5)
    with pytest.raises(ValueError, match="loss_mode"):
        _trainer(tiny_model_dir, loss_mode="sapo")


def test_metrics_say_which_tokens_they_cover(tiny_model_dir, demo_tokenizer):
    trainer = _trainer(tiny_model_dir)
    moving = [_sample(trainer, demo_tokenizer, "Q: hi", " there friend", 1.0, "a")]
    still = [_sample(trainer, demo_tokenizer, "Q: yo", " hello pal", 0.0, "b")]
    n_moving, n_still = len(moving[0].response_ids), len(still[0].response_ids)
    # Old logprobs far below the policy's: every forwarded token's ratio is far above 1 + clip_high (clipped).
    for s in moving + still:
        s.old_logprobs = [x - 5.0 for x in s.old_logprobs]
    metrics = trainer.train_step(moving + still)
    assert metrics["num_samples_skipped_zero_adv"] == 1.0  # the zero-advantage sample is not forwarded...
    # ...but its tokens carry a loss weight and cannot be clipped (A = 0): they count as unclipped.
    assert metrics["clip_fraction"] == pytest.approx(n_moving / (n_moving + n_still))
    assert metrics["forwarded_token_fraction"] == pytest.approx(n_moving / (n_moving + n_still))
    assert metrics["ratio_mean"] > 100  # over the forwarded tokens only


def test_old_logprobs_from_the_trainer_and_truncated_is(tiny_model_dir, demo_tokenizer):
    import math

    engine_view = _trainer(tiny_model_dir)
    samples = [_sample(engine_view, demo_tokenizer, "Hello", " there friend", 1.0, "a"),
               _sample(engine_view, demo_tokenizer, "Bye", " now", -1.0, "b")]
    for s in samples:  # an engine 0.3 nats more confident than the trainer on every token: d = -0.3
        s.old_logprobs = [x + 0.3 for x in s.old_logprobs]
    k3 = math.exp(-0.3) - 1 + 0.3  # 0.0408182

    engine = _trainer(tiny_model_dir).train_step([dataclasses.replace(s) for s in samples])
    assert engine["logprob_abs_diff_mean"] == pytest.approx(0.3, abs=LOGPROB_ATOL)
    assert engine["kl_engine_trainer_k3"] == pytest.approx(k3, abs=LOGPROB_ATOL)
    assert engine["clip_fraction"] > 0  # ratio exp(-0.3) = 0.74 is outside [0.8, 1.28]

    trainer = _trainer(tiny_model_dir, old_logprobs="trainer", rollout_is_cap=2.0)
    metrics = trainer.train_step(samples)
    assert metrics["logprob_abs_diff_mean"] == pytest.approx(0.3, abs=LOGPROB_ATOL)  # measured on every sample
    assert metrics["kl_engine_trainer_k3"] == pytest.approx(k3, abs=LOGPROB_ATOL)
    assert metrics["clip_fraction"] == 0.0 and metrics["ratio_mean"] == pytest.approx(1.0, abs=LOGPROB_ATOL)
    assert metrics["is_weight_mean"] == pytest.approx(math.exp(-0.3), abs=LOGPROB_ATOL)
    assert samples[0].trainer_logprobs is not None and samples[0].engine_logprobs is None  # originals untouched
    with pytest.raises(ValueError, match="rollout_is_cap needs old_logprobs='trainer'"):
        _trainer(tiny_model_dir, rollout_is_cap=2.0)


def test_gradient_checkpointing_gives_the_same_step(tiny_model_dir, demo_tokenizer, tmp_path):
    plain, checkpointed = _trainer(tiny_model_dir), _trainer(tiny_model_dir, gradient_checkpointing=True)
    samples = [_sample(plain, demo_tokenizer, "Hello", " there friend", 1.0, "a"),
               _sample(plain, demo_tokenizer, "Bye", " go away now", -1.0, "b")]
    plain.forward_backward(samples)
    checkpointed.model.train(True)
    checkpointed.forward_backward(samples)
    for (name, p), q in zip(plain.model.named_parameters(), checkpointed.model.parameters()):
        assert_close_normwise(q.grad, p.grad, what=name)
    m1, m2 = plain.train_step(samples), checkpointed.train_step(samples)
    assert m2["logprob_abs_diff_mean"] == pytest.approx(m1["logprob_abs_diff_mean"], abs=LOGPROB_ATOL)
    assert checkpointed.model.is_gradient_checkpointing
    # Checkpointing really keeps fewer activations for the backward pass: count the bytes autograd saves.
    def saved_bytes(trainer):
        total = [0]

        def pack(t):
            total[0] += t.numel() * t.element_size()
            return t

        trainer.compute_logprobs(samples[0].prompt_ids, samples[0].response_ids, 1.0)  # leaves eval mode on
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            trainer.train_step(samples)  # must switch to train mode itself for checkpointing to act
        return total[0]

    # In this tiny model the LM head's vocabulary-sized tensors dominate; the decoder layers' share goes.
    assert saved_bytes(checkpointed) < 0.97 * saved_bytes(plain)

    from transformers import AutoConfig
    import shutil

    dropout_dir = tmp_path / "dropout"
    shutil.copytree(tiny_model_dir, dropout_dir)
    config = AutoConfig.from_pretrained(dropout_dir)
    config.attention_dropout = 0.1
    config.save_pretrained(dropout_dir)
    with pytest.raises(ValueError, match="attention_dropout=0.1"):
        _trainer(dropout_dir, gradient_checkpointing=True)


def test_chunked_head_gives_the_plain_paths_logprobs_entropy_and_gradients(tiny_model_dir, demo_tokenizer):
    """astuner/trainer/fused_head.py (the CUDA default) against the plain R x V path, fp32, temperatures != 1, small chunks
    so that several chunks run; the tied head's gradient reaches the embedding through both."""
    from astuner.trainer import fused_head

    results = []
    for chunked in (False, True):
        t = _trainer(tiny_model_dir)
        t.head.chunked = chunked
        samples = [_sample(t, demo_tokenizer, "Hi there", " general kenobi, you are a bold one", 1.0, "a", 0.7),
                   _sample(t, demo_tokenizer, "Hello", " there friend", -1.0, "b", 1.3)]
        old = fused_head.CHUNK_ROWS
        fused_head.CHUNK_ROWS = 3
        try:
            t.model.zero_grad()
            logprobs, entropy, _ = t.forward_logprobs(samples, with_entropy=True)
            (logprobs * torch.linspace(-1, 1, len(logprobs))).sum().backward()
        finally:
            fused_head.CHUNK_ROWS = old
        grads = {n: p.grad.clone() for n, p in t.model.named_parameters() if p.grad is not None}
        results.append((logprobs.detach(), entropy.detach(), grads))
    (lp_a, ent_a, g_a), (lp_b, ent_b, g_b) = results
    assert_close_normwise(lp_b, lp_a, what="logprobs")
    assert_close_normwise(ent_b, ent_a, what="entropy")
    assert set(g_a) == set(g_b) and "model.embed_tokens.weight" in g_b
    for name in g_a:
        assert_close_normwise(g_b[name], g_a[name], what=name)


def test_train_returns_the_trainer_logprobs_and_leaves_the_samples_alone(tiny_model_dir, demo_tokenizer):
    from astuner.algorithm.objectives import PolicyGradient
    from astuner.trainer.settings import TrainerSettings

    trainer = Trainer(str(tiny_model_dir), TrainerSettings(lr=1e-3, loss_agg_mode="token-mean", device="cpu"))
    samples = [_sample(trainer, demo_tokenizer, "Hello", " there", 1.0, "a"),
               _sample(trainer, demo_tokenizer, "Bye", " now", 0.0, "b")]
    result = trainer.train(samples, PolicyGradient(clip_low=0.2, clip_high=0.28))
    assert result.trainer_logprobs[0] == pytest.approx(samples[0].old_logprobs, abs=LOGPROB_ATOL)
    assert result.trainer_logprobs[1] is None  # advantage 0: never forwarded
    assert all(s.trainer_logprobs is None for s in samples)
    assert result.metrics["num_optimizer_steps"] == 1 and "policy_loss" in result.metrics
    with pytest.raises(ValueError, match="unknown objective 'ppo'"):
        trainer.train(samples, "ppo")
