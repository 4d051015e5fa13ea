"""Data parallelism for the trainer over `torch.distributed` (gloo on CPU, NCCL on GPU). No Ray here: the
backbone starts the processes and calls `init`; the trainer only calls the methods below.

Exactness: every worker receives the whole step's samples and computes the token weights over the whole
mini-batch (`algorithm.loss.token_weights`), so the mini-batch loss is a plain weighted sum over samples; each
worker backwards only the episodes it owns, and the summed gradients are those of one process holding every
sample (up to float summation order). The grad-norm clip and the AdamW step then run on identical gradients
in every worker, so the replicas stay equal without broadcasting weights.

Ownership: per mini-batch, episodes (all calls of an episode stay together) go longest first to the worker
with the fewest tokens so far (ties: lower rank), so every worker computes the same map.

Strategy fsdp2 (astuner/trainer/fsdp.py) keeps this split and these reductions, and replaces the whole replica and the
gradient all-reduce with shards and a reduce-scatter.
"""

from __future__ import annotations

import datetime
import os
import socket

import torch
import torch.distributed as dist

from astuner.step_plan import split_mini_batches
from astuner.types import Sample


def free_port(host: str = "") -> int:
    """A port free on this machine now, for rank 0 to host the process group's store."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def owners(samples: list[Sample], mini_batch_num: int, world: int) -> dict[str, int]:
    """episode_uid -> rank, balancing tokens inside each mini-batch (pure; see the module docstring)."""
    out: dict[str, int] = {}
    for mini_batch in split_mini_batches(samples, mini_batch_num):
        tokens: dict[str, int] = {}
        for s in mini_batch:
            tokens[s.episode_uid] = tokens.get(s.episode_uid, 0) + s.num_tokens
        load = [0] * world
        for uid in sorted(tokens, key=lambda u: -tokens[u]):  # stable: equal lengths keep first-appearance order
            rank = min(range(world), key=lambda r: (load[r], r))
            out[uid] = rank
            load[rank] += tokens[uid]
    return out


BUCKET_BYTES = 32 * 2**20  # per gradient all-reduce; torch's DDP reducer uses 25 MiB


def grad_buckets(grads: list[torch.Tensor], bucket_bytes: int) -> list[list[int]]:
    """Indices of `grads` in buckets of consecutive tensors of one dtype and device, each at most `bucket_bytes`
    (a tensor larger than that alone). Pure: every worker forms the same buckets, so the collectives pair up."""
    buckets: list[list[int]] = []
    size, kind = 0, None
    for i, g in enumerate(grads):
        nbytes = g.numel() * g.element_size()
        if not buckets or (g.dtype, g.device) != kind or size + nbytes > bucket_bytes:
            buckets.append([])
            size, kind = 0, (g.dtype, g.device)
        buckets[-1].append(i)
        size += nbytes
    return buckets


class DataParallel:
    """This process's place in the trainer group, and the collectives the trainer needs."""

    def __init__(self, rank: int, world: int) -> None:
        self.rank, self.world = rank, world
        self._owner: dict[str, int] = {}

    @staticmethod
    def init(rank: int, world: int, master_addr: str, master_port: int, device_type: str,
             timeout_s: float) -> "DataParallel":
        """Join the process group (every worker calls this at once; it waits up to `timeout_s` for the others)."""
        os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = master_addr, str(master_port)
        backend = "nccl" if device_type == "cuda" else "gloo"
        # NCCL bound to this rank's device from the start: torch otherwise guesses it at the first collective
        # (and barrier() may pick another rank's GPU).
        bound = {"device_id": torch.device("cuda", torch.cuda.current_device())} if backend == "nccl" else {}
        dist.init_process_group(backend, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=timeout_s), **bound)
        return DataParallel(rank, world)

    def assign(self, samples: list[Sample], mini_batch_num: int) -> None:
        self._owner = owners(samples, mini_batch_num, self.world)

    def mine(self, sample: Sample) -> bool:
        return self._owner.get(sample.episode_uid, 0) == self.rank

    def all_reduce_grads(self, params: list[torch.Tensor], bucket_bytes: int = BUCKET_BYTES) -> None:
        """Sum `.grad` over workers in place, bucket by bucket in the gradients' own dtype, as torch's DDP reducer
        does: beyond the gradients, one bucket (at most `bucket_bytes`, or one larger gradient alone) is held at a
        time, where one flat fp32 copy of every gradient cost up to 8 bytes a parameter. A parameter with no
        gradient here counts as zeros. Summed in bf16, two workers' sum is rounded once, as the fp32 sum cast
        back was."""
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        for bucket in grad_buckets([p.grad for p in params], bucket_bytes):
            grads = [params[i].grad for i in bucket]
            if len(grads) == 1 and grads[0].is_contiguous():  # alone in its bucket: reduced where it lies
                dist.all_reduce(grads[0])
                continue
            flat = torch.cat([g.reshape(-1) for g in grads])
            dist.all_reduce(flat)
            offset = 0
            for g in grads:
                g.copy_(flat[offset:offset + g.numel()].view_as(g))
                offset += g.numel()

    def max_int(self, n: int) -> int:
        """The largest `n` over workers (every worker gets it)."""
        t = torch.tensor([n], dtype=torch.int64, device="cuda" if dist.get_backend() == "nccl" else "cpu")
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return int(t.item())

    def reduce_sums(self, sums: dict[str, float], max_keys: tuple[str, ...] = ()) -> dict[str, float]:
        """Sum (or max, for `max_keys`) each value over workers; every worker gets the result."""
        keys = sorted(sums)
        added = torch.tensor([0.0 if k in max_keys else float(sums[k]) for k in keys], dtype=torch.float64)
        maxed = torch.tensor([float(sums[k]) if k in max_keys else float("-inf") for k in keys],
                             dtype=torch.float64)
        if dist.get_backend() == "nccl":
            added, maxed = added.cuda(), maxed.cuda()
        dist.all_reduce(added)
        dist.all_reduce(maxed, op=dist.ReduceOp.MAX)
        return {k: (maxed[i] if k in max_keys else added[i]).item() for i, k in enumerate(keys)}

    @staticmethod
    def close() -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
