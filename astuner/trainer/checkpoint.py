"""Trainer checkpoints: an atomic Hugging Face folder (or, with LoRA, the adapter alone) plus the state an exact
resume needs (`RESUME_DIR/`: optimizer, optimizer step count, RNG states, the loop's run state).

Functions of the trainer rather than methods, to keep `trainer/core.py` about the update itself; they use only its
public surface (`state_dict`, `load_state_dict`, `model`, `peft`, `model_path`).
"""

from __future__ import annotations

import logging
import os
import shutil
import uuid
from pathlib import Path

import torch
from torch import Tensor

from astuner.trainer import fsdp
from astuner.trainer.lora import ADAPTER_NAME, adapter_state_for_save, adapter_state_from_file, is_lora_param
from astuner.resume import RESUME_DIR, read_run_state, write_run_state

log = logging.getLogger("astuner.trainer")


def save(trainer, path: Path, tokenizer=None, run_state: dict | None = None, write: bool = True) -> None:
    """Hugging Face folder at `path`; written to a hidden sibling first, then renamed into place.

    A sharded trainer (astuner/trainer/fsdp.py) gathers whole weights and optimizer state: every worker of the group calls
    this at once, and only the one with `write` writes.

    A run killed mid-save leaves at most a hidden `.NAME.tmp-*` folder, never a half-written `path`.
    The tokenizer (given, else loaded from model_path) is saved alongside so the folder is self-contained.
    With `run_state` (the loop's JSON-able state), `RESUME_DIR/` holds what `load_checkpoint` needs to continue
    exactly: optimizer state, optimizer step count, torch RNG states and the run state.
    """
    # Sharded, this gathers (every worker calls it); under bf16 the weights are the fp32 masters, so a resumed run
    # continues from the same numbers.
    full = trainer.state_dict(optimizer=run_state is not None and (write or trainer.sharded))
    state, optimizer = full["model"], full["optimizer"]
    if not write:
        return
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tag = f"{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp = path.parent / f".{path.name}.tmp-{tag}"
    try:
        _write_weights(trainer, tmp, state)
        _write_tokenizer(trainer, tmp, tokenizer, path)
        if run_state is not None:
            _write_resume_state(tmp, optimizer, full["optimizer_steps"], run_state)
        move_into_place(tmp, path, tag)
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        free = _free_bytes(path.parent) if isinstance(exc, (OSError, RuntimeError)) else None
        if free is not None and free < 256 * 2**20:
            # torch.save on a full disk says only "unexpected pos": name the cause and the remedy.
            raise OSError(f"saving checkpoint {path} failed with the disk nearly full "
                          f"({free / 2**30:.1f} GiB free; {exc}): free space, "
                          "or save less often (trainer_common.save_freq) and keep fewer checkpoints") from exc
        raise


def _write_weights(trainer, tmp: Path, state: dict | None) -> None:
    """The model's weights, or under LoRA the adapter only (`astuner export` merges it into a model folder)."""
    if trainer.peft is None:
        trainer.model.save_pretrained(tmp, state_dict=state)
        return
    from safetensors.torch import save_file

    state = state or dict(trainer.model.named_parameters())
    tmp.mkdir(parents=True)
    save_file({k: v.detach().contiguous().cpu() for k, v in adapter_state_for_save(state).items()},
              str(tmp / "adapter_model.safetensors"))
    trainer.peft.peft_config[ADAPTER_NAME].save_pretrained(str(tmp))


def _write_tokenizer(trainer, tmp: Path, tokenizer, path: Path) -> None:
    """The tokenizer beside the weights (given, else loaded from model_path), so the folder is self-contained."""
    if tokenizer is None:
        from transformers import AutoTokenizer

        try:
            tokenizer = AutoTokenizer.from_pretrained(trainer.model_path)
        except Exception as exc:
            log.warning("checkpoint %s saved without tokenizer: %s", path, exc)
    if tokenizer is not None:
        tokenizer.save_pretrained(tmp)


