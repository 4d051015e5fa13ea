"""A `forward_backward` request's loss and data, checked and turned into trainer samples (`tinker_losses.py` has
the formulas): the loss served, its config keys, each datum's inputs, shapes, next-token targets, vocabulary and
context."""

from __future__ import annotations

import math

import numpy as np

from astuner.serve.futures import RequestError
from astuner.serve.tinker_losses import LOSSES, REFUSED, TinkerDatum
from astuner.serve.wire_proto import ForwardBackwardRequest, WireDatum
from astuner.types import Sample


def request_data(request: ForwardBackwardRequest, vocab: int, context: int | None) -> list[TinkerDatum]:
    """The request's data as samples, once its loss and config are known to be served."""
    if request.loss_fn in REFUSED:
        raise RequestError(f"loss_fn {request.loss_fn!r}: {REFUSED[request.loss_fn]}")
    if request.loss_fn not in LOSSES:
        raise RequestError(f"loss_fn {request.loss_fn!r} is not one astuner serve knows; it serves "
                           f"{', '.join(LOSSES)}")
    allowed = tuple(LOSSES[request.loss_fn].config)
    extra = sorted(set(request.config) - set(allowed))
    if extra:
        raise RequestError(f"loss_fn_config {extra} does not apply to {request.loss_fn} (it reads "
                           f"{', '.join(allowed) or 'none'})")
    texts = sorted(k for k, v in request.config.items() if not isinstance(v, float) or not math.isfinite(v))
    if texts:
        raise RequestError(f"loss_fn_config {texts}: finite numbers only")
    data = [datum_sample(d, i, request.loss_fn, vocab, context) for i, d in enumerate(request.data)]
    if not data:
        raise RequestError("forward_backward needs at least one datum")
    return data


def datum_sample(d: WireDatum, index: int, loss_fn: str, vocab: int, context: int | None = None) -> TinkerDatum:
    """A datum as a trainer sample (prompt x_0, response the targets; `tinker_losses.py`), its inputs checked."""
    n = len(d.tokens)
    needed = ("target_tokens", *LOSSES[loss_fn].inputs)
    optional = LOSSES[loss_fn].optional
    missing = [k for k in needed if k not in d.inputs]
    extra = sorted(set(d.inputs) - set(needed) - set(optional))
    if missing or extra:
        raise RequestError(f"datum {index}: {loss_fn} takes loss_fn_inputs {', '.join(needed)}"
                           + (f" (and optionally {', '.join(optional)})" if optional else "")
                           + (f"; missing {', '.join(missing)}" if missing else "")
                           + (f"; not read: {', '.join(extra)}" if extra else ""))
    if n == 0:
        raise RequestError(f"datum {index}: model_input holds no tokens")
    if context is not None and n + 1 > context:
        raise RequestError(f"datum {index}: {n} input tokens and a target exceed the model's context ({context} "
                           f"positions); shorten it (sampling refuses the same)")
    present = [k for k in (*needed, *optional) if k in d.inputs]
    for key in present:
        if d.inputs[key].shape != (n,):
            raise RequestError(f"datum {index}: loss_fn_inputs[{key!r}] has shape {list(d.inputs[key].shape)}, "
                               f"model_input {n} tokens (one value per position)")
    tokens = d.tokens.astype(np.int64)
    targets = d.inputs["target_tokens"].astype(np.int64)
    if not np.array_equal(tokens[1:], targets[:-1]):
        raise RequestError(f"datum {index}: target_tokens must be model_input shifted by one (position i predicts "
                           f"token i + 1); astuner serve trains on next-token targets only")
    if tokens.min() < 0 or tokens.max() >= vocab or not 0 <= targets[-1] < vocab:
        raise RequestError(f"datum {index}: a token id is outside the vocabulary (0..{vocab - 1})")
    inputs = {k: [float(x) for x in d.inputs[k]] for k in present if k != "target_tokens"}
    old = inputs.get("logprobs", [0.0] * n)
    sample = Sample([int(tokens[0])], targets.tolist(), old, 0.0, 1.0, f"datum-{index}")
    return TinkerDatum(sample, inputs)
