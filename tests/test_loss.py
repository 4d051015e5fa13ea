"""Token weights, KL estimators and the PPO-clip loss on hand-computed numbers."""

from __future__ import annotations

import math

import pytest
import torch

from astuner.algorithm.loss import LOSS_AGG_MODES, kl_penalty, policy_loss, token_weights

# Episode A: calls of 2 and 4 tokens; episode B: one call of 3 tokens (interleaved A, B, A). E = 2.
LENGTHS = [2, 3, 4]
UIDS = ["A", "B", "A"]


def test_episode_mean_token_mean_weights():
    # A: T_e = 6 -> 1 / (2 * 6) = 1/12 for both calls; B: T_e = 3 -> 1 / (2 * 3) = 1/6.
    assert token_weights(LENGTHS, UIDS, "episode-mean-token-mean", 8) == pytest.approx([1 / 12, 1 / 6, 1 / 12])


def test_token_mean_weights_every_token_the_same_as_verl():
    # T = 2 + 3 + 4 = 9 tokens in the mini-batch: each weighs 1/9, whatever episode it belongs to.
    assert token_weights(LENGTHS, UIDS, "token-mean", 8) == pytest.approx([1 / 9, 1 / 9, 1 / 9])


def test_seq_mean_token_mean_weights_as_verl():
    # N = 3 sequences: 1 / (3 * T_s) = 1/6, 1/9, 1/12 (the multi-call episode A gets 2/3 of the weight).
    assert token_weights(LENGTHS, UIDS, "seq-mean-token-mean", 8) == pytest.approx([1 / 6, 1 / 9, 1 / 12])


def test_seq_mean_token_sum_norm_weights_as_verl():
    # 1 / (N * norm_length) = 1 / (3 * 8) for every token.
    assert token_weights(LENGTHS, UIDS, "seq-mean-token-sum-norm", 8) == pytest.approx([1 / 24] * 3)


def test_single_call_episodes_agree_with_verl():
    # One call per episode: N == E and T_e == T_s, so episode-mean-token-mean is verl's seq-mean-token-mean.
    lengths, uids = [2, 5, 3], ["A", "B", "C"]
    assert token_weights(lengths, uids, "episode-mean-token-mean", 8) == pytest.approx(
        token_weights(lengths, uids, "seq-mean-token-mean", 8)
    )
    assert token_weights(lengths, uids, "seq-mean-token-mean", 8) == pytest.approx([1 / 6, 1 / 15, 1 / 9])


def test_every_episode_weighs_one_over_e_only_in_the_episode_mode():
    lengths = [2, 3, 4, 1, 7, 5]
    uids = ["A", "B", "A", "C", "C", "C"]

    def per_episode(mode):
        out = {}
        for w, n, uid in zip(token_weights(lengths, uids, mode, 8), lengths, uids):
            out[uid] = out.get(uid, 0.0) + w * n
        return out

    assert per_episode("episode-mean-token-mean") == pytest.approx({"A": 1 / 3, "B": 1 / 3, "C": 1 / 3})
    # verl's token-mean weighs episodes by their token count: 6, 3 and 13 of 22 tokens.
    assert per_episode("token-mean") == pytest.approx({"A": 6 / 22, "B": 3 / 22, "C": 13 / 22})


def test_agg_registry_and_errors():
    assert set(LOSS_AGG_MODES) == {"episode-mean-token-mean", "token-mean", "seq-mean-token-mean",
                                   "seq-mean-token-sum-norm"}
    with pytest.raises(ValueError, match="unknown loss_agg_mode"):
        token_weights([1], ["A"], "sum", 8)
    # An empty response gets weight 0 and does not count as a sequence.
    assert token_weights([0, 2], ["A", "A"], "seq-mean-token-mean", 8) == [0.0, 0.5]


