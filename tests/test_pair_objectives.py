"""DPO and ORPO through `Trainer.forward_backward`, like every objective: the loss is the formula of
algorithm/preference.py over the trainer's own logprobs, pairs stay whole across micro-batches, and a micro-batch
split changes nothing but the rounding."""

from __future__ import annotations

import random

import pytest
import torch

from astuner.algorithm.preference import DPO, ORPO, orpo_loss
from astuner.trainer import Trainer
from astuner.trainer.settings import TrainerSettings
from astuner.types import Sample


def _pairs(n: int, seed: int = 0) -> list[Sample]:
    """n (chosen, rejected) pairs of random token ids, in a pair objective's order: every chosen, then every
    rejected; sides of one pair differ in length, so a wrong pairing shows in the loss."""
    rng = random.Random(seed)
    chosen, rejected = [], []
    for i in range(n):
        prompt = [rng.randrange(10, 5000) for _ in range(rng.randrange(3, 8))]
        for side, out, length in (("chosen", chosen, 4 + i), ("rejected", rejected, 9 - i)):
            response = [rng.randrange(10, 5000) for _ in range(length)]
            mask = [0] + [1] * (length - 1)  # the first response token is template glue, not trained
            out.append(Sample(prompt, response, [0.0] * length, 1.0, 1.0, f"pair{i}/{side}", loss_mask=mask))
    return chosen + rejected


def _trainer(tiny_model_dir, budget: int = 13000, reference: bool = False) -> Trainer:
    return Trainer(str(tiny_model_dir), TrainerSettings(lr=1e-3, device="cpu", reference_model=reference,
                                                        max_token_len_per_micro_batch=budget, beta=0.5))


def test_orpo_loss_is_the_formula_over_the_trainers_logprobs(tiny_model_dir):
    trainer = _trainer(tiny_model_dir)
    samples = _pairs(3)
    sums = trainer.forward(samples, "orpo")
    s, lengths = [], []
    for x in samples:  # S(y) and |y| over the trained tokens, one sample at a time
        logprobs = trainer.compute_logprobs(x.prompt_ids, x.response_ids, 1.0)
        s.append(sum(lp * m for lp, m in zip(logprobs, x.loss_mask)))
        lengths.append(float(sum(x.loss_mask)))
    s_t, len_t = torch.tensor(s), torch.tensor(lengths)
    contrib, stats = orpo_loss(s_t[:3], s_t[3:], chosen_len_P=len_t[:3], rejected_len_P=len_t[3:], beta=0.5,
                               num_pairs=3, chosen_tokens_total=float(len_t[:3].sum()))
    assert sums["loss"] == pytest.approx(contrib.sum().item(), rel=1e-5)
    assert sums["log_odds_ratio"] / 3 == pytest.approx(stats["log_odds_ratio"].mean().item(), rel=1e-4, abs=1e-6)


@pytest.mark.parametrize("objective", ["dpo", "orpo"])
def test_a_micro_batch_split_keeps_pairs_and_the_gradient(tiny_model_dir, objective):
    samples = _pairs(4)
    grads = []
    for budget in (13000, 2 * max(c.num_tokens + r.num_tokens for c, r in zip(samples[:4], samples[4:]))):
        trainer = _trainer(tiny_model_dir, budget, reference=objective == "dpo")
        if objective == "dpo":  # a policy that differs from its reference, so the DPO margin is not 0
            trainer.train(_pairs(2, seed=1), "sft")
        sums = trainer.forward_backward(samples, objective)
        grads.append((sums["loss"], sums["num_micro_batches"],
                      torch.cat([p.grad.flatten() for p in trainer.model.parameters() if p.grad is not None])))
    (loss_one, n_one, grad_one), (loss_split, n_split, grad_split) = grads
    assert n_one == 1 and n_split > 1
    assert loss_split == pytest.approx(loss_one, rel=1e-5)
    assert torch.allclose(grad_split, grad_one, rtol=1e-4, atol=1e-6)


def test_pair_objective_trains_a_step_and_reports_means_over_pairs(tiny_model_dir):
    trainer = _trainer(tiny_model_dir, reference=True)
    trainer.train(_pairs(2, seed=1), "sft")
    result = trainer.train(_pairs(3), "dpo")
    m = result.metrics
    assert m["num_pairs"] == 3 and m["num_samples"] == 6 and m["num_optimizer_steps"] == 1
    assert 0.0 <= m["rewards/accuracy"] <= 1.0 and m["rewards/accuracy"] * 3 == pytest.approx(round(m["rewards/accuracy"] * 3))
    assert m["rewards/margin"] == pytest.approx(m["rewards/chosen"] - m["rewards/rejected"], abs=1e-6)


def test_pairs_must_come_whole(tiny_model_dir):
    trainer = _trainer(tiny_model_dir)
    with pytest.raises(ValueError, match="chosen first"):
        trainer.forward(_pairs(2)[:3], ORPO(0.5))
    assert DPO(0.1).paired and not DPO(0.1).entropy_metric
