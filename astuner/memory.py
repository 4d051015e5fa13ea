"""Memory a run needs beyond its weights and optimizer states: the trainer's activations and logits for a
micro-batch, and the engine's KV cache. Pure arithmetic on the model's shape (config.json); preflight.py adds the
weights and fits the total to the memory this machine has.

Per token, with L layers, hidden size H, MLP size I, vocabulary V, K key/value heads of size D and b bytes per
activation value of the compute dtype (4 for fp32, 2 for bf16):

    activations  = b * L * (10 H + 4 I)                  the layers' saved tensors for the backward pass
                   b * (4 L H + 10 H + 4 I)              with gradient checkpointing: each layer's input, and one
                                                         layer's tensors while it is recomputed
                 + (20 + f + g) V                        the plain head: fp32 logits, the log-sum-exp's backward
                                                         and the entropy (f = 1 with top-k / top-p, g = 1 when
                                                         entropy_coeff trains the entropy)
    KV cache     = 2 * L * K * D * b_kv                  keys and values of every layer (b_kv: the engine's dtype)

The chunked head (astuner/trainer/fused_head.py, the trainer's on CUDA) holds, whatever the token count and in every mode
(filter, entropy, its gradient), 8 bytes per entry of one chunk's C x V logits and, in the backward, an fp32
weight gradient plus one chunk's product with the hidden states:
    head_chunked = 8 * min(tokens, C) * V + (4 + b + 4 [b < 4]) * V * H          (8: CHUNK_ENTRY_BYTES)

Measured with the trainer on CPU, fp32, as the rise of peak RSS from 500 to 2500 response tokens, on a 2-layer
model of width 128 with the demo vocabulary (V 49152), where the head is nearly all and its R x V tensors are far
above malloc's mmap threshold (RSS sees each come and go): 20.0 V a token for the plain head, 21.3 V with top-k 50
/ top-p 0.9, 21.2 V with entropy_coeff; the chunked head (C = 256) under 0.4 V a token in all three. The KV cache
is 46 KB a token in fp32 on the demo model (SmolLM2-135M: L 30, H 576, I 1536, 3 KV heads of 64).

What this machine has for it is read here too: the trainer's device (`DeviceFacts`, `local_device`) and the memory
available (`available_memory`: what the kernel says, capped by the process's cgroup and by its NUMA node, the figure
vLLM's CPU backend checks its KV cache against).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

VLLM_CPU_BLOCK = 128  # vLLM's CPU KV-cache block (tokens); only whole blocks are allocated
CHUNK_ENTRY_BYTES = 8  # the chunked head's peak per entry of one chunk's C x V logits (astuner/trainer/fused_head.py)


@dataclass(frozen=True)
class ModelShape:
    layers: int
    hidden: int
    intermediate: int
    vocab: int
    kv_heads: int
    head_dim: int

    @classmethod
    def from_config(cls, config) -> "ModelShape | None":
        """From a transformers config; None when a field is missing (an architecture these formulas do not
        describe: the estimate then leaves activations and KV cache out and says so)."""
        try:
            heads = config.num_attention_heads
            hidden = config.hidden_size
            return cls(
                layers=int(config.num_hidden_layers),
                hidden=int(hidden),
                intermediate=int(getattr(config, "intermediate_size", None) or 4 * hidden),
                vocab=int(config.vocab_size),
                kv_heads=int(getattr(config, "num_key_value_heads", None) or heads),
                head_dim=int(getattr(config, "head_dim", None) or hidden // heads),
            )
        except (AttributeError, TypeError, ValueError, ZeroDivisionError):
            return None

    def activation_bytes(self, tokens: int, value_bytes: int, checkpointing: bool, chunk_rows: int | None,
                         filtered: bool = False, entropy_grad: bool = False) -> int:
        """Peak bytes of one micro-batch of `tokens` tokens in the trainer's forward and backward; `chunk_rows`:
        the chunked head's rows (astuner/trainer/fused_head.py), None for the plain head; `filtered`: the rollout's top-k /
        top-p scored; `entropy_grad`: the entropy trained (entropy_coeff > 0)."""
        L, H, I = self.layers, self.hidden, self.intermediate
        layers = value_bytes * (4 * L * H + 10 * H + 4 * I) if checkpointing else value_bytes * L * (10 * H + 4 * I)
        return tokens * layers + self.head_bytes(tokens, value_bytes, chunk_rows, filtered, entropy_grad)

    def head_bytes(self, tokens: int, value_bytes: int, chunk_rows: int | None, filtered: bool = False,
                   entropy_grad: bool = False) -> int:
        """Peak bytes of the LM head's log-softmax over `tokens` response tokens, forward and backward (module
        docstring: plain, or chunked in `chunk_rows` rows)."""
        V, H = self.vocab, self.hidden
        if chunk_rows:
            weight_grad = (4 + value_bytes + 4 * (value_bytes < 4)) * V * H
            return CHUNK_ENTRY_BYTES * min(tokens, chunk_rows) * V + weight_grad
        return tokens * (20 + filtered + entropy_grad) * V

    def kv_bytes_per_token(self, value_bytes: int) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * value_bytes


def blocks_of(tokens: int, block: int = VLLM_CPU_BLOCK) -> int:
    """Tokens rounded up to whole KV blocks."""
    return -(-tokens // block) * block


@dataclass(frozen=True)
class DeviceFacts:
    """Where the trainer runs: its device type and, on a GPU, one card's free and total memory (None: unknown)."""

    type: str  # "cuda" or "cpu"
    free_bytes: int | None = None
    total_bytes: int | None = None