def test_kl_estimators():
    logp = torch.tensor([-1.0, -2.0])
    ref = torch.tensor([-1.5, -1.0])
    assert kl_penalty(logp, ref, "k1").tolist() == pytest.approx([0.5, -1.0])
    # k3 with log r = ref - logp = (-0.5, 1): e^-0.5 + 0.5 - 1 = 0.1065307, e - 2 = 0.7182818.
    assert kl_penalty(logp, ref, "k3").tolist() == pytest.approx([0.1065307, 0.7182818], abs=1e-6)
    assert kl_penalty(logp, logp, "k3").tolist() == [0.0, 0.0]
    # Clamped as verl: log r clipped to [-20, 20], the estimate to [-10, 10].
    assert kl_penalty(torch.tensor([-30.0]), torch.tensor([0.0]), "k3").tolist() == [10.0]
    with pytest.raises(ValueError):
        kl_penalty(logp, ref, "k2")


def test_policy_loss_clipping_on_both_sides():
    # clip range [0.8, 1.3] (low 0.2, high 0.3). Per token (A, ratio) -> pg:
    #   (+1, 1.5): max(-1.5, -1.3) = -1.3   clipped (high side)
    #   (-1, 0.5): max( 0.5,  0.8) =  0.8   clipped (low side)
    #   (+2, 1.0): -2                        not clipped
    #   (-1, 1.2): 1.2                       inside the range
    #   (+1, 0.5): max(-0.5, -0.8) = -0.5   unclipped branch wins
    # weights (0.1, 0.2, 0.3, 0.2, 0.2): loss = -0.13 + 0.16 - 0.6 + 0.24 - 0.1 = -0.43
    ratios = [1.5, 0.5, 1.0, 1.2, 0.5]
    old = torch.tensor([-1.0, -2.0, -0.5, -1.5, -0.7])
    logp = (old + torch.tensor([math.log(r) for r in ratios])).requires_grad_(True)
    adv = torch.tensor([1.0, -1.0, 2.0, -1.0, 1.0])
    w = torch.tensor([0.1, 0.2, 0.3, 0.2, 0.2])
    loss, stats = policy_loss(logp, old, adv, w, clip_low=0.2, clip_high=0.3)
    assert loss.item() == pytest.approx(-0.43, abs=1e-6)
    # Stats are token sums (the trainer divides by the tokens they cover): 2 of 5 tokens clipped.
    assert stats["clip_fraction"].item() == pytest.approx(2.0)
    assert stats["clip_fraction_lower"].item() == 0.0
    assert stats["ratio_mean"].item() == pytest.approx(4.7, abs=1e-6)
    # sum of r - 1 - ln r over the five ratios.
    assert stats["approx_kl_old"].item() == pytest.approx(0.4985075, abs=1e-6)
    assert "kl_ref" not in stats
    loss.backward()
    # d/dlogp = -A * ratio * w where unclipped, 0 where the clipped branch is active.
    assert logp.grad.tolist() == pytest.approx([0.0, 0.0, -0.6, 0.24, -0.1], abs=1e-6)


def test_policy_loss_adds_kl_term():
    # A = 0, so only the KL term remains: 0.1 * (0.5 * 0.1065307 + 0.25 * 0.7182818) = 0.0232836
    logp = torch.tensor([-1.0, -2.0])
    ref = torch.tensor([-1.5, -1.0])
    loss, stats = policy_loss(
        logp, logp.clone(), torch.zeros(2), torch.tensor([0.5, 0.25]), 0.2, 0.28,
        ref_logprobs_R=ref, kl_coef=0.1, kl_kind="k3",
    )
    assert loss.item() == pytest.approx(0.0232836, abs=1e-6)
    assert stats["kl_ref"].item() == pytest.approx(0.1065307 + 0.7182818, abs=1e-6)
    assert stats["clip_fraction"].item() == 0.0
    loss_k1, _ = policy_loss(
        logp, logp.clone(), torch.zeros(2), torch.tensor([0.5, 0.25]), 0.2, 0.28,
        ref_logprobs_R=ref, kl_coef=0.1, kl_kind="k1",
    )
    # 0.1 * (0.5 * 0.5 + 0.25 * -1.0) = 0
    assert loss_k1.item() == pytest.approx(0.0, abs=1e-7)


