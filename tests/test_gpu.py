"""GPU checks (marker `gpu`): run wherever CUDA is present, skipped elsewhere (CI has no GPU).

    python -m pytest -m gpu tests/test_gpu.py
"""

from __future__ import annotations

import pytest
import torch

from astuner.types import Sample

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (marker gpu)")]


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory):
    """A small Qwen2-shaped model with random weights (no tokenizer needed: the trainer works on ids)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    path = tmp_path_factory.mktemp("qwen")
    config = Qwen2Config(vocab_size=4096, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).save_pretrained(path)
    return path


def _trainer(path, **kw):
    from astuner.trainer import Trainer

    args = dict(lr=1e-4, weight_decay=0.0, lr_warmup_steps=0, grad_clip=1.0, clip_ratio_low=0.2, clip_ratio_high=0.2,
                use_kl_loss=False, kl_loss_coef=0.0, kl_loss_type="k3", loss_agg_mode="token-mean",
                norm_length=32, max_token_len_per_micro_batch=4096)
    args.update(kw)
    return Trainer(str(path), **args)


def test_bf16_trainer_on_cuda(qwen_dir):
    t = _trainer(qwen_dir)
    assert t.precision == "bf16" and t.device.type == "cuda"
    assert all(p.dtype == torch.bfloat16 and p.is_cuda for p in t.model.parameters())
    assert all(p.dtype == torch.float32 for g in t.optimizer.param_groups for p in g["params"])
    assert t.optimizer.defaults.get("fused")
    g = torch.Generator().manual_seed(0)
    samples = []
    for i in range(4):
        prompt = torch.randint(10, 4000, (16,), generator=g).tolist()
        resp = torch.randint(10, 4000, (16,), generator=g).tolist()
        samples.append(Sample(prompt, resp, t.compute_logprobs(prompt, resp, 1.0), 1.0 if i % 2 else -1.0, 1.0,
                              f"e{i}"))
    metrics = t.train_step(samples)
    # Old logprobs are the trainer's own: the first ratio is 1 up to bf16 noise, and the update is finite.
    assert metrics["logprob_abs_diff_mean"] < 0.05 and metrics["grad_norm"] > 0
    for m, p in zip(t.master.masters, t.model.parameters()):
        assert torch.equal(m.to(torch.bfloat16), p.detach())


def test_pinned_shared_memory_transfer_roundtrip(qwen_dir):
    from astuner.engine.shared_weights import SharedWeightFile, pin_host_memory

    t = _trainer(qwen_dir)
    shared = SharedWeightFile("bfloat16")
    path, manifest = shared.write(t.named_parameters_for_sync())
    assert shared._pinned
    size = max(off + nb for _, _, _, nb, off in manifest)
    other = torch.from_file(path, shared=True, size=size, dtype=torch.uint8)  # what the worker maps
    assert pin_host_memory(other)
    params = dict(t.named_parameters_for_sync())
    for name, _, shape, nb, off in manifest:
        got = other[off:off + nb].view(torch.bfloat16).view(shape).to("cuda", non_blocking=True)
        assert torch.equal(got, params[name])
    torch.cuda.cudart().cudaHostUnregister(other.data_ptr())
    shared.close()


def test_chunked_head_matches_the_plain_path_on_cuda(qwen_dir):
    g = torch.Generator().manual_seed(1)
    samples = [Sample(torch.randint(10, 4000, (24,), generator=g).tolist(),
                      torch.randint(10, 4000, (40,), generator=g).tolist(), [0.0] * 40, 1.0, 0.8, f"e{i}")
               for i in range(3)]
    out = []
    for chunked in (False, True):
        t = _trainer(qwen_dir)
        assert t.head.chunked  # the CUDA default
        t.head.chunked = chunked
        logprobs = t.forward_logprobs(samples)[0]
        logprobs.sum().backward()
        out.append((logprobs.detach(), t.model.get_input_embeddings().weight.grad.float()))
    (lp_a, g_a), (lp_b, g_b) = out
    assert (lp_a - lp_b).abs().max() < 2e-2  # bf16 matmuls, fp32 softmax: both paths
    assert torch.allclose(g_a, g_b, atol=1e-3, rtol=5e-2)
