"""Several LoRA adapters on one shared base in the HF engine: agents of several models for about one model's memory.

Models of a run that share the policy's base folder and train LoRA adapters (astuner.models entries with the
policy's path, both with a LoRA rank) are served by one `AdapterHFEngine`: the base weights once, one adapter per
model, injected with PEFT under the model's name. Each model sees it through an `AdapterView`, an ordinary
`InferenceEngine`: its requests run under its adapter, and its sync loads only its adapter's tensors (the trainer's
`trainer.lora.adapter_tensors`), verified by fingerprint as every sync is.

A batch the engine's worker drains may hold several models' requests: it decodes them one adapter at a time (the
adapter is swapped between groups). A request with a seed samples from its own generator, so its tokens do not
depend on which requests share its group.
"""

from __future__ import annotations

import time
from typing import Iterable

import torch

from astuner.engine.fingerprint import FingerprintBuilder, SyncMismatch, differences, fingerprint
from astuner.engine.hf_engine import HFEngine
from astuner.types import GenerateResult, SamplingParams, SyncReport

TRAINER_ADAPTER = ".default."  # the trainer's own adapter name inside its parameter names (trainer/lora.py)


class AdapterHFEngine(HFEngine):
    """The HF engine with one LoRA adapter per model over one base; `adapters`: {model name: LoraSettings}."""

    def __init__(self, model_path: str, adapters: dict, **kwargs) -> None:
        from peft import LoraConfig, get_peft_model

        super().__init__(model_path, **kwargs)
        self.adapters = dict(adapters)
        peft = None
        for name, lora in self.adapters.items():
            targets = lora.target_modules if isinstance(lora.target_modules, str) else list(lora.target_modules)
            config = LoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=0.0, target_modules=targets,
                                bias="none", task_type="CAUSAL_LM")
            if peft is None:
                peft = get_peft_model(self.model, config, adapter_name=name)  # injects into self.model in place
            else:
                peft.add_adapter(name, config)
        self.peft = peft
        self.model.eval()
        self.model.requires_grad_(False)

    def view(self, name: str) -> "AdapterView":
        if name not in self.adapters:
            raise KeyError(f"no adapter {name!r}; the adapters are {', '.join(self.adapters)}")
        return AdapterView(self, name)

    def _decode(self, requests) -> list[GenerateResult]:
        groups: dict[str | None, list[int]] = {}
        for i, r in enumerate(requests):
            groups.setdefault(r.adapter, []).append(i)
        results: list[GenerateResult | None] = [None] * len(requests)
        for name, rows in groups.items():
            if name not in self.adapters:
                raise KeyError(f"a request for adapter {name!r}; the adapters are {', '.join(self.adapters)}")
            self.peft.set_adapter(name)
            for i, result in zip(rows, super()._decode([requests[i] for i in rows])):
                results[i] = result
        return results  # type: ignore[return-value]

    def load_adapter(self, name: str, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> SyncReport:
        """Copy one adapter's tensors (the trainer's names) into the engine, then verify it serves them."""
        own = {n: p for n, p in self.model.named_parameters() if f".{name}." in n and (".lora_A." in n or
                                                                                   ".lora_B." in n)}
        sent, verify_s, seen = FingerprintBuilder(), 0.0, set()
        with self._model_lock, torch.no_grad():
            for trainer_name, tensor in named_tensors:
                target = trainer_name.replace(TRAINER_ADAPTER, f".{name}.")
                if target not in own:
                    raise KeyError(f"adapter {name!r} has no parameter {target!r} (the trainer's {trainer_name!r}): "
                                   "its LoRA settings differ from the engine's")
                value = tensor.to(own[target].device, own[target].dtype)
                t0 = time.perf_counter()
                sent.add(target, value)
                verify_s += time.perf_counter() - t0
                own[target].copy_(value)
                seen.add(target)
            t0 = time.perf_counter()
            problems = differences(sent.result(), fingerprint((n, own[n]) for n in seen))
            verify_s += time.perf_counter() - t0
        missing = sorted(set(own) - seen)
        if missing:
            raise KeyError(f"the sync of adapter {name!r} left {len(missing)} of its tensors out, e.g. {missing[0]}")
        if problems:
            raise SyncMismatch("hf", problems)
        self.last_sync = SyncReport(verified=1.0, verify_s=verify_s)
        return self.last_sync


class AdapterView:
    """One model of an `AdapterHFEngine` as an `InferenceEngine` (engine/base.py)."""

    def __init__(self, engine: AdapterHFEngine, name: str) -> None:
        self.engine, self.name = engine, name

    async def generate(self, prompt_ids: list[int], sampling: SamplingParams,
                       request_id: str | None = None) -> GenerateResult:
        return await self.engine.generate(prompt_ids, sampling, request_id, adapter=self.name)

    def abort(self, request_id: str) -> None:
        self.engine.abort(request_id)

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> SyncReport:
        """The model's adapter tensors (`trainer.lora.adapter_tensors`), not merged weights."""
        return self.engine.load_adapter(self.name, named_tensors)

    @property
    def last_sync(self) -> SyncReport:
        return self.engine.last_sync

    def sleep(self) -> None:
        self.engine.sleep()

    def shutdown(self) -> None:
        self.engine.shutdown()  # the shared engine's; a second call does nothing