def local_device() -> DeviceFacts:
    """This process's device, for a trainer in this process (the debug backbone). It starts CUDA here: a Ray
    driver asks its GPU workers instead (`backbone/ray_run.cluster_device`)."""
    import torch

    if not torch.cuda.is_available():
        return DeviceFacts("cpu")
    free, total = torch.cuda.mem_get_info()
    return DeviceFacts("cuda", int(free), int(total))


def available_memory(device: str) -> int | None:
    """Bytes this process can use: free GPU memory on cuda; on cpu MemAvailable, capped by a cgroup limit and by
    the NUMA node's available memory (vLLM's CPU backend checks its KV cache against the node's)."""
    if device == "cuda":
        import torch

        return int(torch.cuda.mem_get_info()[0])
    available = None
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024
    except OSError:
        pass
    for limit_file, usage_file in (
        ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
        ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"),
    ):
        try:
            limit = Path(limit_file).read_text().strip()
            usage = int(Path(usage_file).read_text().strip())
        except (OSError, ValueError):
            continue
        if limit.isdigit() and int(limit) < 2**60:
            room = int(limit) - usage
            available = room if available is None else min(available, room)
        break
    node = node_available_memory()
    return available if node is None else node if available is None else min(available, node)


def node_available_memory() -> int | None:
    """What vLLM's CPU backend checks its KV cache against: the available memory of the NUMA node of this process's
    first CPU (free + file cache + reclaimable slab, from /sys/devices/system/node/nodeN/meminfo). On a machine of
    several nodes this is less than MemAvailable; None where the kernel has no node files."""
    try:
        cpu = min(os.sched_getaffinity(0))
        node = next(Path(f"/sys/devices/system/cpu/cpu{cpu}").glob("node[0-9]*")).name
        fields = {}
        for line in Path(f"/sys/devices/system/node/{node}/meminfo").read_text().splitlines():
            parts = line.split()  # "Node 0 MemFree:  13420192 kB"
            if len(parts) >= 4:
                fields[parts[2].rstrip(":")] = int(parts[3]) * 1024
        return fields["MemFree"] + fields["Active(file)"] + fields["Inactive(file)"] + fields.get("SReclaimable", 0)
    except (OSError, StopIteration, KeyError, ValueError, AttributeError):
        return None
