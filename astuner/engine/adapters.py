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

from typing import Iterable

import torch

from astuner.engine.hf_engine import HFEngine
from astuner.trainer.lora import ADAPTER_NAME, is_lora_param, lora_config
from astuner.types import GenerateResult, SamplingParams, SyncReport


class AdapterHFEngine(HFEngine):
    """The HF engine with one LoRA adapter per model over one base; `adapters`: {model name: LoraSettings}."""

    def __init__(self, model_path: str, adapters: dict, **kwargs) -> None:
        from peft import get_peft_model

        super().__init__(model_path, **kwargs)
        self.adapters = dict(adapters)
        peft = None
        for name, lora in self.adapters.items():
            config = lora_config(lora, dropout=0.0)  # the engine never trains
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
            self._scored = None  # prompt_logprobs reuses nothing computed under another adapter
            for i, result in zip(rows, super()._decode([requests[i] for i in rows])):
                results[i] = result
        return results  # type: ignore[return-value]

    def load_adapter(self, name: str, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> SyncReport:
        """Copy one adapter's tensors (the trainer's names) into the engine, then verify it serves them all."""
        own = {n: p for n, p in self.model.named_parameters() if is_lora_param(n) and f".{name}." in n}

        def renamed():
            for trainer_name, tensor in named_tensors:
                target = trainer_name.replace(f".{ADAPTER_NAME}.", f".{name}.")
                if target not in own:
                    raise KeyError(f"adapter {name!r} has no parameter {target!r} (the trainer's {trainer_name!r}): "
                                   "its LoRA settings differ from the engine's")
                yield target, tensor

        return self._load_verified(renamed(), own, every=f"the sync of adapter {name!r}")


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
