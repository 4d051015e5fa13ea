"""Every weight sync is verified: the engine's fingerprint of what it serves against the fingerprint of what it
was sent (astuner/engine/fingerprint.py)."""

from __future__ import annotations

import logging
import os

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from astuner.engine.fingerprint import (BLOCK, CHUNK, PROBE_COLUMNS, SyncMismatch, TensorPrint, changed,
                                        chunk_elements, compared, differences, fingerprint, probe_columns, sigma,
                                        signed_sums, tensor_print)
from tolerances import rounding_rtol


def test_sums_by_hand():
    fp = fingerprint([("m.q.weight", torch.tensor([[1.0, -2.0], [0.5, 4.0]])), ("m.n.weight", torch.tensor([3.0]))])
    sig = sigma(0, 4, "cpu").tolist()
    assert fp["m.n.weight"] == TensorPrint((1,), 3.0, 3.0, 3.0 * sig[0])
    q = fp["m.q.weight"]
    assert (q.shape, q.s, q.a) == ((2, 2), 3.5, 7.5)
    assert q.p == sum(s * x for s, x in zip(sig, [1.0, -2.0, 0.5, 4.0]))
    assert probe_columns(2) == [0, 1] and q.q == q.p  # a 2-wide tensor: every column is a probe column


def _llama_like(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"m.layers.0.mlp.gate_proj.weight": torch.randn(24, 16, generator=g),
            "m.layers.0.mlp.up_proj.weight": torch.randn(24, 16, generator=g),
            "m.layers.0.attn.o_proj.weight": torch.randn(16, 16, generator=g),
            "m.layers.0.attn.k_proj.weight": torch.randn(8, 16, generator=g),
            "m.norm.weight": torch.randn(16, generator=g)}


def test_swapped_same_shape_tensors_and_transposed_ones_fail_the_sync_check():
    weights = _llama_like()
    sent = fingerprint(weights.items())
    assert differences(sent, fingerprint(weights.items())) == []
    gate, up = "m.layers.0.mlp.gate_proj.weight", "m.layers.0.mlp.up_proj.weight"
    swapped = dict(weights, **{gate: weights[up], up: weights[gate]})  # a loader that mixes up gate and up
    assert [p.split(":")[0] for p in differences(sent, fingerprint(swapped.items()))] == [gate, up]
    o = "m.layers.0.attn.o_proj.weight"
    square = dict(weights, **{o: weights[o].t()})  # square: same shape, same sums, other positions
    problems = differences(sent, fingerprint(square.items()))
    assert len(problems) == 1 and problems[0].startswith(f"{o}: sent sum")
    k = "m.layers.0.attn.k_proj.weight"
    wide = dict(weights, **{k: weights[k].t()})
    assert differences(sent, fingerprint(wide.items())) == [f"{k}: sent with shape [8, 16], the engine holds shape "
                                                            "[16, 8]"]
    with pytest.raises(SyncMismatch, match=rf"(?s)vLLM engine does not serve.*\n  {o}: sent sum"):
        raise SyncMismatch("vLLM", problems)


