"""One training step over the trainer's public surface: `objective.epochs` passes over the step's samples, each
split into `mini_batch_num` mini-batches (one `forward_backward` + `optim_step` each). Functions of a
`trainer.Trainer` (which imports this module, so the trainer is not annotated here).

Every pass uses the same old logprobs (the engine's, or the trainer's recomputed before the first update when the
objective asks), so from the second optimizer step on the ratio moves away from 1 and the clip acts. A mini-batch
where nothing carries a gradient takes no optimizer step (weight decay alone is not a reason to move).

Metrics: the mean mini-batch loss (`objective.loss_metric`), the mean grad norm, and token means of the
objective's `reported()` stats, over the forwarded tokens or, for its `weighted_metrics`, over every loss-weighted
token (`forwarded_token_fraction` says what share of the weighted tokens was forwarded).
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from astuner.algorithm.mismatch import mismatch_sums
from astuner.step_plan import offsets, split_mini_batches
from astuner.types import Sample

if TYPE_CHECKING:
    from astuner.algorithm.objectives import TokenObjective


@dataclass
class TrainResult:
    """What a training step returns: its metrics, and per sample (in the order given) the trainer's logprobs of its
    response tokens before any update (None for a sample this worker did not forward before the first update)."""

    metrics: dict[str, float]
    trainer_logprobs: list[list[float] | None]

    def attach_to(self, samples: list[Sample]) -> None:
        """Record the trainer's logprobs on the samples, where the log viewer reads them (`Sample.trainer_logprobs`)."""
        for s, logprobs in zip(samples, self.trainer_logprobs):
            if logprobs is not None:
                s.trainer_logprobs = logprobs


def train_step(trainer, samples: list[Sample], objective: TokenObjective) -> TrainResult:
    """One training step of `objective` over `samples` (module docstring); the samples are not modified."""
    start = time.perf_counter()
    settings = trainer.settings
    if trainer.dp is not None:
        trainer.dp.assign(samples, settings.mini_batch_num)
    trainer.train_mode(adapter_dropout=False)  # no dropout while old logprobs are recomputed
    metrics: dict[str, float] = {"num_samples": float(len(samples)), "lr": trainer.current_lr}
    seen: dict[int, list[float]] = {}  # id(sample) -> the trainer's logprobs before any update
    recompute = objective.recomputes_old_logprobs
    if recompute:
        samples_used, mismatch, recomputed = recompute_old_logprobs(trainer, samples)
        metrics.update(mismatch)
        seen.update((id(s), lp) for s, lp in zip(samples, recomputed) if lp is not None)
    else:
        samples_used = samples
    trainer.train_mode(adapter_dropout=True)  # trainer_common.lora.dropout acts in the update passes only
    totals = {k: 0.0 for k in objective.reported()}
    losses, grad_norms = [], []
    n_tokens_R = n_weighted = train_tokens = n_micro = n_skipped = 0
    epochs = objective.epochs
    passes = [mb for _ in range(epochs) for mb in split_mini_batches(samples_used, settings.mini_batch_num)]
    for mini_batch in passes:
        first = not losses and objective.checks_mismatch and not recompute
        logprobs_out: list[list[float] | None] = [None] * len(mini_batch)
        sums = trainer.forward_backward(mini_batch, objective, logprobs_out=logprobs_out if first else None)
        seen.update((id(s), lp) for s, lp in zip(mini_batch, logprobs_out) if lp is not None)
        n_micro += sums["num_micro_batches"]
        n_skipped += len(mini_batch) - sums["num_forwarded_samples"]
        if sums["response_tokens"] == 0:
            trainer.zero_grad()
            continue
        if first:
            # Only the first mini-batch is forwarded before any update: there trainer and engine logprobs
            # of the sampled tokens should agree (fp32 on CPU: ~1e-6); a gap means a broken sync or pipeline.
            # (With recomputed old logprobs every sample is measured, in recompute_old_logprobs.)
            metrics["logprob_abs_diff_mean"] = sums["logprob_abs_diff"] / sums["response_tokens"]
            metrics["logprob_abs_diff_max"] = sums["logprob_abs_diff_max"]
            metrics["kl_engine_trainer_k3"] = sums["kl_engine_trainer_k3"] / sums["response_tokens"]
        step = trainer.optim_step()
        losses.append(sums["loss"])
        grad_norms.append(step["grad_norm"])
        metrics["lr"] = step["lr"]
        n_tokens_R += sums["response_tokens"]
        n_weighted += sums["weighted_tokens"]
        train_tokens += sums["train_tokens"]
        for k in totals:
            totals[k] += sums[k]
    seconds = time.perf_counter() - start

    if losses:
        metrics[objective.loss_metric] = sum(losses) / len(losses)
        metrics["grad_norm"] = sum(grad_norms) / len(grad_norms)
        for k, v in totals.items():
            metrics[k] = v / (n_weighted if k in objective.weighted_metrics else n_tokens_R)
        metrics["forwarded_token_fraction"] = n_tokens_R / max(n_weighted, 1)
    metrics.update(
        train_tokens=float(train_tokens),
        train_tokens_per_s=train_tokens / seconds if seconds > 0 else 0.0,
        num_micro_batches=float(n_micro),
        num_optimizer_steps=float(len(losses)),
        num_samples_skipped_zero_adv=float(n_skipped / epochs),
    )
    return TrainResult(metrics, [seen.get(id(s)) for s in samples])


