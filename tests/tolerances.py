"""Numerical tolerances derived from the dtype and the size of the reduction, never from one machine's result.

Two computations of the same quantity that differ only in the order of their floating-point operations (another
CPU's kernels, another micro-batch split, another shard, a chunked head) differ by rounding alone. A sum of n
terms in a dtype with machine epsilon eps is off by at most about n * eps * sum|terms| (worst case) and in
practice by about sqrt(n) * eps * sum|terms| (the probabilistic bound: rounding errors are independent and add
like a random walk). So a result is compared norm-wise (an element-wise relative test means nothing for entries
near zero) against

    rtol(dtype, n) = C * eps(dtype) * sqrt(n),    C = 8,

where n is the longest reduction the value passes through (the vocabulary's log-sum-exp for logprobs and their
gradients). C covers the few roundings per term and the chained layers. A real defect (a lost micro-batch, a
wrong scale, a missing shard) moves a result by percents, orders of magnitude above these bounds; the tests
also run under `ATEN_CPU_CAPABILITY=avx2` (other kernels, other reduction orders) in CI.

Hand-computed values of a few terms (tests/test_loss.py and the like) keep absolute tolerances near 1e-6,
about 8 eps(fp32) for values of order one: no long reduction is involved there.

Adam adds one effect no rounding bound covers: its first steps move a weight by about lr * sign(gradient), so
a gradient entry that is itself at rounding level may flip sign between two orders and move its weight by up to
2 * lr per step. `assert_adam_close` allows that for a small fraction of entries and bounds it.
"""

from __future__ import annotations

import math

import torch

C = 8.0
# A tiny random-weight model's longest reduction: the log-sum-exp over the demo vocabulary (49152 tokens).
VOCAB = 49152
# Fraction of entries that may take Adam's sign-flip path (rounding-level gradients); a real defect (a lost
# micro-batch, shard or scale) moves most. An input whose activations are near zero in the tiny random model makes
# a whole column's gradients rounding-level: 64 of layer 0's o_proj's 8,192 entries (0.78 %) in one run on
# hidden size 64 (at most 0.12 % elsewhere).
ADAM_FLIP_FRACTION = 1e-2
# LoRA: B starts at zero, so its first Adam step moves every entry by +-lr, rounding-level gradients included, and
# each entry of B that flipped changes a whole row of A's next gradient; measured 0.2% after 2 steps on two thread
# counts. A defect (an adapter not trained, or on another model's samples) still moves most entries.
LORA_FLIP_FRACTION = 1e-2


def logprob_atol(dtype: torch.dtype = torch.float32) -> float:
    """Absolute tolerance of a logprob (a value of magnitude ~log V) computed through the vocabulary's
    log-sum-exp by two paths."""
    return rounding_rtol(dtype, VOCAB) * math.log(VOCAB)


def eps(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).eps


def rounding_rtol(dtype: torch.dtype, n: int = VOCAB) -> float:
    """Norm-wise relative tolerance of a value computed through a reduction of n terms in `dtype`."""
    return C * eps(dtype) * math.sqrt(n)


def assert_close_normwise(actual, expected, dtype: torch.dtype = torch.float32, n: int = VOCAB, what: str = "",
                          scale: float | None = None):
    """||actual - expected|| <= rtol(dtype, n) * scale. `scale` defaults to ||expected||; give the norm of the
    sum of the terms' magnitudes when the terms cancel (a gradient of advantages that sum to zero)."""
    a = torch.as_tensor(actual, dtype=torch.float64)
    b = torch.as_tensor(expected, dtype=torch.float64)
    assert a.shape == b.shape, f"{what}: shape {tuple(a.shape)} != {tuple(b.shape)}"
    err = (a - b).norm().item()
    scale = b.norm().item() if scale is None else scale
    tol = rounding_rtol(dtype, n) * max(scale, eps(dtype))
    assert err <= tol, f"{what}: |difference| {err:.3g} > {tol:.3g} (rtol {rounding_rtol(dtype, n):.2g} x {scale:.3g})"


def assert_scalar_close(actual: float, expected: float, dtype: torch.dtype = torch.float32, n: int = VOCAB,
                        what: str = "", scale: float | None = None):
    """|actual - expected| <= rtol(dtype, n) * scale; `scale` defaults to |expected| (give it when the value is
    a small difference of large terms, e.g. a loss that sums to near zero)."""
    scale = abs(expected) if scale is None else scale
    tol = rounding_rtol(dtype, n) * max(scale, eps(dtype))
    assert abs(actual - expected) <= tol, f"{what}: {actual!r} vs {expected!r} (tolerance {tol:.3g})"


def assert_adam_close(actual, expected, *, lr: float, steps: int, dtype: torch.dtype = torch.float32,
                      n: int = VOCAB, what: str = "", flip_fraction: float = ADAM_FLIP_FRACTION):
    """Weights after `steps` Adam steps from the same start, whose gradients differed by rounding alone.

    Every entry is within steps * 2 * lr (the most a sign flip can move it) plus one ulp of the weight's dtype;
    all but ADAM_FLIP_FRACTION of the entries are within the rounding bound of the update,
    steps * lr * rtol(dtype, n), plus one ulp of the weight."""
    a, b = actual.double(), expected.double()
    diff = (a - b).abs()
    ulp = eps(dtype) * b.abs()
    assert bool((diff <= steps * 2 * lr + ulp).all()), f"{what}: max difference {diff.max().item():.3g} exceeds " \
                                                        f"{steps} Adam steps of 2 x lr {lr:g}"
    loose = (diff > steps * lr * rounding_rtol(dtype, n) + ulp).float().mean().item()
    assert loose <= flip_fraction, f"{what}: {loose:.2%} of the entries differ beyond rounding " \
                                   f"(at most {flip_fraction:.1%} may take Adam's sign-flip path)"


LOGPROB_ATOL = logprob_atol(torch.float32)
