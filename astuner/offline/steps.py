"""One optimizer step of a preference loss, and the no-gradient losses used for validation.

The Trainer's public forward (`forward_logprobs`), micro-batching and optimizer step (`optim_step`) are reused as
they are; only the loss differs (the DPO / ORPO objectives of `algorithm/preference.py`). A pair's chosen and
rejected sequences always share a micro-batch.
"""

from __future__ import annotations

import time

import torch
from torch import Tensor

from astuner.algorithm.preference import PREFERENCE_OBJECTIVES
from astuner.offline.data import Pair
from astuner.step_plan import split_micro_batches
from astuner.trainer import Trainer
from astuner.types import Sample


def _sequence_sums(trainer: Trainer, samples: list[Sample], reference: bool = False) -> tuple[Tensor, Tensor]:
    """(sum of the trained tokens' logprobs, trained-token count) per sample, under the policy or the reference."""
    logprobs_R, _ = trainer.forward_logprobs(samples, reference=reference)
    dev = logprobs_R.device
    mask_R = torch.tensor([m for s in samples for m in s.loss_mask], device=dev, dtype=logprobs_R.dtype)
    seq_R = torch.tensor([b for b, s in enumerate(samples) for _ in s.response_ids], device=dev)
    zeros = torch.zeros(len(samples), device=dev, dtype=logprobs_R.dtype)
    return zeros.index_add(0, seq_R, logprobs_R * mask_R), zeros.index_add(0, seq_R, mask_R)


def preference_step(trainer: Trainer, pairs: list[Pair], kind: str, beta: float,
                    train: bool = True) -> dict[str, float]:
    """One optimizer step of the `kind` loss over `pairs` (train=False: the loss and stats only, no gradient)."""
    objective = PREFERENCE_OBJECTIVES[kind](beta)
    if objective.needs_reference and trainer.ref_model is None:
        raise ValueError(f"{kind} needs the trainer's reference model (Trainer(reference_model=True))")
    start = time.perf_counter()
    trainer.model.train(train and trainer.settings.gradient_checkpointing)  # train mode only to recompute activations
    chosen = [p.chosen.as_sample(f"pair{i}/chosen") for i, p in enumerate(pairs)]
    rejected = [p.rejected.as_sample(f"pair{i}/rejected") for i, p in enumerate(pairs)]
    chosen_total = float(sum(s.num_trained_tokens for s in chosen))
    totals: dict[str, float] = {"loss": 0.0}
    tokens = 0
    groups = split_micro_batches([c.num_tokens + r.num_tokens for c, r in zip(chosen, rejected)],
                                 trainer.settings.max_token_len_per_micro_batch)
    with torch.set_grad_enabled(train):
        for idx in groups:
            mb = [chosen[i] for i in idx] + [rejected[i] for i in idx]
            sums_B, lens_B = _sequence_sums(trainer, mb)
            ref_B = torch.zeros_like(sums_B)
            if objective.needs_reference:
                with torch.no_grad():
                    ref_B, _ = _sequence_sums(trainer, mb, reference=True)
            n = len(idx)
            contrib_P, stats = objective.pair_loss(
                sums_B[:n], sums_B[n:], ref_chosen_P=ref_B[:n], ref_rejected_P=ref_B[n:], chosen_len_P=lens_B[:n],
                rejected_len_P=lens_B[n:], num_pairs=len(pairs), chosen_tokens_total=chosen_total)
            loss = contrib_P.sum()
            if train:
                loss.backward()
            totals["loss"] += loss.item()
            for k, v in stats.items():
                totals[k] = totals.get(k, 0.0) + v.sum().item()
            tokens += sum(s.num_tokens for s in mb)
    metrics = {k: (v if k == "loss" else v / len(pairs)) for k, v in totals.items()}
    if train:
        metrics.update(trainer.optim_step())
    seconds = time.perf_counter() - start
    metrics.update(num_pairs=float(len(pairs)), train_tokens=float(tokens),
                   train_tokens_per_s=tokens / seconds if seconds > 0 else 0.0)
    return metrics


@torch.no_grad()
def sft_validation_loss(trainer: Trainer, samples: list[Sample]) -> float:
    """Token-mean negative log-likelihood of the samples' trained tokens."""
    nll, count = 0.0, 0.0
    for idx in split_micro_batches([s.num_tokens for s in samples], trainer.settings.max_token_len_per_micro_batch):
        sums_B, lens_B = _sequence_sums(trainer, [samples[i] for i in idx])
        nll -= sums_B.sum().item()
        count += lens_B.sum().item()
    return nll / max(count, 1.0)