def test_micro_batch_sum_equals_full_batch():
    torch.manual_seed(0)
    old = torch.randn(10)
    logp = (old + 0.3 * torch.randn(10)).requires_grad_(True)
    adv, w = torch.randn(10), torch.rand(10)
    full, _ = policy_loss(logp, old, adv, w, 0.2, 0.28)
    parts = sum(policy_loss(logp[s], old[s], adv[s], w[s], 0.2, 0.28)[0] for s in (slice(0, 3), slice(3, 10)))
    assert parts.item() == pytest.approx(full.item(), abs=1e-6)


def test_dual_clip_caps_the_loss_of_negative_advantages():
    # clip_c = 3, clip range [0.8, 1.28]. Per token (A, ratio):
    #   (-1, 5.0): max(5, 1.28) = 5 > -A * c = 3 -> 3 (capped: no gradient)
    #   (-1, 2.0): max(2, 1.28) = 2 < 3 -> 2 (gradient -A * ratio * w = 2 * 0.5 = 1)
    #   (+1, 5.0): max(-5, -1.28) = -1.28 (positive A: no dual clip)
    # weights 0.5 each: loss = 0.5 * (3 + 2 - 1.28) = 1.86
    ratios = [5.0, 2.0, 5.0]
    old = torch.tensor([-3.0, -2.0, -4.0])
    logp = (old + torch.tensor([math.log(r) for r in ratios])).requires_grad_(True)
    adv = torch.tensor([-1.0, -1.0, 1.0])
    loss, stats = policy_loss(logp, old, adv, torch.full((3,), 0.5), 0.2, 0.28, clip_c=3.0)
    assert loss.item() == pytest.approx(1.86, abs=1e-5)
    assert stats["clip_fraction_lower"].item() == 1.0
    loss.backward()
    assert logp.grad.tolist() == pytest.approx([0.0, 1.0, 0.0], abs=1e-6)
    # Without the cap (a huge clip_c) the first token keeps its full loss: 0.5 * 5.
    uncapped, _ = policy_loss(logp.detach(), old, adv, torch.full((3,), 0.5), 0.2, 0.28, clip_c=1e9)
    assert uncapped.item() == pytest.approx(0.5 * (5 + 2 - 1.28), abs=1e-5)


def test_log_ratio_is_clamped():
    # A log ratio of 100 would overflow exp; verl clamps it to 20.
    loss, stats = policy_loss(torch.tensor([100.0]), torch.tensor([0.0]), torch.tensor([-1.0]), torch.ones(1),
                              0.2, 0.28, clip_c=1e12)
    assert math.isfinite(loss.item()) and stats["ratio_mean"].item() == pytest.approx(math.exp(20), rel=1e-5)


def test_gspo_uses_one_ratio_per_sequence():
    # Sequence 0: token log-ratios ln 2 and 0 -> s_0 = exp(ln 2 / 2) = sqrt 2 = 1.41421; A = +1.
    # Sequence 1: one token, log-ratio ln 0.5 -> s_1 = 0.5; A = -1.
    # Clip range [0.8, 1.3]:
    #   seq 0: max(-1.41421, -1.3) = -1.3 for both tokens (clipped, no gradient)
    #   seq 1: max(0.5, 0.8) = 0.8 (clipped, no gradient)
    # weights 0.25, 0.25, 0.5: loss = 0.25 * -1.3 * 2 + 0.5 * 0.8 = -0.25
    old = torch.tensor([-1.0, -2.0, -1.0])
    logp = (old + torch.tensor([math.log(2.0), 0.0, math.log(0.5)])).requires_grad_(True)
    adv = torch.tensor([1.0, 1.0, -1.0])
    w = torch.tensor([0.25, 0.25, 0.5])
    seq = torch.tensor([0, 0, 1])
    loss, stats = policy_loss(logp, old, adv, w, 0.2, 0.3, loss_mode="gspo", seq_index_R=seq)
    assert loss.item() == pytest.approx(-0.25, abs=1e-6)
    assert stats["ratio_mean"].item() == pytest.approx(2 * math.sqrt(2) + 0.5, abs=1e-5)
    # Token-level vanilla on the same numbers clips only token 0: -1.3*0.25 - 1*0.25 + 0.8*0.5 = -0.175.
    vanilla, _ = policy_loss(logp.detach(), old, adv, w, 0.2, 0.3)
    assert vanilla.item() == pytest.approx(-0.175, abs=1e-6)
    # Inside the clip range the gradient of each token is -A * w * s_s (the sequence ratio, not its own).
    wide, _ = policy_loss(logp, old, adv, w, 0.9, 0.9, loss_mode="gspo", seq_index_R=seq)
    wide.backward()
    assert logp.grad.tolist() == pytest.approx([-0.25 * math.sqrt(2), -0.25 * math.sqrt(2), 0.5 * 0.5], abs=1e-5)


