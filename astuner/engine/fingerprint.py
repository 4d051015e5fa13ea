"""Weight fingerprints: every sync checks that the engine now serves what the trainer sent.

A sync that silently drops a tensor (a name the engine's loader does not know, a LoRA layer left unmerged) leaves
the engine sampling from a policy nobody trains, and nothing else would notice for weeks. So after each sync the
engine fingerprints the weights it holds and compares them with the fingerprint of the tensors it was handed
(cast to its own dtype, as it stores them).

The fingerprint of a module: for each group of tensors (a parameter's module path without its last two parts,
e.g. `model.layers.3.self_attn` for q/k/v/o), the float64 sums
    S = sum(x)        A = sum(|x|)
over the group's elements. Sums do not depend on layout, so they hold where an engine fuses tensors (vLLM's
qkv_proj and gate_up_proj hold the same elements as q/k/v_proj and gate/up_proj) or pads a vocabulary with zero
rows. Two fingerprints agree on a group when |S_e - S_t| and |A_e - A_t| are at most rtol * A_t (RTOL: the
values are the same numbers, summed in another order). A skipped tensor changes its group's sums by the
update it missed; a tensor whose update is below the engine dtype's resolution is unchanged, and harmless.

Where an engine keeps weights in a form that cannot be read back (vLLM's CPU backend repacks linear layers into
oneDNN handles and empties their parameters), those groups are left out and the rest compared: on CPU that is
the embeddings and the norms, on GPU every weight.
"""

from __future__ import annotations

from typing import Iterable

RTOL = 1e-9  # the same fp32/bf16 values summed in float64 in another order differ by far less

Fingerprint = dict[str, tuple[float, float]]  # group -> (S, A)


def group_of(name: str) -> str:
    parts = name.split(".")
    return ".".join(parts[:-2]) if len(parts) > 2 else "<top>"


class FingerprintBuilder:
    """Accumulates a fingerprint one tensor at a time (a sync streams its tensors)."""

    def __init__(self) -> None:
        self._sums: dict[str, list[float]] = {}

    def add(self, name: str, tensor) -> None:
        import torch

        wide = tensor.detach().to(torch.float64, copy=True)  # one float64 copy serves both sums
        sums = self._sums.setdefault(group_of(name), [0.0, 0.0])
        sums[0] += float(wide.sum())
        sums[1] += float(wide.abs_().sum())

    def result(self) -> Fingerprint:
        return {group: (s, a) for group, (s, a) in self._sums.items()}


def fingerprint(named_tensors: Iterable[tuple[str, object]]) -> Fingerprint:
    builder = FingerprintBuilder()
    for name, tensor in named_tensors:
        builder.add(name, tensor)
    return builder.result()


def differences(sent: Fingerprint, served: Fingerprint, rtol: float = RTOL) -> list[str]:
    """The groups whose served weights are not the ones sent, each with both fingerprints."""
    out = []
    for group, (s, a) in sorted(sent.items()):
        if group not in served:
            out.append(f"{group}: sent, but the engine holds no such weights")
            continue
        s2, a2 = served[group]
        if abs(s2 - s) > rtol * a or abs(a2 - a) > rtol * a:
            out.append(f"{group}: sent sum {s:.6g} (|.| {a:.6g}), engine holds sum {s2:.6g} (|.| {a2:.6g})")
    return out


class SyncMismatch(RuntimeError):
    """The engine does not serve the weights the trainer sent."""

    def __init__(self, engine: str, problems: list[str]) -> None:
        shown = "\n  ".join(problems[:8]) + (f"\n  ... and {len(problems) - 8} more" if len(problems) > 8 else "")
        super().__init__(
            f"weight sync not verified: the {engine} engine does not serve what the trainer sent, so rollouts would "
            f"sample from a policy that is not trained. Differing weights:\n  {shown}\n"
            "A name the engine's loader does not know (a renamed or LoRA-wrapped parameter) is the usual cause.")
