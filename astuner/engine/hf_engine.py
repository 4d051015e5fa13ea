"""In-process Hugging Face engine: batches concurrent requests and samples with exact per-token logprobs.

Requests arrive from many episodes (asyncio tasks). A worker thread drains the queue, waits a few
milliseconds for stragglers, and decodes them together with a KV cache: left-padded prefill, then one token per
step for every live row. Finished rows are dropped from the batch (and the cache) so that one long answer does
not keep paying for the short ones.

Logprobs are log_softmax(logits / temperature) at the sampled token (over the top-k / top-p filtered
distribution when those are set), the same quantity the trainer computes, so the importance ratio starts at
exactly 1 after a weight sync.

Prefill computes logits at the last prompt position only (a full-prompt logits tensor is
batch x prompt x vocab floats: for 64 prompts of 3,000 tokens and a 150k vocab, over 100 GB). A request with a
`seed` samples from its own generator, so its tokens do not depend on which other requests share its batch (runs
and resumed runs reproduce); requests without one share the engine's seeded generator. `abort(request_id)` (or
cancelling the awaiting task) drops a request from the queue or from the batch being decoded.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Iterable

import torch

from astuner.algorithm.sampling_filter import filter_logits, is_filtered
from astuner.engine.fingerprint import FingerprintBuilder, SyncMismatch, differences, fingerprint
from astuner.step_plan import common_prefix
from astuner.types import GenerateResult, PromptLogprobs, SamplingParams, SyncReport

log = logging.getLogger(__name__)


@dataclass
class _Request:
    prompt_ids: list[int]
    sampling: SamplingParams
    future: asyncio.Future | None = None
    loop: asyncio.AbstractEventLoop | None = None
    request_id: str | None = None
    aborted: bool = False  # set from the event loop's thread, read by the worker: a plain bool is enough
    adapter: str | None = None  # the LoRA adapter it runs under (engine/adapters.py); None: the plain model


# A shorter common prefix is forwarded again rather than cropped out of the last call's cache.
REUSE_MIN_TOKENS = 16
# A larger cache is not kept past its call: memory no plan counts (a teacher's engine is never put to sleep).
REUSE_MAX_BYTES = 256 << 20


@dataclass
class _Scored:
    """A `prompt_logprobs` call: its tokens, their KV cache and what it returned. The next call reuses the first r
    tokens' cache and logprobs, r one short of the common prefix (the logits at r - 1 that predict the first token
    that differs are computed again from there), when r >= REUSE_MIN_TOKENS and the top-k asked is the same. Only
    for caches that keep every token (full attention): sliding-window and linear-attention layers are not cropped;
    and only up to REUSE_MAX_BYTES."""

    token_ids: list[int]
    cache: object
    result: PromptLogprobs
    topk: int

    @classmethod
    def score(cls, model, token_ids: list[int], topk: int, last: _Scored | None) -> _Scored:
        reuse = last.reusable(token_ids, topk) if last is not None else 0
        ids = torch.tensor([token_ids[reuse:]], device=model.device)
        if reuse:
            last.cache.crop(reuse - last.cache.get_seq_length())  # negative: tokens removed from the end
            out = model(input_ids=ids, past_key_values=last.cache, use_cache=True)
        else:
            out = model(input_ids=ids, use_cache=True)
        logp = torch.log_softmax(out.logits[0, :-1].float(), -1)  # row i predicts token reuse + i + 1
        values = logp.gather(-1, ids[0, 1:, None])[:, 0].cpu().tolist()
        pairs = None
        if topk > 0:
            top = logp.topk(min(topk, logp.shape[-1]), -1)
            pairs = [list(zip(i, v)) for i, v in zip(top.indices.cpu().tolist(), top.values.cpu().tolist())]
            pairs = last.result.topk[:reuse] + pairs if reuse else pairs
        values = last.result.values[:reuse] + values if reuse else values
        return cls(list(token_ids), out.past_key_values, PromptLogprobs(values, pairs), topk)

    def keep(self) -> _Scored | None:
        """Itself, when its cache can be cropped and reused and holds at most REUSE_MAX_BYTES."""
        from transformers.cache_utils import DynamicCache, DynamicLayer

        layers = self.cache.layers if isinstance(self.cache, DynamicCache) else []
        if not layers or any(type(layer) is not DynamicLayer for layer in layers):
            return None
        size = sum(t.numel() * t.element_size() for layer in layers for t in (layer.keys, layer.values))
        return self if size <= REUSE_MAX_BYTES else None

    def reusable(self, token_ids: list[int], topk: int) -> int:
        if topk != self.topk:
            return 0
        reuse = common_prefix(self.token_ids, token_ids) - 1
        return min(reuse, len(token_ids) - 1) if reuse >= REUSE_MIN_TOKENS else 0


class HFEngine:
    kind, honours_seed = "hf", True  # one seeded generator per request
    def __init__(
        self,
        model_path: str,
        *,
        max_batch_size: int = 64,
        device: str | None = None,
        seed: int = 0,
        batch_window_s: float = 0.01,
        pad_token_id: int = 0,
    ) -> None:
        from transformers import AutoModelForCausalLM

        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        self.device_type = self.device.type
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).to(self.device)
        self.model.eval()
        self.model.requires_grad_(False)
        self.max_batch_size = max_batch_size
        self.batch_window_s = batch_window_s
        self.pad_token_id = pad_token_id
        self._generator = torch.Generator(device=self.device).manual_seed(seed)
        self._queue: queue.Queue[_Request | None] = queue.Queue()
        self._model_lock = threading.Lock()  # weight loads never interleave with a decode step
        self._live: dict[str, _Request] = {}  # request_id -> request, for abort()
        self._worker: threading.Thread | None = None
        self._closed = False
        self.last_sync = SyncReport()  # the last weight sync's verification
        self._scored: _Scored | None = None  # the last prompt_logprobs call's, for the next one's shared prefix

    # ---------------------------------------------------------------- public API

    async def generate(
        self, prompt_ids: list[int], sampling: SamplingParams, request_id: str | None = None,
        adapter: str | None = None,
    ) -> GenerateResult:
        if self._closed:
            raise RuntimeError("engine is shut down")
        if sampling.max_tokens <= 0:
            return GenerateResult([], [], "length")
        self._ensure_worker()
        loop = asyncio.get_running_loop()
        request = _Request(list(prompt_ids), sampling, loop.create_future(), loop, request_id, adapter=adapter)
        if request_id is not None:
            self._live[request_id] = request
        self._queue.put(request)
        try:
            return await request.future
        finally:
            request.aborted = True  # done, failed or cancelled: the worker stops spending steps on it
            if request_id is not None:
                self._live.pop(request_id, None)

    def abort(self, request_id: str) -> None:
        """Stop a pending request: its awaiting caller gets CancelledError; unknown or finished ids are ignored."""
        request = self._live.pop(request_id, None)
        if request is not None:
            request.aborted = True
            request.loop.call_soon_threadsafe(_cancel, request.future)

    def generate_batch(self, prompts: list[list[int]], sampling: SamplingParams,
                       adapter: str | None = None) -> list[GenerateResult]:
        """Synchronous batch generation (benchmarks and tests): the raw engine, no queue."""
        results: list[GenerateResult] = []
        for start in range(0, len(prompts), self.max_batch_size):
            chunk = [_Request(list(p), sampling, adapter=adapter) for p in prompts[start : start + self.max_batch_size]]
            with self._model_lock:
                results += self._decode(chunk)
        return results

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> SyncReport:
        """Copy the tensors into the model, then verify it serves them (fingerprint.py): a mismatch raises."""
        return self._load_verified(named_tensors, dict(self.model.named_parameters()))

    def _load_verified(self, named_tensors: Iterable[tuple[str, torch.Tensor]], params: dict[str, torch.Tensor],
                       every: str | None = None) -> SyncReport:
        """Copy `named_tensors` into `params` (names as there), then compare the fingerprint of `params` with what
        was sent: a tensor not sent keeps its old value and is named. `every`: what the sync is, for a KeyError
        when it must send every one of `params` (an adapter's sync)."""
        sent, verify_s, seen = FingerprintBuilder(), 0.0, set()
        with self._model_lock, torch.no_grad():
            self._scored = None  # computed by the weights being replaced
            for name, tensor in named_tensors:
                if name not in params:
                    raise KeyError(f"engine model has no parameter {name!r}")
                value = tensor.to(params[name].device, params[name].dtype)
                t0 = time.perf_counter()
                sent.add(name, value)
                verify_s += time.perf_counter() - t0
                self._copy_in(name, params[name], value)
                seen.add(name)
            missing = sorted(set(params) - seen)
            if every is not None and missing:
                raise KeyError(f"{every} left {len(missing)} of its tensors out, e.g. {missing[0]}")
            t0 = time.perf_counter()
            problems = differences(sent.result(), fingerprint(params.items()))
            verify_s += time.perf_counter() - t0
        if problems:
            raise SyncMismatch("hf", problems)
        self.last_sync = SyncReport(verified=1.0, verify_s=verify_s)
        return self.last_sync

    def _copy_in(self, name: str, param: torch.Tensor, value: torch.Tensor) -> None:
        param.copy_(value)

    def base_weights(self) -> dict:
        return {n: p.detach().to("cpu", copy=True) for n, p in self.model.named_parameters()}

    def sleep(self) -> None:
        """Only the last scored sequence's cache to release (the weights serve the next rollout)."""
        with self._model_lock:
            self._scored = None

    def shutdown(self) -> None:
        self._closed = True
        if self._worker is not None:
            self._queue.put(None)
            self._worker.join(timeout=30)
            self._worker = None

    # ---------------------------------------------------------------- worker

    def _ensure_worker(self) -> None:
        if self._worker is None:
            self._worker = threading.Thread(target=self._serve, name="astuner-hf-engine", daemon=True)
            self._worker.start()

    def _serve(self) -> None:
        while True:
            first = self._queue.get()
            if first is None:
                return
            batch = [first]
            # Requests from concurrent episodes arrive a few ms apart (each renders its prompt first).
            while len(batch) < self.max_batch_size:
                try:
                    item = self._queue.get(timeout=self.batch_window_s)
                except queue.Empty:
                    break
                if item is None:
                    self._queue.put(None)
                    break
                batch.append(item)
            batch = [r for r in batch if not r.aborted]
            if not batch:
                continue
            try:
                with self._model_lock:
                    results = self._decode(batch)
            except BaseException as exc:  # surfaces in the awaiting episodes, never kills the worker
                log.exception("generation failed")
                for req in batch:
                    _deliver(req, None, exc)
            else:
                for req, res in zip(batch, results):
                    _deliver(req, res, None)

    @torch.no_grad()
    def _decode(self, requests: list[_Request]) -> list[GenerateResult]:
        """Decode `requests` together: a left-padded prefill, then one token per step for every live row, a row
        leaving the batch (and the cache) when it stops, reaches its max_tokens or is aborted."""
        samplings = [r.sampling for r in requests]
        n = len(requests)
        dev = self.device
        input_ids, attention, positions = _left_padded([r.prompt_ids for r in requests], self.pad_token_id, dev)

        temps = torch.tensor([s.temperature for s in samplings], dtype=torch.float32, device=dev)
        greedy = temps <= 0
        scale = torch.where(greedy, torch.ones_like(temps), temps)[:, None]
        max_new = [s.max_tokens for s in samplings]
        stops = [set(s.stop_token_ids) for s in samplings]
        generators = _request_generators(samplings, dev)

        out_ids: list[list[int]] = [[] for _ in range(n)]
        out_lp: list[list[float]] = [[] for _ in range(n)]
        reasons: list[str] = ["length"] * n
        alive = list(range(n))  # row i of the live batch is request alive[i]

        autocast = torch.autocast("cuda", dtype=torch.bfloat16) if dev.type == "cuda" else contextlib.nullcontext()
        cache, logits = self._forward(
            autocast, input_ids=input_ids, attention_mask=attention, position_ids=positions, use_cache=True,
            logits_to_keep=1,
        )
        next_pos = positions[:, -1] + 1

        for _ in range(max(max_new)):
            z = _filtered(logits / scale, [samplings[r] for r in alive])
            tokens, token_lp = self._sample(z, greedy, [generators[r] for r in alive])
            keep = _append_step(alive, tokens.tolist(), token_lp.tolist(), requests, stops, max_new,
                                out_ids, out_lp, reasons)
            if not keep:
                break
            if len(keep) < len(alive):
                index = torch.tensor(keep, device=dev)
                cache.batch_select_indices(index)
                attention, tokens, next_pos = attention[index], tokens[index], next_pos[index]
                greedy, scale = greedy[index], scale[index]
                alive = [alive[r] for r in keep]
            attention = torch.cat([attention, attention.new_ones((len(alive), 1))], dim=-1)
            cache, logits = self._forward(
                autocast,
                input_ids=tokens[:, None],
                attention_mask=attention,
                position_ids=next_pos[:, None],
                past_key_values=cache,
                use_cache=True,
            )
            next_pos = next_pos + 1

        return [GenerateResult(out_ids[i], out_lp[i], reasons[i]) for i in range(n)]  # type: ignore[arg-type]

    def prompt_logprobs(self, token_ids: list[int], topk: int = 0) -> PromptLogprobs:
        """One forward; of only the tokens after those it shares with the last call's sequence (`_Scored`)."""
        with self._model_lock, torch.no_grad():
            last, self._scored = self._scored, None  # a failed call leaves nothing to reuse
            scored = _Scored.score(self.model, token_ids, topk, last)
            self._scored = scored.keep()
        return scored.result

    def _forward(self, autocast, **inputs) -> tuple:
        """One forward of the model under `autocast`: (its KV cache, the float logits at the last position)."""
        with autocast:
            out = self.model(**inputs)
        return out.past_key_values, out.logits[:, -1, :].float()

    def _sample(self, z: torch.Tensor, greedy: torch.Tensor, generators: list) -> tuple[torch.Tensor, torch.Tensor]:
        """(tokens, their logprobs) from tempered logits z: argmax for greedy rows; for the others, inverse-CDF
        sampling of softmax(z) with one uniform per row (the row's own generator, or the shared one).

        One uniform per row instead of one per vocabulary entry: torch's CPU random generator and
        `torch.multinomial` cost more than the model's forward at small batch sizes. The CDF is summed in float64
        so that tokens at the end of a 150k vocabulary keep their probability.
        """
        lse = torch.logsumexp(z, dim=-1)
        tokens = z.argmax(dim=-1)
        rows = (~greedy).nonzero().squeeze(-1).tolist()
        if rows:
            index = torch.tensor(rows, device=z.device)
            cdf = torch.cumsum(torch.exp(z[index] - lse[index, None]).double(), dim=-1)
            shared = [i for i, r in enumerate(rows) if generators[r] is None]
            u = torch.empty(len(rows), dtype=torch.float64, device=z.device)
            if shared:
                u[shared] = torch.rand(len(shared), generator=self._generator, dtype=torch.float64, device=z.device)
            for i, r in enumerate(rows):
                if generators[r] is not None:
                    u[i] = torch.rand(1, generator=generators[r], dtype=torch.float64, device=z.device)[0]
            picked = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True).squeeze(-1)
            tokens[index] = picked.clamp_(max=z.shape[-1] - 1)
        return tokens, z.gather(-1, tokens[:, None]).squeeze(-1) - lse


