"""FSDP2 sharding of the trainer over the data-parallel group (`torch.distributed.fsdp.fully_shard`).

Strategy `ddp` (astuner/trainer/data_parallel.py) keeps a whole replica per worker and all-reduces the gradients;
`fsdp2` shards every parameter, its gradient and its AdamW state over the `world` workers along dim 0, so a
worker holds 16/world bytes per parameter (fp32 shards, gradients, moments) plus the gathered bf16 weights of
the layer it is computing. Each decoder layer is one FSDP unit; the embedding, final norm and LM head (tied or
not) belong to a root unit that wraps the trainer's whole forward (`Root`), so the trainer's own head code sees
ordinary tensors.

The math is that of `ddp`, so a run gives the same numbers up to float summation order:
  - every worker computes the mini-batch token weights over all samples and backwards the episodes it owns;
    gradients are reduce-scattered as a SUM (divide factor 1): each shard holds sum_over_workers(grad);
  - the grad-norm clip sees the global norm (DTensor), AdamW steps each shard;
  - precision: shards are fp32 (the master weights); `bf16` computes with bf16 gathered weights and reduces
    gradients in fp32 (MixedPrecisionPolicy), in place of precision.MasterWeights.
Every forward and backward is collective, so workers must run the same number of them: a worker with fewer
micro-batches than the others runs padding passes of one token whose loss is multiplied by 0 (`pad_passes`).
Weights leave (engine sync, checkpoints) as full tensors gathered one parameter at a time; every worker takes
part and all iterate parameters in the same order.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from astuner.trainer.settings import STRATEGIES


def resolve_strategy(setting: str, world: int, device_type: str, lora: bool) -> str:
    """auto: fsdp2 for full fine-tuning with more than one worker on GPU; ddp otherwise (on CPU the gathers cost
    more than the memory they save; with LoRA the frozen base fits in bf16 and only adapters train)."""
    if setting not in STRATEGIES:
        raise ValueError(f"unknown strategy {setting!r}; available: {', '.join(STRATEGIES)}")
    if setting == "fsdp2" and lora:
        raise ValueError("trainer_common.strategy fsdp2 does not shard LoRA adapters yet: use strategy ddp (the "
                         "frozen base is held once per worker in bf16, and only the adapters are all-reduced)")
    if setting == "auto":
        return "fsdp2" if world > 1 and device_type == "cuda" and not lora else "ddp"
    return setting


class Root(nn.Module):
    """The root FSDP unit: calling it runs `fn(*args)` with the root's parameters (embedding, norm, LM head)
    gathered, and registers their gradient reduction for the backward."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, fn, *args, **kwargs):
        return fn(*args, **kwargs)

    def run(self, fn, *args):
        """`self(fn, *args)`; without autograd, the root's gathered weights are then freed (FSDP2 keeps a root's
        weights gathered after its forward for the backward; with no backward they would stay, and would go stale
        when the shards are next written)."""
        out = self(fn, *args)
        if not torch.is_grad_enabled():
            self.reshard()
        return out


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks Hugging Face names in `_no_split_modules` (LlamaDecoderLayer, Qwen2DecoderLayer...)."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    layers = [m for m in model.modules() if type(m).__name__ in names]
    if not layers:
        raise ValueError(f"{type(model).__name__} names no decoder layer class (_no_split_modules): use "
                         "trainer_common.strategy ddp for it")
    return layers


def shard(model: nn.Module, world: int, device_type: str, compute_dtype: torch.dtype) -> Root:
    """Shard `model` in place over the default process group (already initialised) and return its root."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(device_type, (world,))
    policy = MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)
    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    root = Root(model)
    fully_shard(root, mesh=mesh, mp_policy=policy)
    for module in root.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)  # a SUM over workers: each holds part of one loss
            module.set_force_sum_reduction_for_comms(True)  # gloo has no pre-multiplied sum
    # A parameter with no gradient on one worker (a branch another took) still joins the reduce-scatter.
    root.set_reduce_scatter_unused_params(True)
    return root


def full(t: Tensor) -> Tensor:
    """The whole tensor of a shard (a collective: every worker calls it), or `t` itself when not sharded."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def shard_like(whole: Tensor, like: Tensor) -> Tensor:
    """This worker's shard of `whole`, laid out as `like` (no communication: every worker holds `whole`)."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if not isinstance(like, DTensor):
        return whole.to(like.device, like.dtype)
    return distribute_tensor(whole.to(like.device.type, like.dtype), like.device_mesh, like.placements,
                             src_data_rank=None)


@torch.no_grad()
def load_full_weights(root: Root, state: dict[str, Tensor]) -> tuple[list[str], list[str]]:
    """Copy whole tensors into the sharded parameters; (missing, unexpected) names as `load_state_dict`."""
    root.reshard()  # no gathered copy may outlive the shards it was gathered from
    params = dict(root.model.named_parameters())
    for name, p in params.items():
        if name in state:
            p.copy_(shard_like(state[name], p))
    return [n for n in params if n not in state], [n for n in state if n not in params]


def full_optimizer_state(optimizer: torch.optim.Optimizer) -> dict:
    """`optimizer.state_dict()` with whole tensors, the same layout an unsharded trainer saves."""
    sd = optimizer.state_dict()
    sd["state"] = {i: {k: full(v).cpu() if isinstance(v, Tensor) else v for k, v in st.items()}
                   for i, st in sd["state"].items()}
    return sd


def shard_optimizer_state(sd: dict, params: list[Tensor]) -> dict:
    """The inverse of `full_optimizer_state` for this worker: each moment cut to its parameter's shard."""
    out = dict(sd)
    out["state"] = {i: {k: shard_like(v, params[i]) if isinstance(v, Tensor) and v.dim() > 0 else v
                        for k, v in st.items()}
                    for i, st in sd["state"].items()}
    return out
