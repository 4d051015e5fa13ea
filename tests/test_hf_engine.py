"""HF engine: exact sampling logprobs, batching of concurrent requests, stop/length, weight loading."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch
from transformers import AutoModelForCausalLM

from astuner.engine.hf_engine import HFEngine, _Request
from astuner.types import SamplingParams
from tolerances import LOGPROB_ATOL


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    eng = HFEngine(str(tiny_model_dir), seed=0, pad_token_id=0)
    yield eng
    eng.shutdown()


def full_forward_logprobs(model, prompt, response, temperature):
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1 : -1] / (temperature if temperature > 0 else 1.0)
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(response)[:, None]).squeeze(-1)


def test_logprobs_match_full_forward_with_left_padding(engine, tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    prompts = [[5, 6, 7, 8, 9, 10, 11], [12, 13], [14, 15, 16, 17]]  # different lengths: left padding in play
    results = engine.generate_batch(prompts, SamplingParams(temperature=0.7, max_tokens=12))
    for prompt, res in zip(prompts, results):
        assert len(res.token_ids) == len(res.logprobs) == 12 and res.finish_reason == "length"
        expected = full_forward_logprobs(model, prompt, res.token_ids, 0.7)
        assert torch.allclose(torch.tensor(res.logprobs), expected, atol=LOGPROB_ATOL, rtol=0)


def test_greedy_is_argmax_and_deterministic(engine):
    a = engine.generate_batch([[3, 4, 5]], SamplingParams(temperature=0.0, max_tokens=6))[0]
    b = engine.generate_batch([[3, 4, 5], [9, 9]], SamplingParams(temperature=0.0, max_tokens=6))[0]
    assert a.token_ids == b.token_ids  # batch composition does not change a greedy answer


def test_stop_token_ends_generation(engine):
    greedy = engine.generate_batch([[3, 4, 5]], SamplingParams(temperature=0.0, max_tokens=6))[0]
    stop = greedy.token_ids[2]
    res = engine.generate_batch([[3, 4, 5]], SamplingParams(temperature=0.0, max_tokens=6, stop_token_ids=(stop,)))[0]
    assert res.finish_reason == "stop"
    assert res.token_ids[-1] == stop and len(res.token_ids) == greedy.token_ids.index(stop) + 1


def test_concurrent_requests_are_batched(tiny_model_dir):
    eng = HFEngine(str(tiny_model_dir), seed=0, pad_token_id=0, batch_window_s=0.05)
    calls = []
    original = eng._decode
    eng._decode = lambda requests: calls.append(len(requests)) or original(requests)

    async def main():
        return await asyncio.gather(*[eng.generate([3, 4, i + 5], SamplingParams(1.0, max_tokens=4)) for i in range(8)])

    results = asyncio.run(main())
    eng.shutdown()
    assert len(results) == 8 and all(len(r.token_ids) == 4 for r in results)
    assert calls and max(calls) > 1  # at least some requests shared a forward pass


def test_load_weights_changes_the_policy(engine, tiny_model_dir):
    before = engine.generate_batch([[3, 4, 5]], SamplingParams(temperature=0.0, max_tokens=5))[0]
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(-1.0)
    engine.load_weights(model.named_parameters())
    after = engine.generate_batch([[3, 4, 5]], SamplingParams(temperature=0.0, max_tokens=5))[0]
    assert after.logprobs != before.logprobs
    expected = full_forward_logprobs(model.eval(), [3, 4, 5], after.token_ids, 0.0)
    assert torch.allclose(torch.tensor(after.logprobs), expected, atol=LOGPROB_ATOL, rtol=0)
    with pytest.raises(KeyError):
        engine.load_weights([("no.such.weight", torch.zeros(1))])
    engine.load_weights(AutoModelForCausalLM.from_pretrained(tiny_model_dir).named_parameters())  # restore


@pytest.mark.slow
def test_sampling_frequencies_match_the_tempered_softmax(engine):
    # 4000 one-token draws from the same prompt at temperature 2: frequencies of the likeliest tokens against
    # softmax(logits / 2) of the model's own forward (binomial std at p=0.05 over 4000 draws is ~0.0035).

    prompt = [3, 4, 5, 6]
    with torch.no_grad():
        logits = engine.model(input_ids=torch.tensor([prompt])).logits[0, -1]
    probs = torch.softmax(logits / 2.0, -1)
    results = engine.generate_batch([prompt] * 4000, SamplingParams(2.0, max_tokens=1))
    counts = torch.bincount(torch.tensor([r.token_ids[0] for r in results]), minlength=probs.numel()).double() / 4000
    top = probs.topk(5).indices
    assert torch.allclose(counts[top], probs[top].double(), atol=0.015), (counts[top], probs[top])
    # The recorded logprob is that of the tempered distribution the token was drawn from.
    token = results[0].token_ids[0]
    assert results[0].logprobs[0] == pytest.approx(torch.log(probs[token]).item(), abs=LOGPROB_ATOL)


def test_a_seeded_request_samples_the_same_tokens_whatever_its_batch(engine):
    prompt = [7, 8, 9]
    alone = engine._decode([_Request(prompt, SamplingParams(1.0, 12, (), seed=123))])[0]
    crowd = engine._decode([_Request([3 + i, 4, 5 + i], SamplingParams(1.0, 12, (), seed=i)) for i in range(5)]
                           + [_Request(prompt, SamplingParams(1.0, 12, (), seed=123))])[-1]
    assert alone.token_ids == crowd.token_ids
    other = engine._decode([_Request(prompt, SamplingParams(1.0, 12, (), seed=124))])[0]
    assert other.token_ids != alone.token_ids


def test_abort_cancels_a_pending_request(tiny_model_dir):
    eng = HFEngine(str(tiny_model_dir), seed=0, pad_token_id=0)

    async def main():
        job = asyncio.ensure_future(eng.generate([3, 4, 5], SamplingParams(1.0, max_tokens=2000), request_id="r1"))
        await asyncio.sleep(0.2)
        eng.abort("r1")
        with pytest.raises(asyncio.CancelledError):
            await job
        # The engine is free again at once: a later request completes.
        return await asyncio.wait_for(eng.generate([3, 4], SamplingParams(0.0, max_tokens=3)), 30)

    started = time.monotonic()
    assert len(asyncio.run(main()).token_ids) == 3
    assert time.monotonic() - started < 20
    eng.shutdown()