def _left_padded(prompts: list[list[int]], pad_token_id: int, dev: torch.device):
    """(input_ids, attention mask, position ids) of the prompts, left-padded to the longest."""
    n = len(prompts)
    lengths = torch.tensor([len(p) for p in prompts], device=dev)
    width = int(lengths.max())
    input_ids = torch.full((n, width), pad_token_id, dtype=torch.long, device=dev)
    attention = torch.zeros((n, width), dtype=torch.long, device=dev)
    for i, p in enumerate(prompts):
        input_ids[i, width - len(p) :] = torch.tensor(p, device=dev)
        attention[i, width - len(p) :] = 1
    positions = (attention.cumsum(-1) - 1).clamp(min=0)
    return input_ids, attention, positions


def _request_generators(samplings: list[SamplingParams], dev: torch.device) -> list:
    """One generator per seeded request (torch.Generator on this device), None: the shared one."""
    return [
        None if s.seed is None else torch.Generator(device=dev).manual_seed(int(s.seed) % (2**63))
        for s in samplings
    ]


def _append_step(alive: list[int], tokens: list[int], logprobs: list[float], requests: list[_Request],
                 stops: list[set], max_new: list[int], out_ids: list[list[int]], out_lp: list[list[float]],
                 reasons: list[str]) -> list[int]:
    """Append each live row's sampled token and logprob to its request's answer (a stop token: reason "stop");
    the rows that go on: not stopped, under their max_tokens and not aborted."""
    keep: list[int] = []
    for row, req in enumerate(alive):
        tok = tokens[row]
        out_ids[req].append(tok)
        out_lp[req].append(logprobs[row])
        if tok in stops[req]:
            reasons[req] = "stop"
        elif len(out_ids[req]) < max_new[req] and not requests[req].aborted:
            keep.append(row)
    return keep


def _filtered(z, samplings: list[SamplingParams]):
    """Tempered logits with each sampled row's top-k / top-p applied (the logprobs are then the filtered
    distribution's, as the trainer and vLLM compute them)."""
    groups: dict[tuple[int, float], list[int]] = {}
    for row, s in enumerate(samplings):
        if s.temperature > 0 and is_filtered(s.top_k, s.top_p):
            groups.setdefault((s.top_k, s.top_p), []).append(row)
    for (top_k, top_p), rows in groups.items():
        index = torch.tensor(rows, device=z.device)
        z[index] = filter_logits(z[index], top_k, top_p)
    return z


def _deliver(request: _Request, result, exc) -> None:
    try:
        request.loop.call_soon_threadsafe(_resolve, request.future, result, exc)
    except RuntimeError:  # the caller's event loop is closed (its rollout ended): nobody waits for this result
        pass


def _cancel(future: asyncio.Future) -> None:
    if not future.done():
        future.cancel()


def _resolve(future: asyncio.Future, result, exc) -> None:
    if future.done():  # the episode was cancelled (timeout) meanwhile
        return
    if exc is not None:
        future.set_exception(exc)
    else:
        future.set_result(result)
