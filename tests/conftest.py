"""Shared fixtures: the real demo tokenizer and a tiny random-weight model built on it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def demo_model_dir() -> Path:
    from astuner.model_cache import ensure_demo_model

    return ensure_demo_model("smollm2-135m-instruct")


@pytest.fixture(scope="session")
def demo_tokenizer(demo_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(demo_model_dir)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, demo_tokenizer) -> Path:
    """A 2-layer Llama with random weights and the demo tokenizer (head_dim 64, as vLLM's CPU attention needs)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    path = tmp_path_factory.mktemp("tiny_model")
    config = LlamaConfig(
        vocab_size=len(demo_tokenizer),
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=64,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        bos_token_id=demo_tokenizer.bos_token_id,
        eos_token_id=demo_tokenizer.eos_token_id,
        pad_token_id=demo_tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    model.save_pretrained(path)
    demo_tokenizer.save_pretrained(path)
    return path