def test_gspo_masked_tokens_do_not_enter_the_sequence_ratio():
    # Token 1 is a tool result (mask 0): s_0 = exp(ln 2 / 1) = 2, not sqrt 2. Clip range wide open.
    old = torch.tensor([-1.0, -2.0])
    logp = (old + torch.tensor([math.log(2.0), 5.0])).requires_grad_(True)
    mask = torch.tensor([1.0, 0.0])
    loss, _ = policy_loss(logp, old, torch.tensor([1.0, 1.0]), torch.tensor([1.0, 0.0]), 0.99, 9.0,
                          mask_R=mask, loss_mode="gspo", seq_index_R=torch.tensor([0, 0]))
    assert loss.item() == pytest.approx(-2.0, abs=1e-5)


def test_entropy_bonus_is_subtracted_with_its_gradient():
    # A = 0: the loss is -coeff * sum(w * H) = -0.1 * (0.5 * 1.2 + 0.5 * 0.4) = -0.08; dL/dH = -coeff * w.
    logp = torch.tensor([-1.0, -2.0])
    entropy = torch.tensor([1.2, 0.4], requires_grad=True)
    loss, _ = policy_loss(logp, logp.clone(), torch.zeros(2), torch.tensor([0.5, 0.5]), 0.2, 0.28,
                          entropy_R=entropy, entropy_coeff=0.1)
    assert loss.item() == pytest.approx(-0.08, abs=1e-7)
    loss.backward()
    assert entropy.grad.tolist() == pytest.approx([-0.05, -0.05])
    with pytest.raises(ValueError, match="entropy_R with its gradient"):
        policy_loss(logp, logp.clone(), torch.zeros(2), torch.ones(2), 0.2, 0.28, entropy_R=entropy.detach(),
                    entropy_coeff=0.1)


def test_mismatch_metrics_and_truncated_is_by_hand():
    from astuner.algorithm.mismatch import mismatch_sums, truncated_is_weights

    # d = trainer - engine = [0.1, -0.5, (masked) 3.0]: |d| sums to 0.6, max 0.5;
    # k3 = (e^0.1 - 1 - 0.1) + (e^-0.5 - 1 + 0.5) = 0.0051709 + 0.1065307 = 0.1117016.
    trainer = torch.tensor([-1.0, -2.0, -0.5])
    engine = torch.tensor([-1.1, -1.5, -3.5])
    sums = mismatch_sums(trainer, engine, torch.tensor([1.0, 1.0, 0.0]))
    assert sums["logprob_abs_diff"].item() == pytest.approx(0.6, abs=1e-6)
    assert sums["logprob_abs_diff_max"].item() == pytest.approx(0.5, abs=1e-6)
    assert sums["kl_engine_trainer_k3"].item() == pytest.approx(0.1117016, abs=1e-6)
    # w = min(exp(d), 1.05): exp(0.1) = 1.105 -> 1.05; exp(-0.5) = 0.6065307.
    assert truncated_is_weights(trainer[:2], engine[:2], 1.05).tolist() == pytest.approx([1.05, 0.6065307], abs=1e-6)
    # The weight multiplies the policy-gradient term: A = 1, ratio 1, weights 0.5 -> -0.5 * (1.05 + 0.6065307).
    logp = torch.tensor([-1.0, -2.0], requires_grad=True)
    loss, stats = policy_loss(logp, logp.detach().clone(), torch.ones(2), torch.full((2,), 0.5), 0.2, 0.28,
                              is_weights_R=torch.tensor([1.05, 0.6065307]))
    assert loss.item() == pytest.approx(-0.5 * 1.6565307, abs=1e-6)
    assert stats["is_weight_mean"].item() == pytest.approx(1.6565307, abs=1e-6)
