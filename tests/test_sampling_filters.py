"""top_p / top_k end to end: the start-up logprob check samples and scores with the rollout's own filter, a run
with Qwen's recommended sampling trains with the engine's logprobs equal to the trainer's, and offline
objectives never apply the rollout's filter to dataset tokens."""

from __future__ import annotations

import json
import math

import pytest

from astuner.cli import main
from tolerances import LOGPROB_ATOL

QWEN_SAMPLING = ["astuner.rollout.top_p=0.8", "astuner.rollout.top_k=20", "astuner.rollout.temperature=0.7"]


def _train_rows(out):
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "rollout/logprob_abs_diff_mean" in r]


@pytest.mark.slow
def test_hf_run_with_top_p_and_top_k_trains_with_engine_equal_to_trainer(tmp_path, tiny_model_dir):
    from tests.test_debug_backbone import write_run

    yaml = write_run(tmp_path, tiny_model_dir)
    out = tmp_path / "out"
    # preflight strict (the default): the start-up logprob check must pass with the filter on.
    code = main(["--conf", str(yaml), f"astuner.experiment_dir={out}", *QWEN_SAMPLING])
    assert code == 0
    rows = _train_rows(out)
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        assert math.isfinite(row["rollout/logprob_abs_diff_mean"]) and row["rollout/logprob_abs_diff_mean"] < LOGPROB_ATOL
        assert math.isfinite(row["actor/policy_loss"])


def test_start_up_check_samples_with_the_rollouts_filter(tiny_model_dir, demo_tokenizer):
    """The check's engine side samples with top_k 2: every sampled token is one of the trainer's top 2, so the
    difference is finite and small; sampled without the filter (the old check), the trainer reads -inf."""
    from astuner.engine.hf_engine import HFEngine
    from astuner.model_tuner import ChatRenderer
    from astuner.model_tuner.pipeline_check import CheckSampling, engine_trainer_logprob_check
    from tests.test_trainer import _trainer

    engine = HFEngine(tiny_model_dir, max_batch_size=1, seed=0, pad_token_id=demo_tokenizer.pad_token_id)
    trainer = _trainer(tiny_model_dir, top_k=2, top_p=0.9)
    renderer = ChatRenderer(demo_tokenizer)
    stops = (demo_tokenizer.convert_tokens_to_ids("<|im_end|>"),)
    check = engine_trainer_logprob_check(engine, trainer, renderer, stops, CheckSampling(0.7, 0.9, 2))
    diff, n = check()
    assert n > 0 and diff < LOGPROB_ATOL
    unfiltered = engine_trainer_logprob_check(engine, trainer, renderer, stops, CheckSampling(0.7, 1.0, 0))
    assert unfiltered()[0] == math.inf  # the trainer's filter excludes tokens the engine sampled


def test_a_failed_logprob_check_names_the_logprobs_not_the_parser():
    from astuner.model_tuner.pipeline_check import CheckRow, _advice

    advice = _advice([CheckRow("logprobs", False, "engine vs trainer max |diff| inf")])
    assert "top_p" in advice and "tool_call_parser" not in advice
    assert "tool_call_parser" in _advice([CheckRow("tool parser", False, "")])


def _sft_loss(tmp_path, tiny_model_dir, overrides):
    from tests.test_offline import _config, _rows, _write

    from astuner.config import load_config
    from astuner.model_tuner import ChatRenderer
    from astuner.task_reader.offline_data import tokenize_conversation
    from astuner.config.derived import run_facts
    from astuner.runtime import load_tokenizer
    from astuner.trainer.build import build_trainer

    _write(tmp_path, "train.jsonl", _rows(2))
    _write(tmp_path, "val.jsonl", _rows(2))
    typed = load_config(_config(tmp_path, tiny_model_dir, "sft"), overrides).typed
    tokenizer = load_tokenizer(str(tiny_model_dir))
    trainer = build_trainer(typed, run_facts(typed).algorithm, str(tiny_model_dir), 1)
    renderer = ChatRenderer(tokenizer)
    samples = [tokenize_conversation(renderer, r["messages"], None, ("<|im_end|>",)).as_sample(str(i))
               for i, r in enumerate(_rows(2))]
    sums = trainer.forward(samples, "sft")
    return sums["nll"] / sums["response_tokens"]


def test_sft_ignores_the_rollouts_sampling_filter(tmp_path, tiny_model_dir):
    plain = _sft_loss(tmp_path, tiny_model_dir, [])
    filtered = _sft_loss(tmp_path, tiny_model_dir, ["astuner.rollout.top_k=5", "astuner.rollout.top_p=0.5"])
    assert math.isfinite(plain) and filtered == pytest.approx(plain, rel=1e-6)
