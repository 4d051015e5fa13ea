"""Trainer precision: fp32, or bf16 compute with fp32 master weights and fp32 optimizer state.

bf16 (the default on CUDA): the model's parameters are bf16, so every matmul and elementwise op runs in bf16
with no per-op casts (under autocast, fp32 weights are cast to bf16 again at every forward). An fp32 copy of
each trainable parameter (the master weight) is what AdamW updates:

    g32 = float(grad16);  master <- AdamW(master, g32);  param16 <- bf16(master)

so updates smaller than bf16's resolution (about 2^-8 relative) accumulate in the master instead of being
rounded away. Checkpoints hold the master weights (fp32), so a resumed run continues from exactly the same
numbers. Bytes per parameter: 2 (bf16 weights) + 2 (bf16 grads, freed when cast) + 4 (master) + 4 (fp32
grads) + 8 (Adam moments) = 18, against 16 for fp32 (see preflight).

fp32 (the default on CPU, and the reference): parameters, gradients and optimizer in fp32, no autocast; engine
and trainer logprobs then agree to ~1e-6 with an fp32 engine.

Only parameters change dtype (`cast_parameters`); buffers keep theirs, as in vLLM. Rotary `inv_freq` is a buffer
(transformers registers it so) and multiplies the position: rounded to bf16 (relative error up to 2^-9) it turns
into a phase error of position x inv_freq x 2^-9 radians, radians at a few thousand tokens, and so into wrong
logprobs on exactly the long trajectories (tests/test_precision_buffers.py measures it).
"""

from __future__ import annotations

import torch

PRECISIONS = ("auto", "fp32", "bf16")


@torch.no_grad()
def cast_parameters(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Cast the floating-point parameters of `model` to `dtype` in place (each keeps its identity, as under
    `Module.to`); buffers keep their dtype (module docstring)."""
    for p in model.parameters():
        if p.is_floating_point() and p.dtype != dtype:
            p.data = p.data.to(dtype)


def resolve_precision(setting: str, device_type: str) -> str:
    if setting not in PRECISIONS:
        raise ValueError(f"unknown precision {setting!r}; available: {', '.join(PRECISIONS)}")
    if setting == "auto":
        return "bf16" if device_type == "cuda" else "fp32"
    return setting


class MasterWeights:
    """The parameters the optimizer steps: the model's own (fp32), or fp32 masters of its bf16 parameters."""

    def __init__(self, model: torch.nn.Module, precision: str) -> None:
        self.precision = precision
        self.model_params = [p for p in model.parameters() if p.requires_grad]
        if precision == "bf16":
            self.masters = [p.detach().float().clone() for p in self.model_params]
            cast_parameters(model, torch.bfloat16)
        else:
            self.masters = self.model_params

    @property
    def separate(self) -> bool:
        return self.masters is not self.model_params

    def grads_to_masters(self) -> None:
        """Move the model's gradients onto the masters (fp32), freeing the bf16 ones."""
        if not self.separate:
            return
        for master, param in zip(self.masters, self.model_params):
            master.grad = None if param.grad is None else param.grad.float()
            param.grad = None

    @torch.no_grad()
    def masters_to_model(self) -> None:
        if self.separate:
            for master, param in zip(self.masters, self.model_params):
                param.copy_(master)

    @torch.no_grad()
    def unify(self, model: torch.nn.Module) -> None:
        """Back to one fp32 copy: the model's parameters become fp32 and take the masters' values (FSDP2 then
        keeps its shards in fp32 and computes in bf16 itself, astuner/trainer/fsdp.py)."""
        if self.separate:
            cast_parameters(model, torch.float32)
            self.masters_to_model()

    def zero_grad(self) -> None:
        for p in self.model_params:
            p.grad = None
        if self.separate:
            for m in self.masters:
                m.grad = None

    def state_dict(self, model: torch.nn.Module) -> dict[str, torch.Tensor] | None:
        """The model's state dict with the master weights in place of the bf16 ones (None: the model's own)."""
        if not self.separate:
            return None
        by_id = {id(p): m for p, m in zip(self.model_params, self.masters)}
        return {name: by_id.get(id(p), p).detach() for name, p in model.named_parameters()}

    @torch.no_grad()
    def load_masters(self, model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
        """After `model.load_state_dict(state)` (which rounds into bf16): the exact fp32 values into the masters."""
        if not self.separate:
            return
        index = {id(p): i for i, p in enumerate(self.model_params)}
        for name, p in model.named_parameters():
            if id(p) in index and name in state:
                self.masters[index[id(p)]].copy_(state[name])
