"""The chunked LM head (astuner/trainer/fused_head.py, the trainer's on CUDA) with the rollout's top-k / top-p and the
entropy, with and without its gradient: the plain path's logprobs, entropies and gradients, in memory bounded by
the chunk, and the start-up estimate (astuner/memory.py) counting what each head holds.

Memory is counted by a dispatch mode that adds up the storages the ops allocate while they are alive: the peak of
the tensors the head creates, on CPU, whatever the allocator caches."""

from __future__ import annotations

import types
import weakref

import pytest
import torch
from tolerances import VOCAB, assert_close_normwise
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from astuner.trainer import fused_head
from astuner.memory import DeviceFacts, ModelShape
from astuner.trainer.forward import HeadPath, response_logprobs
from astuner.types import Sample

MODES = [(20, 1.0), (0, 0.3), (50, 0.8)]  # (top_k, top_p): each drops some of the unlikely targets


class LiveBytes(TorchDispatchMode):
    """Peak bytes of the storages created under it (a view or an in-place result of an existing one is not new)."""

    def __init__(self):
        super().__init__()
        self.live: dict[int, int] = {}
        self.now = self.peak = 0

    def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0]
                  if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                storage = t.untyped_storage()
                if id(storage) in self.live or storage.data_ptr() in inputs:
                    continue
                self.live[id(storage)] = storage.nbytes()
                self.now += storage.nbytes()
                self.peak = max(self.peak, self.now)
                weakref.finalize(storage, self._free, id(storage))
        return out

    def _free(self, key: int) -> None:
        self.now -= self.live.pop(key)


def _greedy_response(model, prompt: list[int], n: int) -> list[int]:
    """The model's most likely tokens: kept by any top-k / top-p, so their logprobs are finite."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


@pytest.mark.parametrize("top_k,top_p", MODES)
@pytest.mark.parametrize("entropy_grad", [False, True])
def test_chunked_head_with_filter_and_entropy_gives_the_plain_paths_numbers(tiny_model_dir, demo_tokenizer,
                                                                            monkeypatch, top_k, top_p, entropy_grad):
    from astuner.trainer import forward as trainer_forward
    from tests.test_trainer import _trainer

    monkeypatch.setattr(fused_head, "CHUNK_ROWS", 3)  # several chunks, a sample split across them
    chunked_calls = []
    monkeypatch.setattr(trainer_forward, "head_logprobs",
                        lambda *a, **k: chunked_calls.append(1) or fused_head.head_logprobs(*a, **k))
    trainer = _trainer(tiny_model_dir, top_k=top_k, top_p=top_p)
    prompt = demo_tokenizer("Hello there", add_special_tokens=False)["input_ids"]
    likely = _greedy_response(trainer.model, prompt, 6)
    unlikely = demo_tokenizer(" general kenobi", add_special_tokens=False)["input_ids"]  # mostly filtered out
    samples = [Sample(prompt, likely + unlikely, [0.0] * (len(likely) + len(unlikely)), 1.0, 0.7, "a"),
               Sample(prompt, likely[:4], [0.0] * 4, -1.0, 1.3, "b"),
               Sample(prompt, unlikely, [0.0] * len(unlikely), 1.0, 0.0, "c")]  # greedy: never filtered
    results = []
    for chunked in (False, True):
        trainer.head.chunked = chunked
        trainer.model.zero_grad()
        logprobs, entropy, _ = trainer.forward_logprobs(samples, with_entropy=True, entropy_grad=entropy_grad)
        R = len(logprobs)
        # Gradients fed straight in: the rows whose target the filter dropped (logprob -inf) still pass the
        # log-sum-exp's share to the kept tokens.
        outputs, grads = [logprobs], [torch.linspace(-1.0, 1.0, R)]
        if entropy_grad:
            outputs.append(entropy)
            grads.append(torch.linspace(0.5, -0.5, R))
        torch.autograd.backward(outputs, grads)
        weights = {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}
        results.append((logprobs.detach(), entropy.detach(), weights))
    assert chunked_calls == [1]  # the chunked run took the chunked head, filter and entropy included
    (lp_a, ent_a, g_a), (lp_b, ent_b, g_b) = results
    dropped = torch.isinf(lp_a)
    assert torch.equal(torch.isinf(lp_b), dropped)
    assert dropped.any() and (~dropped).sum() >= 10  # both kinds of rows are exercised
    assert_close_normwise(lp_b[~dropped], lp_a[~dropped], what="logprobs")
    assert_close_normwise(ent_b, ent_a, what="entropy")
    assert set(g_a) == set(g_b) and "model.embed_tokens.weight" in g_b
    for name in g_a:
        assert_close_normwise(g_b[name], g_a[name], what=name)


class HeadOnly(torch.nn.Module):
    """An embedding and an LM head: the decoder's memory out of the way of the head's."""

    def __init__(self, vocab: int, hidden: int):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, hidden)
        self.lm_head = torch.nn.Linear(hidden, vocab, bias=False)
        self.config = types.SimpleNamespace()

    def base_model(self, input_ids, use_cache=False):
        return (self.embed(input_ids),)

    def get_output_embeddings(self):
        return self.lm_head


def _head_peak(model, rows: int, chunk_rows: int | None, top_k: int, top_p: float, entropy_grad: bool) -> int:
    """Peak bytes of one train micro-batch's head (forward with entropy, backward) over `rows` response tokens."""
    V = model.lm_head.weight.shape[0]
    targets = torch.randint(0, V, (rows,), generator=torch.Generator().manual_seed(0)).tolist()
    path = HeadPath(torch.device("cpu"), fast=True, chunked=chunk_rows is not None, top_k=top_k, top_p=top_p)
    model.zero_grad(set_to_none=True)
    with LiveBytes() as live:
        logprobs, entropy, _ = response_logprobs(path, model, [Sample([1, 2], targets, [0.0] * rows, 1.0, 0.7, "a")],
                                              True, entropy_grad)
        outputs = [logprobs, entropy] if entropy_grad else [logprobs]
        torch.autograd.backward(outputs, [torch.ones(rows)] * len(outputs))
        del logprobs, entropy, outputs
    return live.peak


