"""One training step over the trainer's public surface: `objective.epochs` passes over the step's samples, each
split into `mini_batch_num` mini-batches (one `forward_backward` + `optim_step` each); `forward_backward` itself
(the mini-batch's loss backwarded micro-batch by micro-batch, `trainer/core.py`'s docstring) is here too. Functions of a
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
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from astuner.algorithm.loss import token_weights
from astuner.algorithm.mismatch import depth_alarm, depth_metrics, depth_sums, mismatch_sums
from astuner.algorithm.objectives import TokenBatch, token_objective
from astuner.step_plan import offsets, split_mini_batches
from astuner.trainer import fsdp
from astuner.types import Sample, TrainResult

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from astuner.algorithm.objectives import TokenObjective  # noqa: F401 (annotations)


@dataclass
class _Tally:
    """Sums over a step's mini-batches, turned into the step's metrics at the end."""

    totals: dict[str, float]
    losses: list[float] = dataclasses.field(default_factory=list)
    grad_norms: list[float] = dataclasses.field(default_factory=list)
    response_tokens: int = 0
    weighted_tokens: int = 0
    train_tokens: int = 0
    micro_batches: int = 0
    skipped: int = 0
    forwarded_samples: int = 0

    def add(self, sums: dict[str, float], step: dict[str, float]) -> None:
        """A mini-batch's `forward_backward` sums and its optimizer step."""
        self.losses.append(sums["loss"])
        self.grad_norms.append(step["grad_norm"])
        self.response_tokens += sums["response_tokens"]
        self.weighted_tokens += sums["weighted_tokens"]
        self.train_tokens += sums["train_tokens"]
        self.forwarded_samples += sums["num_forwarded_samples"]
        for k in self.totals:
            self.totals[k] += sums[k]

    def into(self, metrics: dict[str, float], objective: TokenObjective, epochs: int, seconds: float) -> None:
        if self.losses:
            metrics[objective.loss_metric] = sum(self.losses) / len(self.losses)
            metrics["grad_norm"] = sum(self.grad_norms) / len(self.grad_norms)
            for k, v in self.totals.items():
                metrics[k] = v / objective.mean_over(k, self)
            metrics["forwarded_token_fraction"] = self.response_tokens / max(self.weighted_tokens, 1)
        metrics.update(
            train_tokens=float(self.train_tokens),
            train_tokens_per_s=self.train_tokens / seconds if seconds > 0 else 0.0,
            num_micro_batches=float(self.micro_batches),
            num_optimizer_steps=float(len(self.losses)),
            num_samples_skipped_zero_adv=float(self.skipped / epochs),
        )
        if objective.paired:
            metrics["num_pairs"] = metrics["num_samples"] / 2


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
    depth = {}
    if recompute:
        samples_used, mismatch, recomputed = recompute_old_logprobs(trainer, samples)
        metrics.update(mismatch)
        seen.update((id(s), lp) for s, lp in zip(samples, recomputed) if lp is not None)
        depth = depth_sums(samples, recomputed)
    else:
        samples_used = samples
    trainer.train_mode(adapter_dropout=True)  # trainer_common.lora.dropout acts in the update passes only
    tally = _Tally({k: 0.0 for k in objective.reported()})
    epochs = objective.epochs
    passes = [mb for _ in range(epochs) for mb in split_mini_batches(samples_used, settings.mini_batch_num)]
    for mini_batch in passes:
        first = not tally.losses and objective.checks_mismatch and not recompute
        logprobs_out: list[list[float] | None] = [None] * len(mini_batch)
        sums = trainer.forward_backward(mini_batch, objective, logprobs_out=logprobs_out if first else None,
                                        trained_only=True)
        seen.update((id(s), lp) for s, lp in zip(mini_batch, logprobs_out) if lp is not None)
        tally.micro_batches += sums["num_micro_batches"]
        tally.skipped += len(mini_batch) - sums["num_forwarded_samples"]
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
            depth = depth_sums(mini_batch, logprobs_out)
        step = trainer.optim_step()
        metrics["lr"] = step["lr"]
        tally.add(sums, step)
    if depth:
        metrics.update(_depth_metrics(trainer, depth))
    tally.into(metrics, objective, epochs, time.perf_counter() - start)
    return TrainResult(metrics, [seen.get(id(s)) for s in samples])


def _depth_metrics(trainer, sums: dict[str, float]) -> dict[str, float]:
    """The engine-trainer gap by context depth over every worker's tokens, and how many deep bins alarm
    (algorithm/mismatch.py)."""
    if trainer.dp is not None:
        sums = trainer.dp.reduce_sums(sums)
    out = depth_metrics(sums)
    if len(out) > 1:
        out["logprob_abs_diff/depth_alarm"] = float(len(depth_alarm(out, trainer.precision)))
    return out