def test_a_stale_tensor_and_a_missing_one_are_named():
    weights = _llama_like()
    sent = fingerprint(weights.items())
    k = "m.layers.0.attn.k_proj.weight"
    stale = dict(weights, **{k: weights[k] - 1e-4})  # the engine missed k's update of 1e-4
    assert [p.split(":")[0] for p in differences(sent, fingerprint(stale.items()))] == [k]
    del stale[k]
    assert differences(sent, fingerprint(stale.items())) == [f"{k}: sent, but the engine holds no such weights"]
    assert differences(fingerprint(stale.items()), sent) == [
        f"{k}: the engine holds it, but this sync did not send it (it keeps its old value)"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_chunked_fingerprint_equals_a_float64_reference_beyond_one_chunk(dtype):
    torch.manual_seed(0)
    t = (torch.randn(3 * CHUNK // 512 + 3, 512) + 0.1).to(dtype)  # three chunks and a part
    wide = t.double().view(-1)
    sigma_k = sigma(0, wide.numel(), "cpu")  # the whole index space at once: the reference may be large
    ref_s, ref_a, ref_p = wide.sum().item(), wide.abs().sum().item(), (wide * sigma_k).sum().item()
    tol = rounding_rtol(torch.float64, wide.numel()) * ref_a  # same values, float64 sums in another order
    for print_ in (fingerprint([("w", t)])["w"], fingerprint([("w", t.t().contiguous().t())])["w"]):  # + strided
        assert abs(print_.s - ref_s) <= tol and abs(print_.a - ref_a) <= tol and abs(print_.p - ref_p) <= tol
    block = t.double()[:, probe_columns(512)]
    ref_q = (block.reshape(-1) * sigma(0, block.numel(), "cpu")).sum().item()
    assert abs(print_.q - ref_q) <= rounding_rtol(torch.float64, block.numel()) * block.abs().sum().item()


class _LargestAllocation(TorchDispatchMode):
    """Records the element count of the largest tensor any torch operation returns (`largest64`: of the largest
    float64 one), views of `_inputs` (storage pointers) excepted."""

    def __init__(self):
        super().__init__()
        self.largest = self.largest64 = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for value in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(value, torch.Tensor) and value.untyped_storage().data_ptr() not in self._inputs:
                self.largest = max(self.largest, value.numel())
                if value.dtype == torch.float64:
                    self.largest64 = max(self.largest64, value.numel())
        return out


@pytest.mark.parametrize("contiguous", [True, False])
def test_the_fingerprint_allocates_one_chunk_at_a_time_never_the_whole_tensor(contiguous):
    t = torch.randn(8 * CHUNK // 1024, 1024, dtype=torch.bfloat16)
    t = t if contiguous else t.t()  # a strided view is copied a block of rows at a time
    fingerprint([("w", t)])  # builds the device's cached sign pattern (at most BLOCK, once): not per tensor
    mode = _LargestAllocation()
    mode._inputs = {t.untyped_storage().data_ptr()}  # views of the input are no allocation
    with mode:  # one thread (the mode sees its own thread's operations); each pool thread works the same way
        fingerprint([("w", t)], threads=1)
    assert 0 < mode.largest <= CHUNK, f"an operation made a tensor of {mode.largest} elements (chunk {CHUNK})"


def test_the_vllm_worker_fingerprints_fused_and_padded_weights_one_chunk_at_a_time():
    """The engine's side (vllm_worker.served_fingerprint, right after the KV cache wakes): fused parts and a padded
    vocabulary are views reduced chunk by chunk; no float64 copy, or any other, of a whole tensor."""
    from astuner.engine.vllm_worker import served_fingerprint

    model = torch.nn.Module()
    model.packed_modules_mapping = {"gate_up_proj": ["gate_proj", "up_proj"]}
    model.mlp = torch.nn.Module()
    model.mlp.gate_up_proj = torch.nn.Linear(1024, 2048, bias=False, dtype=torch.bfloat16)  # parts of 4 chunks
    model.mlp.gate_up_proj.output_sizes = [1024, 1024]
    model.embed = torch.nn.Embedding(1088, 1024, dtype=torch.bfloat16)  # 1024 real rows and 64 of padding
    model.embed.org_vocab_size = 1024
    served_fingerprint(model)  # builds the device's cached sign pattern (at most BLOCK, once): not per tensor
    mode = _LargestAllocation()
    mode._inputs = {p.untyped_storage().data_ptr() for p in model.parameters()}
    with mode:
        prints = served_fingerprint(model)
    assert sorted(prints) == ["embed.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight"]
    assert prints["embed.weight"].shape == (1024, 1024)
    assert 0 < mode.largest64 <= CHUNK and mode.largest <= CHUNK, (mode.largest64, mode.largest, CHUNK)


def test_fingerprinting_a_float64_tensor_leaves_it_unchanged():
    t = torch.tensor([[-1.0, 2.0], [-3.0, 4.0]], dtype=torch.float64)  # its float64 chunk is a view of it
    fingerprint([("w", t)])
    assert t.tolist() == [[-1.0, 2.0], [-3.0, 4.0]]


def test_the_cpu_and_accelerator_chunkings_agree_with_the_definition_beyond_one_block():
    """The chunk size is not part of the definition: a CPU trainer and a GPU engine may compare their prints.
    Rows of 1027 elements: a strided tensor's chunks straddle the block boundary."""
    assert chunk_elements(torch.device("cpu")) == CHUNK and chunk_elements(torch.device("cuda", 0)) == BLOCK
    torch.manual_seed(0)
    t = torch.randn(BLOCK // 1027 + 3, 1027)
    wide = t.double().view(-1)
    ref = (wide.sum().item(), wide.abs().sum().item(), (wide * sigma(0, wide.numel(), "cpu")).sum().item())
    tol = rounding_rtol(torch.float64, wide.numel()) * ref[1]
    strided = t.t().contiguous().t()
    for got in (signed_sums(t), signed_sums(t, BLOCK), signed_sums(strided), signed_sums(strided, BLOCK)):
        assert all(abs(x - y) <= tol for x, y in zip(got, ref)), (got, ref)


@pytest.mark.parametrize("chunk", [4096, CHUNK, 16])
def test_probe_columns_taken_from_each_chunk_equal_the_definition(chunk):
    """The probe columns B = W[:, J] are gathered from each chunk's whole rows (4096: 204 rows a chunk, not a
    multiple of the row), or apart where a row is longer than the chunk (16); B (262,149 x 16) is longer than a
    BLOCK, so its sign weights w change within it (300 rows where chunks are tiny). Strided and contiguous alike."""
    torch.manual_seed(0)
    t = torch.randn(BLOCK // PROBE_COLUMNS + 5 if chunk > 20 else 300, 20)
    block = t.double()[:, probe_columns(20)].reshape(-1)
    ref_q, ref_qa = (block * sigma(0, block.numel(), "cpu")).sum().item(), block.abs().sum().item()
    wide = t.double().view(-1)
    ref = (wide.sum().item(), wide.abs().sum().item(), (wide * sigma(0, wide.numel(), "cpu")).sum().item())
    for w in (t, t.t().contiguous().t()):
        got = tensor_print(w, chunk)
        assert abs(got.q - ref_q) <= rounding_rtol(torch.float64, block.numel()) * ref_qa, (got.q, ref_q)
        assert abs(got.qa - ref_qa) <= rounding_rtol(torch.float64, block.numel()) * ref_qa
        tol = rounding_rtol(torch.float64, wide.numel()) * ref[1]
        assert all(abs(x - y) <= tol for x, y in zip((got.s, got.a, got.p), ref)), ((got.s, got.a, got.p), ref)


@pytest.mark.parametrize("shape", [(0, 4), (4, 0), (0,), (0, 3, 2), ()])
def test_empty_and_scalar_tensors_have_prints(shape):
    t = torch.ones(shape)
    got = fingerprint([("w", t)], threads=2)["w"]
    assert got.shape == shape and got.s == got.a == float(t.sum())
    assert (got.q is None) == (len(shape) != 2 or not t.numel())


def test_two_whole_blocks_swapped_change_the_print():
    a, b = torch.randn(BLOCK), torch.randn(BLOCK)
    sent = fingerprint([("w", torch.cat([a, b]))])
    assert [p.split(":")[0] for p in differences(sent, fingerprint([("w", torch.cat([b, a]))]))] == ["w"]


class _Ops(TorchDispatchMode):
    """Counts the torch operations run, by name."""

    def __init__(self):
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.__name__)
        return func(*args, **(kwargs or {}))


def test_each_chunk_costs_a_few_operations_and_the_signs_are_computed_once_per_device():
    chunks = 6
    t = torch.randn(chunks * CHUNK)
    fingerprint([("w", t)])
    with _Ops() as ops:
        fingerprint([("w", t)])
    assert "arange" not in " ".join(ops.names), "the sign pattern was recomputed instead of taken from the cache"
    assert len(ops.names) <= 12 * chunks, f"{len(ops.names)} operations for {chunks} chunks: {ops.names[:40]}"


def test_the_vllm_worker_reduces_a_tied_parameter_once(monkeypatch):
    from astuner.engine import fingerprint as fingerprint_module
    from astuner.engine.vllm_worker import served_fingerprint

    reduced = []
    real = fingerprint_module.tensor_print
    monkeypatch.setattr(fingerprint_module, "tensor_print", lambda t: reduced.append(t.data_ptr()) or real(t))
    model = torch.nn.Module()
    model.embed = torch.nn.Embedding(32, 8)
    model.norm = torch.nn.LayerNorm(8, bias=False)
    model.lm_head = torch.nn.Linear(8, 32, bias=False)
    model.lm_head.weight = model.embed.weight  # tied: the same Parameter, found again under the head
    prints = served_fingerprint(model)
    assert sorted(prints) == ["embed.weight", "norm.weight"]
    assert sorted(reduced) == sorted({p.data_ptr() for p in model.parameters()}), "a parameter was reduced twice"


def test_a_sync_that_compares_no_changed_weight_is_not_verified(caplog):
    """LoRA on an engine that cannot read its linear layers back: only frozen weights (norms, embeddings) would
    be compared, so a passing check proves nothing and the sync is reported unverified, said once."""
    from astuner.engine.vllm_engine import VLLMEngine

    base = _llama_like()
    first = fingerprint(base.items())
    trained = dict(base, **{n: w + 1e-3 for n, w in base.items() if n.endswith("_proj.weight")})  # merged LoRA
    sent = fingerprint(trained.items())
    assert changed(first, sent) == {n for n in base if n.endswith("_proj.weight")}
    opaque = {n: TensorPrint(e.shape, None, None, None) if n.endswith("_proj.weight") else e for n, e in sent.items()}
    assert differences(sent, opaque) == [] and compared(sent, opaque) == {"m.norm.weight"}

    eng = VLLMEngine.__new__(VLLMEngine)
    eng._said_unseen = False
    with caplog.at_level(logging.WARNING, logger="astuner.engine.vllm_engine"):
        assert eng._judge_coverage(changed(first, sent), compared(sent, opaque)) is False
        assert eng._judge_coverage(changed(first, sent), compared(sent, opaque)) is False
    assert [r.getMessage() for r in caplog.records if "not verified" in r.getMessage()] == [
        "weight sync not verified: none of the 4 tensors this sync changed can be read back from the engine (1 "
        "others were compared and match), so sync/verified is 0. The engine holds them in a form astuner cannot "
        "read; compare logprobs of engine and trainer to be sure."]
    read_back = {n: TensorPrint(e.shape, None, None, None, e.q, e.qa) for n, e in sent.items()}  # probe columns
    assert eng._judge_coverage(changed(first, sent), compared(sent, read_back)) is True
    assert eng._judge_coverage(changed(sent, sent), compared(sent, opaque)) is True  # nothing changed, nothing to see


class _Packed(torch.nn.Module):
    """A linear layer as vLLM's CPU backend leaves it: the weight packed away, an empty parameter, and the kernel
    that computes with the packed copy."""

    def __init__(self, weight: torch.Tensor, output_sizes=None, org_vocab_size=None, kernel=True):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(0), requires_grad=False)
        self.input_size_per_partition = weight.shape[1]
        packed = weight.clone()
        if kernel:
            self.cpu_linear = lambda x, w, bias: x @ packed.t()
        if output_sizes:
            self.output_sizes = output_sizes
        if org_vocab_size:
            self.org_vocab_size = org_vocab_size


def test_the_vllm_worker_reads_fused_packed_and_padded_weights_back_under_checkpoint_names():
    from astuner.engine.vllm_worker import served_fingerprint

    w = _llama_like()
    gate, up = "m.layers.0.mlp.gate_proj.weight", "m.layers.0.mlp.up_proj.weight"
    embed = torch.randn(50, 16)

    def engine(gate_up: torch.Tensor, head_rows: torch.Tensor, kernel: bool = True):
        model = torch.nn.Module()
        model.packed_modules_mapping = {"gate_up_proj": ["gate_proj", "up_proj"]}
        model.m = torch.nn.Module()
        model.m.norm = torch.nn.Module()
        model.m.norm.weight = torch.nn.Parameter(w["m.norm.weight"].clone())
        model.m.embed = torch.nn.Module()  # a vocabulary padded to 64 rows, and a tied head packed separately
        model.m.embed.weight = torch.nn.Parameter(torch.cat([embed, torch.zeros(14, 16)]))
        model.m.embed.org_vocab_size = 50
        model.m.layers = torch.nn.ModuleList([torch.nn.Module()])
        model.m.layers[0].mlp = torch.nn.Module()
        model.m.layers[0].mlp.gate_up_proj = _Packed(gate_up, output_sizes=[24, 24], kernel=kernel)
        model.lm_head = _Packed(torch.cat([head_rows, torch.zeros(14, 16)]), org_vocab_size=50)
        model.lm_head.weight = model.m.embed.weight  # tied: the same parameter
        return model

    sent = fingerprint([(gate, w[gate]), (up, w[up]), ("m.norm.weight", w["m.norm.weight"]), ("m.embed.weight", embed)])
    served = served_fingerprint(engine(torch.cat([w[gate], w[up]]), embed))
    assert differences(sent, served) == [] and compared(sent, served) == set(sent)
    swapped = served_fingerprint(engine(torch.cat([w[up], w[gate]]), embed))
    assert [p.split(":")[0] for p in differences(sent, swapped)] == [gate, up]
    stale_head = served_fingerprint(engine(torch.cat([w[gate], w[up]]), embed - 1e-3))  # head not re-packed
    assert [p.split(":")[0] for p in differences(sent, stale_head)] == ["m.embed.weight"]
    unreadable = served_fingerprint(engine(torch.cat([w[up], w[gate]]), embed, kernel=False))  # no kernel to ask
    assert differences(sent, unreadable) == [] and compared(sent, unreadable) == {"m.norm.weight", "m.embed.weight"}


def test_the_hf_engine_verifies_each_sync_and_catches_a_skipped_tensor(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    from astuner.engine.hf_engine import HFEngine

    class SkipsOne(HFEngine):  # a loader that silently drops one tensor
        def _copy_in(self, name, param, value):
            if name != "model.layers.1.mlp.down_proj.weight":
                super()._copy_in(name, param, value)

    new = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    with torch.no_grad():
        for p in new.parameters():
            p.add_(1e-3)  # one training step's worth of change everywhere
    engine = HFEngine(str(tiny_model_dir), device="cpu")
    engine.load_weights(new.named_parameters())
    assert engine.last_sync.verified == 1.0 and engine.last_sync.verify_s > 0
    faulty = SkipsOne(str(tiny_model_dir), device="cpu")
    with pytest.raises(SyncMismatch, match=r"(?s)hf engine does not serve.*\n  model.layers.1.mlp.down_proj.weight: "
                                           r"sent sum") as info:
        faulty.load_weights(new.named_parameters())
    assert "model.layers.0" not in str(info.value)  # only the tensor that missed its update


def test_the_fingerprints_threads_are_the_cores_unless_astuner_fingerprint_threads_caps_them(monkeypatch, tmp_path):
    """Cores shared with other work (the tests' workers, another job) cap the sums' threads by the variable; a Ray
    actor's OMP_NUM_THREADS=1 does not; a bad value is refused when the run starts, before its folder is made."""
    from astuner.backbone.ray_cluster import worker_env
    from astuner.engine import fingerprint as fp
    from astuner.errors import UserError
    from astuner.launch import run

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.delenv(fp.THREADS_ENV, raising=False)
    assert fp.fingerprint_threads() == max(1, min(16, len(os.sched_getaffinity(0))))
    monkeypatch.setenv(fp.THREADS_ENV, "3")
    assert fp.fingerprint_threads() == 3 and fp.FingerprintBuilder()._threads == 3
    assert worker_env()[fp.THREADS_ENV] == "3"  # a joined cluster's actors get it too
    for bad in ("0", "two", "-1"):
        monkeypatch.setenv(fp.THREADS_ENV, bad)
        with pytest.raises(UserError, match=f"ASTUNER_FINGERPRINT_THREADS={bad!r}.*1 or more"):
            fp.fingerprint_threads()
        with pytest.raises(UserError, match="ASTUNER_FINGERPRINT_THREADS"):
            run(str(tmp_path / "absent.yaml"), "debug", [f"astuner.experiment_dir={tmp_path / 'run'}"])
    assert not (tmp_path / "run").exists()


def test_host_tensors_are_summed_with_torch_threads_raised_and_put_back(monkeypatch):
    """A sync's host tensors are summed with torch running the builder's threads per kernel (a Ray actor's torch runs
    one), put back after each tensor; the prints agree with one thread's and keep the order the tensors came in."""
    from astuner.engine import fingerprint as fp

    gen = torch.Generator().manual_seed(0)
    tensors = [(f"t{i}", torch.randn(300 + 37 * i, 129, generator=gen).to(torch.bfloat16)) for i in range(12)]
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        serial = fp.fingerprint(tensors, threads=1)
        seen: list[int] = []
        real = fp.tensor_print
        monkeypatch.setattr(fp, "tensor_print", lambda t: seen.append(torch.get_num_threads()) or real(t))
        got = fp.fingerprint(tensors, threads=3)
        assert torch.get_num_threads() == 1, "the builder left torch's thread count raised"
    finally:
        torch.set_num_threads(before)
    assert seen == [3] * len(tensors)
    assert list(got) == [n for n, _ in tensors] and differences(serial, got) == []
    torch.set_num_threads(1)
    try:  # put back when the sums fail too
        monkeypatch.setattr(fp, "tensor_print", lambda t: 1 / 0)
        with pytest.raises(ZeroDivisionError):
            fp.fingerprint(tensors, threads=3)
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
