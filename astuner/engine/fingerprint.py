"""Weight fingerprints: every sync checks that the engine now serves what the trainer sent.

A sync that silently drops a tensor (a name the engine's loader does not know, a LoRA layer left unmerged), swaps
two tensors or loads one transposed leaves the engine sampling from a policy nobody trains, and nothing else would
notice for weeks. So after each sync the engine fingerprints the weights it holds and compares them with the
fingerprint of the tensors it was handed (cast to its own dtype, as it stores them).

The fingerprint holds one entry per tensor, keyed by its checkpoint name (an engine that fuses q/k/v or gate/up
splits them back, see `vllm_worker.py`): its shape and, over its n elements x_k in row-major order,
    S = sum_k x_k        A = sum_k |x_k|        P = sum_k sigma(k) x_k
with sigma(k) = h(k mod BLOCK) w(k div BLOCK): h(j) = +-1 a fixed pseudo-random sign (bit 31 of j * 2654435761,
Knuth's multiplicative hash) and w(b) in (1/2, 1] a pseudo-random weight of each BLOCK of 2^22 elements
(w(0) = 1), so |P| <= A and two whole blocks swapped change P too. h repeats every BLOCK elements, so each
device computes it once and keeps it (`_pattern`): a chunk's signed sum is one dot product with a slice of it.
Name and shape catch a swap of two tensors and a transposed non-square one; P catches a transposed square
tensor, rows or columns swapped within a tensor (sums do not).
For a 2-D tensor W (rows x cols) it also holds Q, the same signed sum over a fixed sample of its columns
    B = W[:, J],  J = {floor((2t + 1) cols / 2m) : t < m},  m = min(16, cols),
    Q = sum_{i,t} sigma(i m + t) B[i, t]       QA = sum |B|,
which an engine can read back exactly from a layer whose weights it keeps only in packed form (vLLM's CPU
backend): multiplying the layer by m one-hot rows returns those columns, each output one exact product.

Cost and memory: each tensor is reduced one chunk at a time (host tensors with torch's threads raised to the
cores' count, `FingerprintBuilder`), copied into a float64 buffer on its own device, never whole; a chunk is
`chunk_elements(device)`: 2^20 elements on a CPU (8 MiB of float64), BLOCK = 2^22 on an accelerator (32 MiB), where
each chunk costs a handful of kernel launches (about 1,700 chunks for a 7B model). In flight: that buffer (one,
reused for each chunk), a contiguous copy of a chunk of a strided tensor, and the cached h of at most BLOCK float64
per device (32 MiB, kept; built a chunk at a time). The chunk size is not part of the definition: both sides sum
the same values (the engine's dtype, exact in float64), so they differ by float64 rounding in another order only:
at most rtol(n) = C * eps(float64) * sqrt(n) relative to A (tests/tolerances.py's probabilistic bound). A tensor
whose update is below the engine dtype's resolution is unchanged, and harmless.

A check that compared only weights this sync did not change (frozen ones, where the changed ones cannot be read
back) proves nothing: `changed` and `compared` let the engine report such a sync unverified.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterable, Iterator

CHUNK = 1 << 20  # elements reduced at a time on a CPU: 8 MiB of float64 (the fastest measured, 1 to 16 threads)
BLOCK = 1 << 22  # the period of h (part of sigma's definition), and the chunk on an accelerator: 32 MiB of float64
PROBE_COLUMNS = 16
C = 8.0  # the constant of tests/tolerances.py: a few roundings per term
EPS64 = 2.0 ** -52
_HASH = 2654435761  # < 2^32, so j * _HASH < 2^54 for j < BLOCK: no int64 overflow
_PATTERNS: dict[str, object] = {}  # device -> h(0 .. len-1) as float64, grown on demand up to BLOCK


def rtol(n: int) -> float:
    """Relative (to A) tolerance of two float64 sums of the same n values taken in different orders."""
    return C * EPS64 * math.sqrt(max(n, 1))


@dataclass(frozen=True)
class TensorPrint:
    """One tensor's fingerprint; `s`, `a`, `p` are None where the engine cannot read the whole tensor, `q`, `qa`
    None for tensors that are not 2-D."""

    shape: tuple[int, ...]
    s: float | None
    a: float | None
    p: float | None
    q: float | None = None
    qa: float | None = None

    @property
    def n(self) -> int:
        return math.prod(self.shape)


Fingerprint = dict[str, TensorPrint]
UNREADABLE = TensorPrint((), None, None, None)  # an engine holds the tensor but cannot read it: not compared


def from_wire(prints: dict) -> Fingerprint:
    """A fingerprint back from an RPC, which carries each TensorPrint as a dict (vLLM's collective_rpc)."""
    return {name: v if isinstance(v, TensorPrint) else TensorPrint(**dict(v, shape=tuple(v["shape"])))
            for name, v in prints.items()}


def probe_columns(cols: int) -> list[int]:
    """The columns J whose values Q sums (evenly spread, the same on every side for a given width)."""
    m = min(PROBE_COLUMNS, cols)
    return [((2 * t + 1) * cols) // (2 * m) for t in range(m)]


def chunk_elements(device) -> int:
    """Elements reduced at a time on `device`: few, large chunks where each operation is a kernel launch."""
    return CHUNK if str(device).startswith("cpu") else BLOCK


def _h(lo: int, hi: int, device):
    """h(j) for j in [lo, hi), as float64 +-1."""
    import torch

    j = torch.arange(lo, hi, dtype=torch.int64, device=device)
    return 1.0 - 2.0 * ((j * _HASH) >> 31 & 1).to(torch.float64)


def _w(block: int) -> float:
    """w(b) in (1/2, 1], w(0) = 1 (Python integers: no overflow for any b)."""
    return 1.0 - ((block * _HASH) % (1 << 32)) / float(1 << 33)


def sigma(start: int, count: int, device):
    """sigma(k) for k in [start, start + count), as float64: the definition, computed directly (a reference)."""
    import torch

    k = torch.arange(start, start + count, dtype=torch.int64)
    weights = torch.tensor([_w(b) for b in range(start // BLOCK, (start + count - 1) // BLOCK + 1)],
                           dtype=torch.float64) if count else torch.ones(0, dtype=torch.float64)
    h = 1.0 - 2.0 * ((k % BLOCK * _HASH) >> 31 & 1).to(torch.float64)
    return (h * weights[k // BLOCK - start // BLOCK]).to(device)


def _pattern(length: int, device):
    """h(0 .. length-1) on `device`, computed once per device (grown by powers of two, at most BLOCK long) and
    kept, so a chunk's signs are a slice of it rather than ~8 operations of their own."""
    import torch

    key = str(device)
    cached = _PATTERNS.get(key)
    if cached is None or cached.numel() < length:
        size = min(BLOCK, 1 << max(length - 1, 1).bit_length())
        cached = torch.empty(size, dtype=torch.float64, device=device)
        for lo in range(0, size, CHUNK):  # built a chunk at a time: its int64 temporaries stay small
            cached[lo : lo + CHUNK] = _h(lo, min(lo + CHUNK, size), device)
        _PATTERNS[key] = cached
    return cached


def _chunks(tensor, chunk: int, start: int = 0) -> Iterator[tuple[int, object]]:
    """(flat index of its first element, 1-D chunk of at most `chunk` elements) over `tensor` in row-major order,
    a matrix's chunks whole rows where a row fits in one; a non-contiguous tensor is copied one bounded block of
    rows at a time, never whole."""
    row = max(1, math.prod(tensor.shape[1:]))  # elements of one row (1 for a vector)
    if tensor.is_contiguous():  # a matrix in whole rows where a row fits (its probe columns come from the chunk)
        flat, step = tensor.view(-1), chunk // row * row if tensor.dim() == 2 and row <= chunk else chunk
        for lo in range(0, flat.numel(), step):
            yield start + lo, flat[lo : lo + step]
        return
    if row > chunk:  # one row alone is too big to copy: descend into it
        for i in range(tensor.shape[0]):
            yield from _chunks(tensor[i], chunk, start + i * row)
        return
    step = max(1, chunk // row)
    for lo in range(0, tensor.shape[0], step):
        yield start + lo * row, tensor[lo : lo + step].contiguous().view(-1)


def _signed_sum(wide, start: int):
    """sum_k sigma(start + k) wide[k] (a 0-d tensor): one dot product per BLOCK the chunk touches (at most two,
    since a chunk is at most BLOCK long)."""
    import torch

    total, pos, n = None, 0, wide.numel()
    while pos < n:
        offset = (start + pos) % BLOCK
        take = min(n - pos, BLOCK - offset)
        h = _pattern(offset + take, wide.device)[offset : offset + take]
        part = torch.dot(wide if take == n else wide[pos : pos + take], h) * _w((start + pos) // BLOCK)
        total = part if total is None else total + part
        pos += take
    return total


def _chunk_size(tensor, chunk: int | None) -> int:
    """`chunk` (elements), else the device's `chunk_elements`; at most BLOCK."""
    return min(chunk or chunk_elements(tensor.device), BLOCK)


def _reduce(tensor, chunk: int, probe: bool) -> list[float]:
    """[S, A, P] of `tensor`, and with `probe` [.., Q, QA] of its probe columns (a 2-D tensor whose rows fit in a
    chunk: each chunk is whole rows, so B's rows are gathered from the chunk in cache, not by a strided pass over
    the tensor), reduced chunk by chunk in float64 on the tensor's own device. The tensor is only read: each chunk
    is copied into a float64 buffer of the call's own, reused for every chunk (a fresh allocation per chunk costs
    page faults: it halved the throughput on a 2-core CPU), and |x| is taken in place once S, P (and B) are read
    (vector_norm(ord=1) was 2.5x slower than abs_ and sum)."""
    import torch

    tensor = tensor.detach()
    acc = torch.zeros(5 if probe else 3, dtype=torch.float64, device=tensor.device)
    scratch = torch.empty(min(chunk, tensor.numel()), dtype=torch.float64, device=tensor.device)
    if probe:
        cols = tensor.shape[1]
        index = torch.tensor(probe_columns(cols), device=tensor.device)
    for start, part in _chunks(tensor, chunk):
        wide = scratch if part.numel() == scratch.numel() else scratch[: part.numel()]
        wide.copy_(part)
        terms = [wide.sum(), None, _signed_sum(wide, start)]
        if probe:  # B's rows of this chunk: B's flat index of its first entry is (first row) x m
            block = wide.view(-1, cols).index_select(1, index).view(-1)
            terms += [_signed_sum(block, start // cols * index.numel()), block.abs_().sum()]
        terms[1] = wide.abs_().sum()
        acc += torch.stack(terms)
    return acc.tolist()  # one device sync per tensor, not per chunk


def signed_sums(tensor, chunk: int | None = None) -> tuple[float, float, float]:
    """(S, A, P) of `tensor`, reduced chunk by chunk in float64 on the tensor's own device; `chunk` (elements)
    defaults to the device's `chunk_elements` and changes the result by rounding only."""
    s, a, p = _reduce(tensor, _chunk_size(tensor, chunk), probe=False)
    return s, a, p


def column_sums(columns) -> tuple[float, float]:
    """(Q, QA) of the probe columns B (rows x m), as gathered by `probe_block` or read back by an engine."""
    _, a, p = signed_sums(columns)
    return p, a


def probe_block(tensor):
    """B = W[:, J] of a 2-D tensor (rows x m, a small copy)."""
    return tensor.detach()[:, probe_columns(tensor.shape[1])]


def tensor_print(tensor, chunk: int | None = None) -> TensorPrint:
    chunk = _chunk_size(tensor, chunk)
    if tensor.dim() != 2 or not tensor.numel():
        return TensorPrint(tuple(tensor.shape), *_reduce(tensor, chunk, probe=False))
    if tensor.shape[1] <= chunk:  # the probe columns from each chunk's rows
        s, a, p, q, qa = _reduce(tensor, chunk, probe=True)
    else:  # rows longer than a chunk: gathered apart
        (s, a, p), (q, qa) = _reduce(tensor, chunk, probe=False), column_sums(probe_block(tensor))
    return TensorPrint(tuple(tensor.shape), s, a, p, q, qa)


class FingerprintBuilder:
    """Accumulates a fingerprint one tensor at a time (a sync streams its tensors).

    A tensor in host memory is summed with torch running `threads` threads per kernel (raised for the sums, then
    put back): a Ray actor's torch runs one (a 7B sync's fingerprint took about 96 s on one core), and a pool of
    Python threads, one tensor each, stopped at 2.6x on 16 cores (each kernel call takes the GIL: about 10 s for a
    7B model, against 1.4 s for its S, A and P this way). A tensor on an accelerator is summed on its device."""

    def __init__(self, threads: int | None = None) -> None:
        self._prints: Fingerprint = {}
        self._threads = fingerprint_threads() if threads is None else threads

    def add(self, name: str, tensor) -> None:
        with torch_threads(self._threads if tensor.device.type == "cpu" else 1):
            self._prints[name] = tensor_print(tensor)

    def result(self) -> Fingerprint:
        return dict(self._prints)


@contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """torch's threads per kernel raised to at least `n` inside the block, and put back after it. The count is
    process-wide: another thread whose first torch call falls inside the block keeps `n` (a sync's other threads
    have made theirs long before)."""
    import torch

    before = torch.get_num_threads()
    if n > before:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        if n > before:
            torch.set_num_threads(before)


THREADS_ENV = "ASTUNER_FINGERPRINT_THREADS"


def fingerprint_threads() -> int:
    """torch threads for summing host tensors: ASTUNER_FINGERPRINT_THREADS where set (cores shared with other
    work: OpenMP threads beyond a process's share of the cores wait by spinning, and a fingerprint beside a busy
    process took 2.7x as much CPU on 2 threads as on 1), else the cores this process may run on, at most 16.
    OMP_NUM_THREADS is not read: Ray sets it to 1 in every actor, where the sums would then take one core."""
    import os

    given = os.environ.get(THREADS_ENV, "").strip()
    if given:
        try:
            threads = int(given)
        except ValueError:
            threads = 0
        if threads < 1:
            from astuner.errors import UserError

            raise UserError(f"{THREADS_ENV}={given!r}: give a whole number of threads, 1 or more (or unset it "
                             "to use the cores this process may run on)")
        return threads
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 1
    return max(1, min(16, cores))


def fingerprint(named_tensors: Iterable[tuple[str, object]], threads: int | None = None) -> Fingerprint:
    builder = FingerprintBuilder(threads)
    for name, tensor in named_tensors:
        builder.add(name, tensor)
    return builder.result()


def _close(x: float, y: float, scale: float, n: int) -> bool:
    return abs(x - y) <= rtol(n) * max(scale, EPS64)


def _whole_compared(sent: TensorPrint, served: TensorPrint) -> bool:
    return served.s is not None and sent.s is not None


def _columns_compared(sent: TensorPrint, served: TensorPrint) -> bool:
    return served.q is not None and sent.q is not None


def differences(sent: Fingerprint, served: Fingerprint) -> list[str]:
    """The tensors whose served weights are not the ones sent, each with both fingerprints. A tensor the engine
    holds but the sync left out keeps its old value: named too (every sync sends every weight)."""
    out = [f"{name}: the engine holds it, but this sync did not send it (it keeps its old value)"
           for name in sorted(served) if name not in sent]
    for name, t in sorted(sent.items()):
        e = served.get(name)
        if e is None:
            out.append(f"{name}: sent, but the engine holds no such weights")
        elif e == UNREADABLE:
            continue
        elif e.shape != t.shape:
            out.append(f"{name}: sent with shape {list(t.shape)}, the engine holds shape {list(e.shape)}")
        elif _whole_compared(t, e) and not all(_close(x, y, t.a, t.n) for x, y in ((e.s, t.s), (e.a, t.a),
                                                                                 (e.p, t.p))):
            out.append(f"{name}: sent sum {t.s:.6g} (|.| {t.a:.6g}, signed {t.p:.6g}), engine holds sum "
                       f"{e.s:.6g} (|.| {e.a:.6g}, signed {e.p:.6g})")
        elif _columns_compared(t, e) and not all(_close(x, y, t.qa, t.shape[0] * PROBE_COLUMNS)
                                                 for x, y in ((e.q, t.q), (e.qa, t.qa))):
            out.append(f"{name}: sent sum {t.q:.6g} over its probe columns (|.| {t.qa:.6g}), engine holds "
                       f"{e.q:.6g} (|.| {e.qa:.6g})")
    return out


def compared(sent: Fingerprint, served: Fingerprint) -> set[str]:
    """The sent tensors whose values the engine's fingerprint could be compared with (wholly or by columns)."""
    return {name for name, t in sent.items() if name in served and served[name].shape == t.shape
            and (_whole_compared(t, served[name]) or _columns_compared(t, served[name]))}


def changed(previous: Fingerprint | None, sent: Fingerprint) -> set[str]:
    """The tensors this sync sent with other values than the last one (all of them on the first sync)."""
    if previous is None:
        return set(sent)
    return {name for name, t in sent.items() if name not in previous or previous[name] != t}


class SyncMismatch(RuntimeError):
    """The engine does not serve the weights the trainer sent."""

    def __init__(self, engine: str, problems: list[str]) -> None:
        shown = "\n  ".join(problems[:8]) + (f"\n  ... and {len(problems) - 8} more" if len(problems) > 8 else "")
        super().__init__(
            f"weight sync not verified: the {engine} engine does not serve what the trainer sent, so rollouts would "
            f"sample from a policy that is not trained. Differing weights:\n  {shown}\n"
            "A name the engine's loader does not know (a renamed or LoRA-wrapped parameter) is the usual cause.")
