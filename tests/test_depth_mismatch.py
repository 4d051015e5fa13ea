"""The engine-trainer logprob gap by context depth (algorithm/mismatch.py): binned by hand, measured by the trainer
on both old-logprob paths, and the alarm that fires on a mismatch only deep positions carry."""

from __future__ import annotations

import dataclasses
import logging

import pytest

from astuner.algorithm.mismatch import depth_alarm, depth_metrics, depth_sums
from astuner.monitor.metrics import pipeline_metrics, warn_pipeline
from astuner.trainer import Trainer
from astuner.types import Sample
from tolerances import LOGPROB_ATOL


def test_depth_bins_by_hand():
    # Positions 1022..1025: two tokens in 0-1k, two in 1k-4k; the third token is masked out.
    s = Sample(list(range(1022)), [5, 6, 7, 8], [-1.0, -1.0, -1.0, -1.0], 1.0, 1.0, "a", loss_mask=[1, 1, 0, 1])
    sums = depth_sums([s, s], [[-1.1, -0.95, -9.0, -1.5], None])  # the second copy was not forwarded here
    assert sums["depth_abs/0-1k"] == pytest.approx(0.15) and sums["depth_tokens/0-1k"] == 2
    assert sums["depth_abs/1k-4k"] == pytest.approx(0.5) and sums["depth_tokens/1k-4k"] == 1
    m = depth_metrics(sums)
    assert m == pytest.approx({"logprob_abs_diff/depth_0-1k": 0.075, "logprob_abs_diff/depth_1k-4k": 0.5})
    assert depth_alarm(m, "fp32") == ["1k-4k"]  # 0.5 > 8 eps(fp32) and > 4 x 0.075
    assert depth_alarm(m, "bf16") == ["1k-4k"]  # 0.5 > 8 eps(bf16) = 0.0625
    assert depth_alarm({**m, "logprob_abs_diff/depth_1k-4k": 0.25}, "fp32") == []  # under 4x the shallow bin
    assert depth_alarm({"logprob_abs_diff/depth_0-1k": 1e-8, "logprob_abs_diff/depth_4k-16k": 5e-2}, "bf16") == []
    # Two bins deeper, rounding alone may grow 4x: 8x is the alarm's.
    two_deeper = {"logprob_abs_diff/depth_0-1k": 0.01, "logprob_abs_diff/depth_4k-16k": 0.07}
    assert depth_alarm(two_deeper, "bf16") == []
    assert depth_alarm({**two_deeper, "logprob_abs_diff/depth_4k-16k": 0.09}, "bf16") == ["4k-16k"]


def _trainer(model_dir, **overrides) -> Trainer:
    kwargs = dict(lr=1e-3, weight_decay=0.0, lr_warmup_steps=0, grad_clip=None, clip_ratio_low=0.2,
                  clip_ratio_high=0.28, use_kl_loss=False, kl_loss_coef=0.0, kl_loss_type="k3",
                  loss_agg_mode="token-mean", norm_length=16, max_token_len_per_micro_batch=4096, mini_batch_num=1,
                  device="cpu")
    return Trainer(str(model_dir), **{**kwargs, **overrides})


@pytest.mark.parametrize("old_logprobs", ["engine", "trainer"])
def test_a_mismatch_only_deep_positions_carry_fires_the_alarm(tiny_model_dir, demo_tokenizer, caplog,
                                                               old_logprobs):
    trainer = _trainer(tiny_model_dir, old_logprobs=old_logprobs)
    ids = demo_tokenizer("word " * 1100, add_special_tokens=False)["input_ids"]
    prompt, response = ids[:1000], ids[1000:1060]  # response positions 1000..1059
    assert len(response) == 60
    exact = trainer.compute_logprobs(prompt, response, 1.0)
    # An engine that agrees with the trainer up to position 1023 and is 0.01 nats off from 1024 on.
    engine = [x + (0.01 if len(prompt) + k >= 1024 else 0.0) for k, x in enumerate(exact)]
    sample = Sample(prompt, response, engine, 1.0, 1.0, "a")
    metrics = trainer.train_step([dataclasses.replace(sample)])
    assert metrics["logprob_abs_diff/depth_0-1k"] < LOGPROB_ATOL
    assert metrics["logprob_abs_diff/depth_1k-4k"] == pytest.approx(0.01, abs=LOGPROB_ATOL)
    assert metrics["logprob_abs_diff/depth_alarm"] == 1.0

    rollout = pipeline_metrics([], metrics)
    assert rollout["rollout/logprob_abs_diff/depth_1k-4k"] == metrics["logprob_abs_diff/depth_1k-4k"]
    with caplog.at_level(logging.WARNING):
        warn_pipeline(7, rollout)
    assert "step 7: engine and trainer logprobs drift apart with context depth" in caplog.text
    assert "1k-4k 0.01" in caplog.text

    # The same gap at every depth is no drift: the mean's own warning covers it, not this alarm.
    even = Sample(prompt, response, [x + 0.01 for x in exact], 1.0, 1.0, "b")
    assert _trainer(tiny_model_dir, old_logprobs=old_logprobs).train_step([even])[
        "logprob_abs_diff/depth_alarm"] == 0.0
