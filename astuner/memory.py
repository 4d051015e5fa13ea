"""Memory a run needs beyond its weights and optimizer states: the trainer's activations and logits for a
micro-batch, and the engine's KV cache. Pure arithmetic on the model's shape (config.json); preflight.py adds the
weights and fits the total to the memory this machine has.

Per token, with L layers, hidden size H, MLP size I, vocabulary V, K key/value heads of size D and b bytes per
activation value of the compute dtype (4 for fp32, 2 for bf16):

    activations  = b * L * (10 H + 4 I)                  the layers' saved tensors for the backward pass
                   b * (4 L H + 10 H + 4 I)              with gradient checkpointing: each layer's input, and one
                                                         layer's tensors while it is recomputed
                 + 12 V                                  fp32 logits, probabilities and their gradient (the plain
                                                         head; the chunked head holds 2 x CHUNK_ROWS x V x 4 bytes
                                                         in all, whatever the token count)
    KV cache     = 2 * L * K * D * b_kv                  keys and values of every layer (b_kv: the engine's dtype)

Measured on the demo model (SmolLM2-135M: L 30, H 576, I 1536, V 49152) with the trainer on CPU, fp32, peak RSS
over 500 and 2500 response tokens: 2.05 MB a token (the formula: 2.02 MB), 0.87 MB with gradient checkpointing
(formula: 0.91 MB); the KV cache is 46 KB a token in fp32 (3 KV heads of 64).
"""

from __future__ import annotations

from dataclasses import dataclass

VLLM_CPU_BLOCK = 128  # vLLM's CPU KV-cache block (tokens); only whole blocks are allocated


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

    def activation_bytes(self, tokens: int, value_bytes: int, checkpointing: bool, chunk_rows: int | None) -> int:
        """Peak bytes of one micro-batch of `tokens` tokens in the trainer's forward and backward; `chunk_rows`:
        the chunked head's rows (astuner/fused_head.py), None for the plain head."""
        L, H, I = self.layers, self.hidden, self.intermediate
        layers = value_bytes * (4 * L * H + 10 * H + 4 * I) if checkpointing else value_bytes * L * (10 * H + 4 * I)
        head = 2 * min(tokens, chunk_rows) * self.vocab * 4 if chunk_rows else tokens * 12 * self.vocab
        return tokens * layers + head

    def kv_bytes_per_token(self, value_bytes: int) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * value_bytes


def blocks_of(tokens: int, block: int = VLLM_CPU_BLOCK) -> int:
    """Tokens rounded up to whole KV blocks."""
    return -(-tokens // block) * block