def forward_backward(trainer, samples: list[Sample], objective, logprobs_out: list | None = None,
                     backward: bool = True, trained_only: bool = False) -> dict[str, float]:
    """`Trainer.forward_backward`: backward one mini-batch's loss into `.grad`, micro-batch by micro-batch
    (backward False: `Trainer.forward`, the same sums without a gradient)."""
    objective = token_objective(objective, trainer.settings).bound(samples)
    if objective.paired and (len(samples) % 2 or trainer.dp is not None):
        raise ValueError(f"objective {objective.name} takes (chosen, rejected) pairs in one process: an even "
                         f"number of samples, chosen first (algorithm/preference.py), got {len(samples)}")
    for s in samples:
        if len(s.old_logprobs) != len(s.response_ids):
            raise ValueError(f"sample of episode {s.episode_uid}: old_logprobs and response_ids lengths differ")
        if s.response_ids and not s.prompt_ids:
            raise ValueError(f"sample of episode {s.episode_uid}: empty prompt")
    # Lengths count trained tokens only: a merged sample (loss_mask) weighs its tokens as the separate
    # calls it joins would.
    weights_B = token_weights([s.num_trained_tokens for s in samples], [s.episode_uid for s in samples],
                              trainer.settings.loss_agg_mode, trainer.settings.norm_length)
    keep = [i for i, s in enumerate(samples) if objective.forwards(s, weights_B[i])]
    if trainer.dp is not None:  # a worker of a group backwards the episodes it owns (trainer/data_parallel.py)
        keep = [i for i in keep if trainer.dp.mine(samples[i])]
    kept = [samples[i] for i in keep]
    dev = trainer.device
    sums = {k: torch.zeros((), device=dev) for k in ("loss", "entropy", *objective.stat_keys)}
    n_tokens_R = n_micro = 0
    for idx, groups in trainer.micro_batches(kept, backward=backward, reference=objective.needs_reference,
                                             paired=objective.paired):
        n_micro += 1
        mb = [kept[i] for i in idx]
        ref_R = None
        if objective.needs_reference:
            with torch.no_grad():
                ref_R = trainer.forward_logprobs(mb, reference=True, groups=groups, trained_only=trained_only)[0]
        with torch.set_grad_enabled(backward):
            logprobs_R, entropy_R, topk_R_K = trainer.forward_logprobs(
                mb, with_entropy=objective.entropy_metric, entropy_grad=objective.entropy_grad,
                topk=objective.teacher_topk, groups=groups, trained_only=trained_only)
            batch = TokenBatch.of(mb, [weights_B[keep[i]] for i in idx], logprobs_R, entropy_R, ref_R, topk_R_K)
            loss, stats = objective.loss(batch)
        if logprobs_out is not None:  # before any update: the trainer's view of what the engine sampled
            for i, logprobs in zip(idx, batch.per_sample(logprobs_R)):
                logprobs_out[keep[i]] = logprobs
        if backward:
            loss.backward()

        n_tokens_R += int(batch.mask_R.sum().item())
        sums["loss"] += loss.detach()
        if entropy_R is not None:
            sums["entropy"] += (entropy_R.detach() * batch.mask_R).sum()
        for k, v in stats.items():  # token sums (or maxima), so micro-batches combine exactly
            sums[k] = torch.maximum(sums[k], v) if k in objective.max_stats else sums[k] + v
    out = {k: v.item() for k, v in sums.items()}  # one device sync per mini-batch
    out.update(response_tokens=n_tokens_R, train_tokens=sum(s.num_tokens for s in kept),
               num_micro_batches=n_micro, num_forwarded_samples=len(kept))
    if trainer.dp is not None:
        out = trainer.dp.reduce_sums(out, max_keys=objective.max_stats)
    out["weighted_tokens"] = sum(s.num_trained_tokens for s, w in zip(samples, weights_B) if w > 0)
    return out


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
    for idx, groups in trainer.micro_batches([samples[i] for i in todo]):
        mb = [samples[todo[i]] for i in idx]
        lengths = [len(s.response_ids) for s in mb]
        logprobs_R = trainer.forward_logprobs(mb, groups=groups, trained_only=True)[0]
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


def optimizer_step(trainer, adam=None) -> dict[str, float]:
    """`Trainer.optim_step`. A non-finite grad norm skips the update (it would poison the Adam moments for good)."""
    trainer.check_joined()
    lr = trainer.current_lr if adam is None else adam.lr
    for group in trainer.optimizer.param_groups:
        group["lr"] = lr
        if adam is not None:
            group.update(betas=adam.betas, eps=adam.eps, weight_decay=adam.weight_decay)
    clip = trainer.settings.grad_clip if adam is None else adam.grad_clip
    max_norm = clip if clip is not None else float("inf")
    master = trainer.master
    if trainer.dp is not None and trainer.root is None:  # sharded: reduce-scattered in the backward already
        trainer.dp.all_reduce_grads(master.model_params)
    master.grads_to_masters()
    grad_norm = fsdp.full(torch.nn.utils.clip_grad_norm_(trainer.params, max_norm)).item()
    if torch.isfinite(torch.tensor(grad_norm)):
        trainer.optimizer.step()
        master.masters_to_model()
        trainer.optimizer_steps += 1
    else:
        log.warning("non-finite grad norm (%s): optimizer step skipped", grad_norm)
    master.zero_grad()
    return {"grad_norm": grad_norm, "lr": lr}
