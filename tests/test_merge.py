"""multi_turn.sample_mode=merge: joined samples, masks, the merge ratio, and the same loss and gradient as
per_call on the tiny random Llama."""

from __future__ import annotations

import pytest
from test_trainer import _grads, _trainer
from tolerances import LOGPROB_ATOL, assert_close_normwise, assert_scalar_close

from astuner.algorithm.samples import episodes_to_samples, merge_ratio
from astuner.types import Episode, LLMCall, Task


def _call(prompt, response, agent="", trainable=True):
    return LLMCall(list(prompt), list(response), [-0.5 - 0.01 * i for i in range(len(response))], "stop", 1.0,
                   agent=agent, trainable=trainable)


def _episode(uid, calls, reward):
    return Episode(Task("t", "q"), 0, uid, calls=calls, reward=reward)


P1, R1, X1, R2, X2, R3 = [5, 17, 300], [42, 9, 2], [11, 12], [77, 3], [13], [8, 1200, 2]


def _three_turns(uid="a", reward=1.0):
    p2 = P1 + R1 + X1
    p3 = p2 + R2 + X2
    return _episode(uid, [_call(P1, R1), _call(p2, R2), _call(p3, R3)], reward)


def _samples(episodes, mode, k=8):
    return episodes_to_samples(episodes, adv_estimator="grpo", norm_by_std=False, epsilon=1e-6,
                               max_sample_per_task=k, sample_mode=mode)


def test_merge_joins_extending_calls_with_a_mask():
    episodes = [_three_turns("a", 1.0), _three_turns("b", 0.0)]
    per_call, merged = _samples(episodes, "per_call"), _samples(episodes, "merge")
    assert len(per_call) == 6 and len(merged) == 2
    s = merged[0]
    assert s.prompt_ids == P1
    assert s.response_ids == R1 + X1 + R2 + X2 + R3
    assert s.loss_mask == [1] * 3 + [0] * 2 + [1] * 2 + [0] + [1] * 3
    assert s.num_trained_tokens == len(R1 + R2 + R3)
    assert [lp for lp, m in zip(s.old_logprobs, s.loss_mask) if m] == [
        lp for c in episodes[0].calls for lp in c.response_logprobs]
    assert merge_ratio(episodes) == pytest.approx(4 / 6)


def test_calls_that_do_not_extend_stay_separate_and_agents_merge_on_their_own():
    rewritten = _episode("a", [_call(P1, R1), _call([5, 99] + R1 + X1, R2)], 1.0)  # history changed
    assert len(_samples([rewritten], "merge")) == 2
    # Two agents interleaved: each agent's conversation merges; the untrained one never becomes a sample.
    calls = [_call(P1, R1, "solver"), _call([7, 7], [4], "critic"), _call(P1 + R1 + X1, R2, "solver"),
             _call([7, 7, 4, 6], [5], "critic", trainable=False)]
    merged = _samples([_episode("m", calls, 1.0)], "merge")
    assert [s.response_ids for s in merged] == [R1 + X1 + R2, [4]]
    assert merge_ratio([_episode("m", calls, 1.0)]) == pytest.approx(1 / 3)


@pytest.mark.parametrize("agg", ["episode-mean-token-mean", "token-mean"])
def test_merge_gives_the_same_loss_and_gradient(tiny_model_dir, agg):
    episodes = [_three_turns("a", 1.0), _three_turns("b", 0.0)]
    results = {}
    for mode in ("per_call", "merge"):
        trainer = _trainer(tiny_model_dir, loss_agg_mode=agg)
        samples = _samples(episodes, mode)
        # old logprobs from the trainer itself, per call, so the ratio is 1 in both modes
        for s in samples:
            full = trainer.compute_logprobs(s.prompt_ids, s.response_ids, 1.0)
            s.old_logprobs = [lp if m else 0.0 for lp, m in zip(full, s.loss_mask or [1] * len(full))]
        trainer.optimizer.zero_grad(set_to_none=True)
        sums = trainer.forward_backward(samples)
        results[mode] = (sums, _grads(trainer), len(samples))
    (a, ga, na), (b, gb, nb) = results["per_call"], results["merge"]
    assert (na, nb) == (6, 2)
    assert_scalar_close(a["loss"], b["loss"], scale=1.0, what="loss")  # |advantage| <= 1 per token
    assert a["response_tokens"] == b["response_tokens"] == 2 * len(R1 + R2 + R3)
    assert a["logprob_abs_diff"] == pytest.approx(0.0, abs=LOGPROB_ATOL * a["response_tokens"])  # a token sum
    # The two episodes share their tokens and their advantages cancel, so the gradient is a difference of equal
    # terms: rounding is measured against the gradient of the terms' magnitudes (|advantage|).
    trainer = _trainer(tiny_model_dir, loss_agg_mode=agg)
    magnitudes = _samples(episodes, "per_call")
    for s in magnitudes:
        full = trainer.compute_logprobs(s.prompt_ids, s.response_ids, 1.0)
        s.old_logprobs, s.advantage = full, abs(s.advantage)
    trainer.forward_backward(magnitudes)
    scale = _grads(trainer)
    for name in ga:
        assert_close_normwise(gb[name], ga[name], what=name, scale=scale[name].norm().item())
    assert b["train_tokens"] < a["train_tokens"]  # fewer tokens forwarded for the same gradient


