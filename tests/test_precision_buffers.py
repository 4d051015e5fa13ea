"""The bf16 cast touches parameters only (astuner/trainer/precision.py: cast_parameters): buffers such as rotary
`inv_freq` keep their fp32 values, in the policy, its masters' round trip and the reference model, and through a
checkpoint. The logprob test isolates the buffers on a sequence past 2k tokens, where a rounded `inv_freq` shows.
The sharded path (fsdp2) is checked in tests/test_fsdp.py."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from astuner.trainer.precision import MasterWeights
from astuner.trainer import Trainer
from astuner.types import Sample
from tolerances import rounding_rtol

VOCAB = 512
LONG = range(2000, 2100)  # positions past 2k whose next token is scored


@pytest.fixture(scope="module")
def long_model_dir(tmp_path_factory):
    """A 2-layer Llama (hidden 64) with a 4096-token context. Initialised with std 0.1, not 0.02, so that
    attention depends on the positions as in a trained model (near-uniform attention would hide the rotary)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    path = tmp_path_factory.mktemp("long_model")
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=4096,
                         initializer_range=0.1, tie_word_embeddings=False)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(path)
    return path


def fp32_model(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def assert_buffers_as_built(model, built: dict[str, torch.Tensor], what: str) -> None:
    got = dict(model.named_buffers())
    assert any("inv_freq" in name for name in built)
    for name, b in built.items():
        assert got[name].dtype == b.dtype == torch.float32, f"{what}: {name} is {got[name].dtype}"
        assert torch.equal(got[name], b), f"{what}: {name} changed"


def test_bf16_trainer_casts_parameters_and_keeps_buffers(long_model_dir, tmp_path):
    built = dict(fp32_model(long_model_dir).named_buffers())
    t = Trainer(str(long_model_dir), precision="bf16", device="cpu", use_kl_loss=True, lr=1e-3)
    for model, what in ((t.model, "policy"), (t.ref_model, "reference")):
        assert all(p.dtype == torch.bfloat16 for p in model.parameters()), what
        assert_buffers_as_built(model, built, what)
    # A step and a checkpoint round trip (the masters back into bf16 parameters) leave them as they are.
    ids = torch.randint(0, VOCAB, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    t.train_step([Sample(ids[:20], ids[20:], t.compute_logprobs(ids[:20], ids[20:], 1.0), 1.0, 1.0, "a")])
    t.save_checkpoint(tmp_path / "ckpt", run_state={"step": 1})
    resumed = Trainer(str(long_model_dir), precision="bf16", device="cpu", use_kl_loss=True, lr=1e-3)
    resumed.load_checkpoint(tmp_path / "ckpt")
    for model, what in ((t.model, "policy after a step"), (resumed.model, "resumed"),
                        (resumed.ref_model, "resumed reference")):
        assert_buffers_as_built(model, built, what)


def test_master_weights_unify_restores_fp32_parameters_and_keeps_buffers(long_model_dir):
    model = fp32_model(long_model_dir)
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    built = {n: b.clone() for n, b in model.named_buffers()}
    master = MasterWeights(model, "bf16")
    assert_buffers_as_built(model, built, "bf16")
    master.unify(model)  # what fsdp2 shards: fp32 parameters, the masters' values
    for n, p in model.named_parameters():
        assert p.dtype == torch.float32 and torch.equal(p.detach(), params[n]), n
    assert_buffers_as_built(model, built, "unified")


def test_long_sequence_logprobs_see_the_fp32_rotary(long_model_dir):
    """Past 2k tokens, the bf16 trainer's positions are the fp32 model's. Both sides compute in fp32 with the same
    bf16-rounded weights, so nothing but the buffers can differ; rounding `inv_freq` to bf16 (what casting the
    whole model did) moves these logprobs far beyond the fp32 tolerance."""
    t = Trainer(str(long_model_dir), precision="bf16", device="cpu")
    fp32 = fp32_model(long_model_dir)
    positions = torch.tensor([list(LONG)])
    x = torch.zeros(1, len(LONG), 64)
    cos, sin = t.model.model.rotary_emb(x, positions)
    cos32, sin32 = fp32.model.rotary_emb(x, positions)
    assert torch.equal(cos, cos32) and torch.equal(sin, sin32)

    ids = torch.randint(0, VOCAB, (1, LONG.stop + 1), generator=torch.Generator().manual_seed(1))

    @torch.no_grad()
    def logprobs(model) -> torch.Tensor:
        logp = torch.log_softmax(model(input_ids=ids).logits[0].float(), dim=-1)
        return logp[LONG.start:LONG.stop].gather(-1, ids[0, LONG.start + 1:LONG.stop + 1, None])[:, 0]

    with torch.no_grad():
        for p in fp32.parameters():  # the trainer's bf16 weights, in fp32: rounding the weights is not the question
            p.copy_(p.to(torch.bfloat16))
    trainer_fp32 = copy.deepcopy(t.model).float()  # its weights and its buffers, computed in fp32
    atol = rounding_rtol(torch.float32, VOCAB) * math.log(VOCAB)
    expected = logprobs(fp32)
    assert (logprobs(trainer_fp32) - expected).abs().max().item() <= atol

    rounded = copy.deepcopy(fp32)
    with torch.no_grad():
        for name, b in rounded.named_buffers():
            if "inv_freq" in name:
                b.copy_(b.to(torch.bfloat16))
    error = (logprobs(rounded) - expected).abs().mean().item()
    assert error > 10 * atol, f"a bf16 inv_freq moves logprobs past 2k tokens by {error:.3g} only"
