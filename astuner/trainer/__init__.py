"""The policy trainer and its parts: PyTorch + transformers only (no Ray, no vLLM, no rollouts).

    core.py           the `Trainer`: forward_backward, optim_step, forward_logprobs, state, train
    step.py           one training step over the trainer's public surface (mini-batches, epochs, metrics)
    forward.py        the response tokens' logprobs and entropies (the LM head path, sampling filters)
    checkpoint.py     atomic Hugging Face checkpoints and the exact-resume state
    settings.py       `TrainerSettings`, the trainer's typed settings
    data_parallel.py  a worker of a data-parallel group (ddp: whole replicas, all-reduced gradients)
    fsdp.py           the same group sharded (fsdp2)
    precision.py      bf16 compute with fp32 master weights
    lora.py           PEFT adapters, merged for the engine
    fused_head.py     the LM head's log-softmax in row chunks (CUDA)

`from astuner.trainer import Trainer` imports the trainer on first use, so that a part (the settings, say) can be
imported without loading transformers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from astuner.trainer.core import Trainer

__all__ = ["Trainer"]


def __getattr__(name: str):
    if name == "Trainer":
        from astuner.trainer.core import Trainer

        return Trainer
    raise AttributeError(f"module 'astuner.trainer' has no attribute {name!r}")