def test_pipeline_metrics_and_their_warning(caplog):
    from astuner.monitor import pipeline_metrics, warn_pipeline

    ok = _call(P1, R1, agent="solver")
    ok.tool_call_attempted = True
    broken = _call(P1 + R1 + X1, R2, agent="solver")
    broken.tool_call_attempted = broken.tool_call_parse_failed = broken.extends_previous = True
    critic = _call([7], [4, 5], agent="critic", trainable=False)
    metrics = pipeline_metrics([_episode("a", [ok, broken, critic], 1.0)], {"logprob_abs_diff_mean": 0.2})
    assert metrics["rollout/tool_call_parse_failure_rate"] == 0.5  # 1 of the 2 calls that tried a tool call
    assert metrics["rollout/prefix_reuse_rate"] == pytest.approx(1 / 3)
    assert metrics["rollout/merge_ratio"] == 0.5  # the critic's untrained call does not count
    assert metrics["rollout/logprob_abs_diff_mean"] == 0.2
    assert metrics["agent/solver/calls_per_episode"] == 2 and metrics["agent/critic/response_length"] == 2
    with caplog.at_level("WARNING"):
        warn_pipeline(3, metrics)
    text = caplog.text
    assert "tool_call_parse_failure_rate" in text and "logprob_abs_diff_mean" in text and "step 3" in text


@pytest.mark.parametrize("objective", ["policy", "sft"])
def test_the_lm_head_runs_on_the_trained_tokens_alone_for_the_same_loss_and_gradient(tiny_model_dir, monkeypatch,
                                                                                     objective):
    """A merged sample's tool outputs carry no loss: `trained_only` (the training step's forward) applies the LM
    head to the trained tokens alone. Same loss and gradient as the head over every response token, with the KL
    loss's reference and the entropy's gradient on the same rows."""
    from astuner.trainer import forward

    seen = []  # rows through the LM head
    head = forward.head_logits
    monkeypatch.setattr(forward, "head_logits", lambda model, hidden: seen.append(len(hidden)) or head(model, hidden))
    results = {}
    for trained_only in (False, True):
        trainer = _trainer(tiny_model_dir, use_kl_loss=True, kl_loss_coef=0.1, entropy_coeff=0.01)
        samples = _samples([_three_turns("a", 1.0)], "merge") + _samples([_episode("b", [_call([7, 8], [40, 41])],
                                                                                     0.0)], "merge")
        for s, advantage in zip(samples, (1.0, 0.5)):  # no two terms cancel
            full = trainer.compute_logprobs(s.prompt_ids, s.response_ids, 1.0)
            s.old_logprobs = [lp - 0.1 if m else 0.0 for lp, m in zip(full, s.loss_mask or [1] * len(full))]
            s.advantage = advantage
        seen.clear()
        trainer.optimizer.zero_grad(set_to_none=True)
        sums = trainer.forward_backward(samples, objective, trained_only=trained_only)
        results[trained_only] = (sums, _grads(trainer), sum(seen))
    (a, ga, rows_a), (b, gb, rows_b) = results[False], results[True]
    trained, response = len(R1 + R2 + R3) + 2, len(R1 + X1 + R2 + X2 + R3) + 2
    heads = 2 if objective == "policy" else 1  # the policy's forward and the reference's
    assert (rows_a, rows_b) == (heads * response, heads * trained)
    assert a["response_tokens"] == b["response_tokens"] == trained
    assert_scalar_close(a["loss"], b["loss"], scale=abs(a["loss"]) + 1.0, what="loss")
    for name in ga:
        assert_close_normwise(gb[name], ga[name], what=name, scale=ga[name].norm().item())