@torch.no_grad()
def recompute_old_logprobs(trainer, samples: list[Sample]
                           ) -> tuple[list[Sample], dict[str, float], list[list[float] | None]]:
    """old_logprobs: trainer. Copies of `samples` whose old logprobs are the trainer's (before any update) and
    whose engine_logprobs keep the engine's, the mismatch metrics over every trained token (algorithm/mismatch.py),
    and per sample the trainer's logprobs (None where this worker forwarded none)."""
    out, recomputed = list(samples), [None] * len(samples)
    sums = {"logprob_abs_diff": 0.0, "logprob_abs_diff_max": 0.0, "kl_engine_trainer_k3": 0.0}
    tokens = 0.0
    dp, dev = trainer.dp, trainer.device
    todo = [i for i, s in enumerate(samples) if s.response_ids and (dp is None or dp.mine(s))]
    for idx in trainer.micro_batches([samples[i] for i in todo]):
        mb = [samples[todo[i]] for i in idx]
        lengths = [len(s.response_ids) for s in mb]
        logprobs_R, _ = trainer.forward_logprobs(mb)
        engine_R = torch.tensor([x for s in mb for x in s.old_logprobs], device=dev)
        mask_R = torch.tensor([m for s in mb for m in (s.loss_mask or [1] * len(s.response_ids))],
                              device=dev, dtype=torch.float32)
        for k, v in mismatch_sums(logprobs_R, engine_R, mask_R).items():
            sums[k] = max(sums[k], v.item()) if k.endswith("_max") else sums[k] + v.item()
        tokens += mask_R.sum().item()
        flat = logprobs_R.cpu().tolist()
        for i, start, n in zip(idx, offsets(lengths), lengths):
            j = todo[i]
            recomputed[j] = flat[start : start + n]
            out[j] = dataclasses.replace(samples[j], old_logprobs=recomputed[j],
                                         engine_logprobs=list(samples[j].old_logprobs))
    if dp is not None:
        sums = dp.reduce_sums({**sums, "tokens": tokens}, max_keys=("logprob_abs_diff_max",))
        tokens = sums["tokens"]
    tokens = max(tokens, 1.0)
    return out, {"logprob_abs_diff_mean": sums["logprob_abs_diff"] / tokens,
                 "logprob_abs_diff_max": sums["logprob_abs_diff_max"],
                 "kl_engine_trainer_k3": sums["kl_engine_trainer_k3"] / tokens}, recomputed
