"""LoRA (PEFT) for the trainer: adapters on the policy, merged weights for the engine, adapter checkpoints, and
the export of a merged Hugging Face folder (`astuner export`).

A LoRA layer computes W x + (alpha / r) * B A x, with W frozen and only A (r x in) and B (out x r) trained, so
only the adapters have gradients and sit in the optimizer. The engine receives merged weights
    W' = W + (alpha / r) * B A
under the base model's own parameter names: vLLM (or the HF engine) then runs the plain architecture, with no
LoRA kernels in the sampling path. Every sync sends all weights (frozen ones included): vLLM's in-place reload
re-processes whole layers.

Names: PEFT injects its layers into the model in place, so the trainer's model keeps its HF parameter names except
for the wrapped linears: `...q_proj.base_layer.weight` (the frozen W) and `...q_proj.lora_A.default.weight`.
Checkpoints hold the adapter only (`adapter_model.safetensors`, `adapter_config.json` naming the base model).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Iterator

import torch
from torch import Tensor

from astuner.trainer.settings import LoraSettings

log = logging.getLogger(__name__)

ADAPTER_NAME = "default"


def lora_config(settings: LoraSettings, dropout: float | None = None):
    """PEFT's LoraConfig for `settings` (`dropout`: in place of the settings', e.g. 0 where nothing trains)."""
    from peft import LoraConfig

    targets = settings.target_modules
    return LoraConfig(r=settings.rank, lora_alpha=settings.alpha,
                      lora_dropout=settings.dropout if dropout is None else dropout,
                      target_modules=list(targets) if not isinstance(targets, str) else targets,
                      bias="none", task_type="CAUSAL_LM")


def apply_lora(model, settings: LoraSettings):
    """Inject LoRA layers into `model` (in place); returns the PEFT wrapper (for saving). Only adapters train."""
    from peft import get_peft_model

    try:
        return get_peft_model(model, lora_config(settings))
    except ValueError as exc:  # no module matched target_modules
        raise ValueError(f"trainer_common.lora.target_modules {settings.target_modules}: {exc}") from None


def adapter_tensors(model) -> Iterator[tuple[str, Tensor]]:
    """(name, detached tensor) of the LoRA adapter alone: what an engine serving it over a shared base loads
    (engine/adapters.py)."""
    return ((n, p.detach()) for n, p in model.named_parameters() if is_lora_param(n))


def share_frozen_weights(model, donor) -> int:
    """Point every frozen parameter of `model` (the base under its adapters) at `donor`'s parameter of the same
    name, so two LoRA trainers on one base hold it once; returns the bytes let go. Both must be the same base with
    adapters on the same modules (names and shapes are checked)."""
    def frozen(m):
        return {f"{mod}.{name}" if mod else name: (module, name, p) for mod, module in m.named_modules()
                for name, p in module._parameters.items() if p is not None and not p.requires_grad}

    mine, theirs = frozen(model), frozen(donor)
    if mine.keys() != theirs.keys():
        raise ValueError(f"the bases differ: {len(set(mine) ^ set(theirs))} frozen parameters are in one only")
    let_go: dict[int, int] = {}  # id -> bytes: a tied tensor (embedding and head) is let go once
    for name, (module, attr, p) in mine.items():
        other = theirs[name][2]
        if other is p:
            continue
        if other.shape != p.shape or other.dtype != p.dtype:
            raise ValueError(f"{name}: {tuple(p.shape)} {p.dtype} here, {tuple(other.shape)} {other.dtype} shared")
        module._parameters[attr] = other
        let_go[id(p)] = p.numel() * p.element_size()
    return sum(let_go.values())


def set_adapter_dropout(model, training: bool) -> None:
    """Dropout on the adapters' input on or off; the base model's modes are left as they are."""
    for name, module in model.named_modules():
        if ".lora_dropout." in f"{name}.":
            module.train(training)


def is_lora_param(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name or ".lora_embedding_" in name


def base_name(name: str) -> str:
    """The HF name of a (possibly wrapped) parameter: `...q_proj.base_layer.weight` -> `...q_proj.weight`."""
    return name.replace(".base_layer.", ".")


@torch.no_grad()
def merged_named_tensors(model) -> Iterator[tuple[str, Tensor]]:
    """(HF name, tensor) of the merged policy: W + (alpha/r) B A for wrapped linears, W for everything else."""
    from peft.tuners.lora import LoraLayer

    # Each delta is made when its weight is yielded and dropped with it: a sync streams one merged tensor at a
    # time into shared memory (engine/shared_weights.py), never every delta at once.
    layers = {f"{mod_name}.base_layer.weight": module for mod_name, module in model.named_modules()
              if isinstance(module, LoraLayer) and ADAPTER_NAME in module.lora_A}
    for name, param in model.named_parameters():
        if is_lora_param(name):
            continue
        tensor = param.detach()
        if name in layers:
            tensor = (tensor.float() + layers[name].get_delta_weight(ADAPTER_NAME).float()).to(tensor.dtype)
        yield base_name(name), tensor
        del tensor


def adapter_state_for_save(named: dict[str, Tensor]) -> dict[str, Tensor]:
    """Adapter tensors under the names PEFT writes to adapter_model.safetensors (no adapter name)."""
    return {f"base_model.model.{n.replace(f'.{ADAPTER_NAME}.', '.')}": t for n, t in named.items() if is_lora_param(n)}


def adapter_state_from_file(saved: dict[str, Tensor]) -> dict[str, Tensor]:
    """adapter_model.safetensors names -> the trainer model's parameter names."""
    out = {}
    for name, tensor in saved.items():
        name = name.removeprefix("base_model.model.")
        for part in ("lora_A", "lora_B"):
            name = name.replace(f".{part}.weight", f".{part}.{ADAPTER_NAME}.weight")
        out[name] = tensor
    return out


def is_adapter_checkpoint(path: Path) -> bool:
    return (Path(path) / "adapter_config.json").is_file()


def export_merged(checkpoint: Path, out: Path, base_model: str | None = None, dtype: str = "float32") -> Path:
    """Write a merged Hugging Face folder from a checkpoint: an adapter checkpoint is applied to its base model and
    merged; a full checkpoint is re-saved without astuner's resume state. Returns `out`."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    checkpoint, out = Path(checkpoint), Path(out)
    torch_dtype = getattr(torch, dtype)
    if is_adapter_checkpoint(checkpoint):
        from peft import PeftModel

        config = json.loads((checkpoint / "adapter_config.json").read_text())
        base = base_model or config.get("base_model_name_or_path")
        if not base or not (Path(base) / "config.json").is_file():
            raise FileNotFoundError(
                f"{checkpoint}: the base model {base!r} named in adapter_config.json is not a local model folder; "
                "give it with --base-model")
        model = AutoModelForCausalLM.from_pretrained(base, dtype=torch_dtype)
        model = PeftModel.from_pretrained(model, str(checkpoint)).merge_and_unload()
    else:
        if not (checkpoint / "config.json").is_file():
            raise FileNotFoundError(f"{checkpoint}: neither an adapter checkpoint (adapter_config.json) nor a model "
                                    "folder (config.json)")
        model = AutoModelForCausalLM.from_pretrained(str(checkpoint), dtype=torch_dtype)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    try:
        AutoTokenizer.from_pretrained(str(checkpoint)).save_pretrained(out)
    except Exception as exc:  # the checkpoint normally has one; say so if not
        log.warning("export: no tokenizer copied from %s (%s)", checkpoint, exc)
    return out