@pytest.mark.parametrize("top_k,top_p", [(0, 1.0), (50, 0.9)])
@pytest.mark.parametrize("entropy_grad", [False, True])
def test_each_head_holds_what_the_estimate_counts(monkeypatch, top_k, top_p, entropy_grad):
    """The chunked head's peak does not grow with the token count, in every mode, and stays within the estimate;
    the plain head's is the estimate's bytes per entry of R x V."""
    V, H, C = VOCAB // 8, 4, 64
    torch.manual_seed(0)
    model = HeadOnly(V, H)
    monkeypatch.setattr(fused_head, "CHUNK_ROWS", C)
    shape = ModelShape(layers=1, hidden=H, intermediate=H, vocab=V, kv_heads=1, head_dim=H)
    filtered = top_k > 0 or top_p < 1.0
    # Beside the head: the embedding's output and gradients (R x H), the per-row vectors, the embedding's gradient.
    room = lambda rows: rows * (4 * H * 3 + 4 * 16) + 4 * V * H  # noqa: E731
    chunked = {R: _head_peak(model, R, C, top_k, top_p, entropy_grad) for R in (4 * C, 16 * C)}
    estimate = shape.head_bytes(16 * C, 4, C, filtered, entropy_grad)
    assert chunked[16 * C] <= estimate + room(16 * C)
    assert chunked[16 * C] - chunked[4 * C] <= room(16 * C) - room(4 * C)  # nothing R x V
    plain = _head_peak(model, 4 * C, None, top_k, top_p, entropy_grad)
    assert shape.head_bytes(4 * C, 4, None, filtered, entropy_grad) <= plain <= \
        shape.head_bytes(4 * C, 4, None, filtered, entropy_grad) + room(4 * C)
    assert plain > 2 * chunked[4 * C]  # the measure tells the two heads apart at only 4 chunks


def test_the_estimate_counts_the_head_of_the_run(tmp_path, tiny_model_dir, monkeypatch):
    """On CPU (plain head) top-k / top-p and entropy_coeff add to the head's bytes; on CUDA (chunked) the head
    is one chunk whatever the mode."""
    from test_memory import DEMO, FACTS
    from test_run_contract import write_run

    from astuner.config import load_config
    from astuner.preflight import GIB, make_plan

    monkeypatch.setattr("astuner.preflight.available_memory", lambda device: 200 * GIB)
    yaml = write_run(tmp_path, tiny_model_dir)

    def act(device, *overrides):
        typed = load_config(yaml, ["astuner.trainer_common.precision=fp32", *overrides]).typed
        facts = DeviceFacts(device, 70 * GIB, 80 * GIB) if device == "cuda" else DeviceFacts("cpu")
        return make_plan(typed, "debug", FACTS, 256, 4, facts).activation_bytes

    sampled = ("astuner.rollout.top_k=20", "astuner.rollout.top_p=0.9")
    trained = ("astuner.trainer_common.entropy_coeff=0.01",)
    base, filt, both = act("cpu"), act("cpu", *sampled), act("cpu", *sampled, *trained)
    tokens = (filt - base) // DEMO.vocab  # 1 byte an entry of the micro-batch's R x V each
    assert tokens >= 256 and filt - base == both - filt == tokens * DEMO.vocab
    assert act("cuda") == act("cuda", *sampled, *trained)