def _write_resume_state(tmp: Path, optimizer, optimizer_steps: int, run_state: dict) -> None:
    resume = tmp / RESUME_DIR
    resume.mkdir()
    torch.save(
        {
            "optimizer": optimizer,
            "optimizer_steps": optimizer_steps,
            "torch_rng": torch.get_rng_state(),
            "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
        },
        resume / "trainer.pt",
    )
    write_run_state(tmp, run_state)  # last: its presence marks a complete, resumable checkpoint


def move_into_place(tmp: Path, path: Path, tag: str) -> None:
    """The finished folder `tmp` becomes `path`, replacing what was there (`tag`: a unique suffix)."""
    if path.exists():
        # A directory cannot be renamed over a non-empty one: move the old one aside first.
        old = path.parent / f".{path.name}.old-{tag}"
        path.rename(old)
        tmp.rename(path)
        shutil.rmtree(old, ignore_errors=True)
    else:
        tmp.rename(path)


def _free_bytes(folder: Path) -> int | None:
    try:
        return shutil.disk_usage(folder).free
    except OSError:
        return None

def load(trainer, path: Path) -> dict:
    """Restore weights, optimizer, step count and RNG from a checkpoint `save_checkpoint` wrote with a run
    state; returns that run state. The KL reference model stays the initial policy."""
    from safetensors.torch import load_file

    path = Path(path)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{path} holds no .safetensors weights")
    state: dict[str, Tensor] = {}
    for f in files:
        state.update(load_file(str(f)))
    if trainer.peft is not None:
        state = adapter_state_from_file(state)
    saved = torch.load(path / RESUME_DIR / "trainer.pt", map_location="cpu", weights_only=False)
    try:  # sharded: every worker reads the whole checkpoint and keeps its shards
        trainer.load_state_dict({"model": state, "optimizer": saved["optimizer"],
                                 "optimizer_steps": saved["optimizer_steps"]})
    except ValueError as exc:
        raise ValueError(f"{path}: {exc}") from None
    torch.set_rng_state(saved["torch_rng"])
    if saved.get("cuda_rng") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(saved["cuda_rng"])
    return read_run_state(path)


def full_state(trainer, optimizer: bool = True) -> dict:
    """`Trainer.state_dict`."""
    trainer.check_joined()
    if trainer.sharded:
        weights = {name: fsdp.full(p.detach()).cpu() for name, p in trainer.model.named_parameters()}
        state = fsdp.full_optimizer_state(trainer.optimizer) if optimizer else None
    else:
        weights = trainer.master.state_dict(trainer.model)
        state = trainer.optimizer.state_dict() if optimizer else None
    return {"model": weights, "optimizer": state, "optimizer_steps": trainer.optimizer_steps}


def restore_state(trainer, state: dict) -> None:
    """`Trainer.load_state_dict`."""
    trainer.check_joined()
    weights = state["model"]
    if trainer.sharded:  # every worker holds the whole state and keeps its shards
        missing, unexpected = fsdp.load_full_weights(trainer.root, weights)
    else:
        missing, unexpected = trainer.model.load_state_dict(weights, strict=False)
        trainer.master.load_masters(trainer.model, weights)
    tied = {n for n in missing if "lm_head" in n and getattr(trainer.model.config, "tie_word_embeddings", False)}
    if trainer.peft is not None:  # an adapter checkpoint holds the adapters only: the frozen base is not missing
        tied |= {n for n in missing if not is_lora_param(n)}
    if set(missing) - tied or unexpected:
        raise ValueError(f"weights do not fit the model (missing {sorted(set(missing) - tied)[:5]}, "
                         f"unexpected {sorted(unexpected)[:5]})")
    optimizer = state["optimizer"]
    if optimizer is None:  # weights only: the optimizer starts afresh (Adam moments of other weights would mislead)
        trainer.optimizer.state.clear()
        trainer.optimizer_steps = int(state["optimizer_steps"])
        return
    if trainer.sharded:
        optimizer = fsdp.shard_optimizer_state(optimizer, trainer.params)
    trainer.optimizer.load_state_dict(optimizer)
    trainer.optimizer_steps = int(state["optimizer_steps"])
