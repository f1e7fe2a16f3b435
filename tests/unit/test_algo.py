"""Hand-computed values for the objective family (pure torch)."""

import math

import pytest
import torch

from megarl.algo.advantage import (
    gae,
    grpo_advantages,
    length_adaptive_lambda,
    outcome_rewards_to_tokens,
    rloo_advantages,
    vapo_advantages,
)
from megarl.algo.batch import aggregation_weights, build_batch, positive_nll_scale
from megarl.algo.curriculum import CurriculumSource, PassRateTracker, budget_weights
from megarl.algo.filters import (
    degenerate_group_probability,
    is_informative,
    overlong_mask,
    overlong_ramp,
    oversampling_factor,
    soft_overlong_penalty,
)
from megarl.algo.losses import (
    cispo_loss,
    gspo_loss,
    kl_penalty,
    masked_fractions,
    mismatch_metrics,
    mismatch_weights,
    ppo_clip_loss,
    value_loss,
)
from megarl.algo.minibatches import minibatch_rows
from megarl.algo.objective import group_advantages, policy_loss_fn, shaped_rewards
from megarl.config.presets import PRESETS
from megarl.config.schema import AlgoConfig
from megarl.types import Group, Sample


def test_grpo_dr_grpo_rloo_on_one_group():
    r = torch.tensor([[1.0, 0.0, 0.0, 1.0]])
    assert torch.allclose(grpo_advantages(r), torch.tensor([[1.0, -1.0, -1.0, 1.0]]), atol=1e-5)
    assert torch.allclose(grpo_advantages(r, scale_by_std=False), torch.tensor([[0.5, -0.5, -0.5, 0.5]]))
    # leave-one-out: 1 − (0+0+1)/3 = 2/3, 0 − 2/3 = −2/3
    assert torch.allclose(rloo_advantages(r), torch.tensor([[2 / 3, -2 / 3, -2 / 3, 2 / 3]]))
    assert torch.equal(grpo_advantages(torch.ones(1, 4)), torch.zeros(1, 4))  # degenerate group
    assert torch.equal(group_advantages(r, "dr_grpo"), grpo_advantages(r, scale_by_std=False))


def test_textbook_degenerate_groups_and_oversampling():
    assert degenerate_group_probability(0.5, 8) == pytest.approx(2 / 256)
    assert degenerate_group_probability(0.9, 8) == pytest.approx(0.4305, abs=1e-4)
    assert oversampling_factor(0.35) == pytest.approx(1 / 0.65)
    with pytest.raises(ValueError):
        oversampling_factor(1.0)


def test_length_normalisation_penalty_per_token():
    """Â = −1, lengths 100 and 1000: 1/100 vs 1/1000 per token under length normalisation, equal under
    the token-level mean (and under Dr. GRPO's constant normaliser)."""
    mask = torch.zeros(2, 1000)
    mask[0, :100] = 1
    mask[1, :] = 1
    seq = aggregation_weights(mask, "seq_mean_token_mean") * 2  # × N: the per-sequence view
    assert seq[0, 0].item() == pytest.approx(1 / 100) and seq[1, 0].item() == pytest.approx(1 / 1000)
    tok = aggregation_weights(mask, "token_mean")
    assert tok[0, 0].item() == pytest.approx(tok[1, 0].item()) == pytest.approx(1 / 1100)
    dr = aggregation_weights(mask, "seq_mean_token_sum_norm", norm_tokens=1000)
    assert dr[0, 0].item() == pytest.approx(dr[1, 0].item()) == pytest.approx(1 / 2000)


def test_clip_higher_matches_direct_computation():
    logp = torch.log(torch.tensor([[0.5, 0.9, 0.2, 0.6]]))
    old = torch.log(torch.tensor([[0.4, 0.5, 0.4, 0.6]]))
    adv = torch.tensor([[1.0, 1.0, -1.0, -2.0]])
    mask = torch.ones(1, 4)
    loss, m = ppo_clip_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.28)
    expected = []
    for lp, o, a in zip(logp[0], old[0], adv[0]):
        r = math.exp(lp - o)
        expected.append(-min(r * a, min(max(r, 0.8), 1.28) * a))
    assert torch.allclose(loss[0], torch.tensor(expected), atol=1e-6)
    # ratio 1.8 with Â>0 is clipped at 1.28 (clip-higher), ratio 0.5 with Â<0 at 0.8
    assert loss[0, 1].item() == pytest.approx(-1.28) and loss[0, 2].item() == pytest.approx(0.8)
    assert m["clip_frac"].item() == pytest.approx(0.5)


def test_dual_clip_bounds_negative_advantages():
    logp, old = torch.log(torch.tensor([[0.9]])), torch.log(torch.tensor([[0.1]]))  # ratio 9
    adv, mask = torch.tensor([[-1.0]]), torch.ones(1, 1)
    plain, _ = ppo_clip_loss(logp, old, adv, mask, 0.2, 0.2)
    dual, m = ppo_clip_loss(logp, old, adv, mask, 0.2, 0.2, dual_clip=3.0)
    assert plain.item() == pytest.approx(9.0) and dual.item() == pytest.approx(3.0)
    assert m["dual_clip_frac"].item() == 1.0


def test_gradients_flow_only_through_current_logprobs():
    logp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    old = torch.tensor([[-1.1, -1.9]], requires_grad=True)
    loss, _ = ppo_clip_loss(logp, old, torch.tensor([[1.0, -1.0]]), torch.ones(1, 2), 0.2, 0.2)
    loss.sum().backward()
    assert logp.grad is not None and logp.grad.abs().sum() > 0
    assert old.grad is None


def test_gspo_ratio_equals_token_ratio_when_all_equal():
    old = torch.tensor([[-1.0, -2.0, -0.5]])
    logp = old + 0.1  # every token ratio is e^0.1
    adv, mask = torch.full((1, 3), 0.5), torch.ones(1, 3)
    _, m = gspo_loss(logp, old, adv, mask, 0.5, 0.5)
    _, mt = ppo_clip_loss(logp, old, adv, mask, 0.5, 0.5)
    assert m["ratio_mean"].item() == pytest.approx(math.exp(0.1)) == pytest.approx(mt["ratio_mean"].item())
    # the sequence ratio is the geometric mean of token ratios, not their product
    logp2 = old + torch.tensor([[0.3, 0.0, -0.3]])
    _, m2 = gspo_loss(logp2, old, adv, mask, 0.5, 0.5)
    assert m2["ratio_mean"].item() == pytest.approx(1.0)
    # clip_frac counts sequences whose clip is active (as PPO-clip's): s above the band with Â > 0 is clipped,
    # with Â < 0 it is not (the unclipped branch is the min and sends the gradient)
    two = torch.stack([old[0], old[0]]) + 0.1
    _, mc = gspo_loss(two, torch.stack([old[0], old[0]]), torch.tensor([[0.5] * 3, [-0.5] * 3]), torch.ones(2, 3),
                      0.05, 0.05)
    assert mc["clip_frac"].item() == pytest.approx(0.5)


def test_gspo_applies_the_tis_weight_per_token():
    """algo.tis under GSPO: ℓ_t = −w_t·J_i (as PPO-clip's ℓ_t = −w_t·J_t); without it TIS removed the correction."""
    old = torch.zeros(2, 3)
    logp = torch.tensor([[0.2, -0.2, 9.0], [0.1, 0.1, 0.1]])  # seq 0: s = 1 (masked 9.0 ignored); seq 1: s = e^0.1
    mask = torch.tensor([[1.0, 1, 0], [1, 1, 1]])
    adv = torch.tensor([[1.0, 1, 1], [-1, -1, -1]])
    # J_0 = min(1·1, 1·1) = 1;  J_1 = min(e^0.1·(−1), clip(e^0.1, 0.95, 1.05)·(−1)) = −e^0.1
    j = [1.0, -math.exp(0.1)]
    w = torch.tensor([[2.0, 0.5, 7.0], [1.0, 1.0, 0.5]])  # token-level TIS weights
    plain, _ = gspo_loss(logp, old, adv, mask, 0.05, 0.05)
    weighted, _ = gspo_loss(logp, old, adv, mask, 0.05, 0.05, is_weight=w)
    assert torch.allclose(plain, torch.tensor([[-j[0], -j[0], 0], [-j[1]] * 3]))
    assert torch.allclose(weighted, torch.tensor([[-2 * j[0], -0.5 * j[0], 0], [-j[1], -j[1], -0.5 * j[1]]]))
    # sequence-level TIS (one weight per row, as rl_update builds it): the sequence's term is −w_i·J_i
    ws = mismatch_weights(torch.log(torch.tensor([[0.5, 0.5, 0.5], [0.9, 0.9, 0.9]])),
                              torch.log(torch.tensor([[0.25, 0.5, 0.9], [0.9, 0.9, 0.9]])), mask, "sequence", 10.0)
    seq_weighted, _ = gspo_loss(logp, old, adv, mask, 0.05, 0.05, is_weight=ws)
    assert torch.allclose(seq_weighted, torch.tensor([[-2 * j[0], -2 * j[0], 0], [-j[1]] * 3]))
    # the trainer's loss function passes the batch's is_weight on under policy_loss=gspo
    f = policy_loss_fn(AlgoConfig(policy_loss="gspo", tis="token", clip_low=0.05, clip_high=0.05))
    mb = {"loss_mask": mask, "old_logprobs": old, "advantages": adv}
    without, _ = f(logp, mb)
    with_w, _ = f(logp, {**mb, "is_weight": w})
    assert torch.allclose(without, plain) and torch.allclose(with_w, weighted)
    assert not torch.allclose(with_w, without)


def test_gae_lambda_one_is_reward_to_go_minus_value():
    rewards = torch.tensor([[0.0, 0.0, 1.0, 0.0], [0.0, 2.0, 0.0, 0.0]])
    mask = torch.tensor([[1.0, 1, 1, 0], [1, 1, 0, 0]])
    values = torch.tensor([[0.3, 0.5, 0.7, 9.0], [0.1, 0.2, 9.0, 9.0]])
    adv, ret = gae(rewards, values, mask, gamma=1.0, lam=1.0)
    to_go = torch.tensor([[1.0, 1, 1, 0], [2, 2, 0, 0]])
    assert torch.allclose(adv, (to_go - values) * mask)
    assert torch.allclose(ret, to_go * mask)
    adv0, _ = gae(rewards, values, mask, gamma=1.0, lam=0.0)  # one-step TD errors
    assert adv0[0, 0].item() == pytest.approx(0.0 + 0.5 - 0.3)


def test_vapo_decoupled_and_length_adaptive_lambda():
    lam = length_adaptive_lambda(torch.tensor([100, 1000]), alpha=0.05)
    assert lam.tolist() == pytest.approx([1 - 1 / 5, 1 - 1 / 50])
    mask = torch.ones(1, 5)
    values = torch.tensor([[0.2, 0.4, 0.1, 0.3, 0.6]])
    adv, targets = vapo_advantages(torch.tensor([1.0]), values, mask, alpha=0.05)
    assert torch.allclose(targets, torch.ones(1, 5))  # λ_critic = 1: Monte-Carlo returns
    tok = outcome_rewards_to_tokens(torch.tensor([1.0]), mask)
    expected, _ = gae(tok, values, mask, 1.0, float(length_adaptive_lambda(torch.tensor([5]), 0.05)))
    assert torch.allclose(adv, expected)


def test_kl_estimators_and_value_clipping():
    logp, ref = torch.tensor([math.log(0.5)]), torch.tensor([math.log(0.25)])
    lr = math.log(2)
    assert kl_penalty(logp, ref, "k1").item() == pytest.approx(lr)
    assert kl_penalty(logp, ref, "k2").item() == pytest.approx(0.5 * lr**2)
    assert kl_penalty(logp, ref, "k3").item() == pytest.approx(0.5 - 1 + lr)
    v, old, ret, mask = torch.tensor([[1.0]]), torch.tensor([[0.0]]), torch.tensor([[2.0]]), torch.ones(1, 1)
    plain, _ = value_loss(v, old, ret, mask, clip=0.0)
    clipped, _ = value_loss(v, old, ret, mask, clip=0.2)
    assert plain.item() == pytest.approx(0.5) and clipped.item() == pytest.approx(0.5 * 1.8**2)


def test_truncated_importance_sampling_and_mismatch_metrics():
    prox = torch.log(torch.tensor([[0.5, 0.9, 0.3]]))
    beh = torch.log(torch.tensor([[0.25, 0.3, 0.3]]))
    mask = torch.ones(1, 3)
    w = mismatch_weights(prox, beh, mask, "token", cap=2.0)
    assert w.tolist()[0] == pytest.approx([2.0, 2.0, 1.0])  # 2.0 and 3.0 capped at 2
    ws = mismatch_weights(prox, beh, mask, "sequence", cap=10.0)
    assert ws.tolist()[0] == pytest.approx([6.0] * 3)
    m = mismatch_metrics(prox, beh, mask)
    assert m["mismatch/abs_mean"].item() == pytest.approx((math.log(2) + math.log(3)) / 3)
    assert m["mismatch/kl"] > 0


def test_filters_and_overlong_shaping():
    g = Group(0, "", "", [Sample([1], reward=1.0), Sample([1], reward=1.0)])
    assert not is_informative(g)
    g.samples[1].reward = 0.0
    assert is_informative(g)
    m = overlong_mask(["stop", "length"], torch.ones(2, 3))
    assert m.tolist() == [[1, 1, 1], [0, 0, 0]]
    # no penalty below the soft start (L_max − L_cache = 80), linear to −λ at the cap
    assert soft_overlong_penalty(80, 100, 20, 1.0) == 0.0
    assert soft_overlong_penalty(90, 100, 20, 1.0) == pytest.approx(-0.5)
    assert soft_overlong_penalty(100, 100, 20, 0.5) == pytest.approx(-0.5)
    # the ramp: overlong_cache tokens when set, else that share of the cap (DAPO's preset: 4,096 of 20,480)
    assert overlong_ramp(0, PRESETS["dapo"]["overlong_cache_frac"], 20480) == 4096
    assert overlong_ramp(512, 0.2, 20480) == 512 and overlong_ramp(0, 0.0, 20480) == 0
    a = AlgoConfig(overlong_cache_frac=0.2)  # the shaped rewards follow the cap they are given
    g = Group(0, "", "", [Sample([1], [1] * 90, reward=1.0), Sample([1], [1] * 70, reward=1.0)])
    assert shaped_rewards([g], a, 100).tolist() == [[pytest.approx(0.5), 1.0]]  # ramp 20: 80..100


def test_curriculum_budget_and_replay():
    assert budget_weights([0.0, 0.5, 1.0], eps=0.0 + 1e-9)[1] == pytest.approx(1.0, abs=1e-6)
    w = budget_weights([0.0, 0.5], eps=0.05)
    assert w[1] / w[0] == pytest.approx(0.30 / 0.05)
    tracker = PassRateTracker()
    tracker.update("a", [1, 1, 1, 1])
    tracker.update("b", [1, 0, 1, 0])
    assert tracker.rate("a") == 1.0 and tracker.rate("b") == 0.5 and tracker.rate("c") == 0.5
    src = CurriculumSource(["a", "b"], key=lambda x: x, tracker=tracker, eps=0.01, seed=0)
    draws = [src() for _ in range(400)]
    assert draws.count("b") > 0.9 * len(draws)
    gen = torch.Generator().manual_seed(0)
    rows = minibatch_rows(torch.arange(8.0), minibatches=2, epochs=3, prioritized=False, generator=gen)
    assert len(rows) == 6 and all(sorted(torch.cat(rows[i:i + 2]).tolist()) == list(range(8)) for i in (0, 2, 4))
    prio = minibatch_rows(torch.tensor([0.0, 0.0, 0.0, 5.0]), 1, 50, True, gen)
    assert sum(int(r[0]) == 3 for r in prio) > 45  # the large-|Â| row comes first


def test_policy_loss_combines_kl_entropy_and_positive_nll():
    a = AlgoConfig(kl_coef=0.5, entropy_coef=0.1, positive_nll_coef=0.2, kl_estimator="k1")
    logp = torch.tensor([[-1.0, -2.0]])
    mb = {"old_logprobs": logp.clone(), "advantages": torch.zeros(1, 2), "loss_mask": torch.ones(1, 2),
          "ref_logprobs": torch.tensor([[-1.5, -2.0]]), "entropy": torch.tensor([[0.3, 0.4]]),
          "nll_scale": torch.tensor([[1.0, 0.0]])}
    loss, m = policy_loss_fn(a)(logp, mb)
    expected = torch.tensor([[0.5 * 0.5 - 0.1 * 0.3 + 0.2 * 1.0, 0.0 - 0.1 * 0.4]])
    assert torch.allclose(loss, expected)
    assert m["kl_ref"].item() == pytest.approx(0.25)


@pytest.mark.parametrize("agg", ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"])
def test_positive_nll_is_a_mean_over_the_positive_tokens_whatever_the_aggregation(agg):
    """VAPO's LM term is μ·mean over positive samples' tokens of −log p (Yue et al. 2025). Through the aggregation
    weights it was μ·Σ_positive(−log p)/(all tokens): 0.0285 instead of 0.0685 with 10 of 24 tokens positive."""
    mask = torch.zeros(4, 8)
    for i, n in enumerate((3, 5, 6, 8)):
        mask[i, :n] = 1
    positive = mask * torch.tensor([[0.0], [1.0], [0.0], [1.0]])
    weights = aggregation_weights(mask, agg, norm_tokens=8)
    logp = -torch.rand(4, 8, generator=torch.Generator().manual_seed(0))
    scale = positive_nll_scale(positive, weights)
    got = (weights * -logp * scale).sum()
    assert got == pytest.approx(float((-logp * positive).sum() / positive.sum()), rel=1e-6)
    assert not positive_nll_scale(torch.zeros_like(mask), weights).any()  # no positive sample: no term


def test_seq_mean_counts_only_sequences_in_the_loss():
    """A row the over-long filter masked out is not a sequence of the mean (it scaled the others by active/N)."""
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0], [0.0, 0.0, 0.0]])
    w = aggregation_weights(mask, "seq_mean_token_mean")
    assert w.sum().item() == pytest.approx(1.0) and w[1, 0].item() == pytest.approx(0.5)


def test_an_extreme_log_ratio_gives_a_finite_loss():
    """One token with log-ratio 100 made the PPO/GSPO loss and k3 inf (exp overflow): the whole step was skipped."""
    logp, old = torch.tensor([[0.0, -0.1]]), torch.tensor([[-100.0, -0.1]])
    mask, adv = torch.ones(1, 2), torch.full((1, 2), -1.0)
    assert torch.isfinite(ppo_clip_loss(logp, old, adv, mask, 0.2, 0.2)[0]).all()
    assert torch.isfinite(gspo_loss(logp, old * 2, adv, mask, 3e-4, 4e-4)[0]).all()
    assert torch.isfinite(kl_penalty(old, logp, "k3")).all()
    small = ppo_clip_loss(torch.tensor([[-0.9]]), torch.tensor([[-1.0]]), torch.tensor([[1.0]]), torch.ones(1, 1),
                          0.2, 0.2)
    assert small[0].item() == pytest.approx(-torch.exp(torch.tensor(0.1)).item())  # within the clamp: unchanged


def test_build_batch_aligns_labels_logprobs_and_advantages():
    b = build_batch([[5, 6, 7]], [[8, 9]], [[-0.1, -0.2]], [1.5])
    assert b.input_ids.tolist() == [[5, 6, 7, 8]] and b.labels.tolist() == [[6, 7, 8, 9]]
    assert b.loss_mask.tolist() == [[0, 0, 1, 1]]
    assert b.old_logprobs.tolist()[0][2:] == pytest.approx([-0.1, -0.2])
    assert b.advantages.tolist() == [[0, 0, 1.5, 1.5]]
    with pytest.raises(ValueError, match="row 0: 1 behaviour logprobs for 2 response tokens"):
        build_batch([[5, 6, 7]], [[8, 9]], [[-0.1]], [1.5])  # it broadcast over the response


def test_lr_schedule_warmup_then_cosine():
    from megarl.trainer.lr_schedule import lr_at

    assert [lr_at(i, 1.0, 4, "constant", 10) for i in range(5)] == [0.25, 0.5, 0.75, 1.0, 1.0]
    assert lr_at(4, 1.0, 4, "cosine", 14, min_lr=0.1) == pytest.approx(1.0)
    assert lr_at(9, 1.0, 4, "cosine", 14, min_lr=0.1) == pytest.approx(0.55)
    assert lr_at(14, 1.0, 4, "cosine", 14, min_lr=0.1) == pytest.approx(0.1)
    from megarl.config import load_config
    from megarl.trainer.lr_schedule import policy_lr

    # the policy's warm-up starts with its first update, after the critic's value pre-training (VAPO)
    cfg = load_config(None, ["algo.preset=vapo", "algo.critic_warmup_steps=3", "optim.lr=1.0",
                             "optim.lr_warmup_steps=2", "train.steps=10"])
    assert [policy_lr(cfg, s) for s in range(3, 6)] == [0.5, 1.0, 1.0]
    assert policy_lr(load_config(None, ["optim.lr=1.0", "optim.lr_warmup_steps=2"]), 0) == 0.5


def test_decoupled_ppo_clips_against_the_proximal_policy_with_a_token_is_weight():
    from megarl.config.schema import AlgoConfig
    from megarl.trainer.rl_update import proximal_level

    assert proximal_level(AlgoConfig(), False) is None  # plain PPO: the ratio against the behaviour logprobs
    assert proximal_level(AlgoConfig(), True) == "token"
    assert proximal_level(AlgoConfig(tis="sequence"), True) == "sequence"
    prox, beh = torch.log(torch.tensor([[0.5, 0.9]])), torch.log(torch.tensor([[0.1, 0.9]]))
    w = mismatch_weights(prox, beh, torch.ones(1, 2), proximal_level(AlgoConfig(), True), cap=2.0)
    assert torch.allclose(w, torch.tensor([[2.0, 1.0]]))  # min(π_prox/π_behaviour, cap) per token


# ρ = π_prox/π_behaviour = [0.25, 0.5, 1.5, 2.0, 3.0], exact in float32 (powers of two over the behaviour's 0.25)
PROX = torch.log(torch.tensor([[0.0625, 0.125, 0.375, 0.5, 0.75]]))
BEHAVIOUR = torch.log(torch.full((1, 5), 0.25))


def test_mask_token_keeps_rho_inside_the_band_and_drops_the_token_outside():
    """IcePop / masked IS: w_t = ρ_t on [low, high] (bounds inclusive), 0 outside; TIS truncates instead."""
    mask = torch.ones(1, 5)
    w = mismatch_weights(PROX, BEHAVIOUR, mask, "mask_token", low=0.5, high=2.0)
    assert w.tolist()[0] == [0.0, 0.5, 1.5, 2.0, 0.0]  # 0.5 and 2.0 sit exactly on the bounds: kept
    tis = mismatch_weights(PROX, BEHAVIOUR, mask, "token", cap=2.0)
    assert tis.tolist()[0] == [0.25, 0.5, 1.5, 2.0, 2.0]  # truncated, never dropped
    off = torch.tensor([[1.0, 1, 1, 1, 0]])  # a position off the loss mask has weight 0 whatever its ratio
    wide = mismatch_weights(PROX, BEHAVIOUR, off, "mask_token", low=0.1, high=5.0)
    assert wide.tolist()[0] == [0.25, 0.5, 1.5, 2.0, 0]
    f = masked_fractions(w, mask)
    assert f["mismatch/masked_token_frac"].item() == pytest.approx(2 / 5)
    assert f["mismatch/masked_seq_frac"].item() == 1.0  # the one sequence has a dropped token
    # a dropped token sends no gradient and adds 0 to the loss; it stays in token_mean's denominator (IcePop)
    logp = PROX.clone().requires_grad_(True)
    loss, _ = ppo_clip_loss(logp, PROX, torch.ones(1, 5), mask, 0.2, 0.2, is_weight=w)
    (loss * aggregation_weights(mask, "token_mean")).sum().backward()
    assert logp.grad.tolist()[0] == pytest.approx([0.0, -0.5 / 5, -1.5 / 5, -2.0 / 5, 0.0])


def test_mask_sequence_drops_a_sequence_by_its_geometric_mean_ratio():
    """w_t = 1 on every token of a sequence whose exp(mean_t log ρ_t) is in the band, else 0."""
    beh = torch.log(torch.full((4, 2), 0.125))
    # token ratios per row: [2, 0.5] (geo 1: kept, though each token is at a bound), [4, 1] (geo 2: on the bound,
    # kept), [4, 4] (geo 4: dropped), [8, 8] with no trained token (not a sequence of the batch)
    prox = torch.log(torch.tensor([[0.25, 0.0625], [0.5, 0.125], [0.5, 0.5], [1.0, 1.0]]))
    mask = torch.tensor([[1.0, 1], [1, 1], [1, 1], [0, 0]])
    w = mismatch_weights(prox, beh, mask, "mask_sequence", low=0.5, high=2.0)
    assert w.tolist() == [[1, 1], [1, 1], [0, 0], [0, 0]]
    f = masked_fractions(w, mask)
    assert f["mismatch/masked_token_frac"].item() == pytest.approx(2 / 6)
    assert f["mismatch/masked_seq_frac"].item() == pytest.approx(1 / 3)  # of the 3 sequences with tokens
    tight = mismatch_weights(prox, beh, mask, "mask_sequence", low=0.999, high=1.001)
    assert tight.tolist() == [[1, 1], [0, 0], [0, 0], [0, 0]]  # only the row whose ratios cancel


def test_an_empty_loss_mask_gives_zero_weights_and_finite_metrics():
    empty = torch.zeros(1, 5)
    for mode in ("token", "sequence", "mask_token", "mask_sequence"):
        assert not mismatch_weights(PROX, BEHAVIOUR, empty, mode).any()
    values = {**mismatch_metrics(PROX, BEHAVIOUR, empty), **masked_fractions(torch.zeros(1, 5), empty)}
    assert all(v.item() == 0.0 for v in values.values())
    with pytest.raises(ValueError, match="unknown mismatch correction 'mask'"):
        mismatch_weights(PROX, BEHAVIOUR, empty, "mask")


def test_mismatch_kl_is_the_k3_estimate_and_zero_when_the_logprobs_agree():
    mask = torch.tensor([[1.0, 1, 1, 1, 0]])  # ρ = 0.25, 0.5, 1.5, 2.0 on the trained tokens
    m = mismatch_metrics(PROX, BEHAVIOUR, mask)
    k3 = [(r - 1) - math.log(r) for r in (0.25, 0.5, 1.5, 2.0)]  # E_behaviour[(ρ − 1) − log ρ] = KL(π_b ‖ π_trainer)
    assert m["mismatch/kl"].item() == pytest.approx(sum(k3) / 4, rel=1e-6)
    assert m["mismatch/abs_mean"].item() == pytest.approx(sum(abs(math.log(r)) for r in (0.25, 0.5, 1.5, 2.0)) / 4)
    nll = -sum(math.log(p) for p in (0.0625, 0.125, 0.375, 0.5)) / 4  # the trainer's mean −log p of the samples
    assert m["mismatch/nll"].item() == pytest.approx(nll, rel=1e-6)
    same = mismatch_metrics(PROX, PROX.clone(), mask)
    assert same["mismatch/kl"].item() == 0.0 and same["mismatch/abs_mean"].item() == 0.0
    # a gap of ~1e-6 (the same weights in fp32): k3 ≈ (log ρ)²/2, where float32's exp(x) − 1 − x rounds to either
    # sign (its mean was −7e-11 in a run)
    tiny = torch.tensor([[1e-6, -1e-6, 2e-6, -3e-7, 0.0]])
    kl = mismatch_metrics(tiny, torch.zeros(1, 5), mask)["mismatch/kl"].item()
    assert kl == pytest.approx(sum(x * x / 2 for x in (1e-6, -1e-6, 2e-6, -3e-7)) / 4, rel=1e-3)


def test_cispo_weights_minus_adv_log_p_by_the_clipped_detached_ratio():
    """ℓ_t = −sg(clip(r_t, 1−ε_low, 1+ε_high))·Â_t·log π(y_t): ∇ = −clip(r_t)·Â_t on every token, also where
    PPO-clip's min sends nothing (r above the band with Â > 0, below it with Â < 0)."""
    old = torch.log(torch.tensor([[0.4, 0.5, 0.05, 0.8]]))
    # r = 0.5 (Â < 0: PPO clips at 0.8), 1.1 (inside), 10 (Â > 0: PPO clips at 1.2), 1.0
    logp = torch.log(torch.tensor([[0.2, 0.55, 0.5, 0.8]])).requires_grad_(True)
    adv, mask = torch.tensor([[-1.0, 2.0, 1.0, 0.5]]), torch.ones(1, 4)
    loss, m = cispo_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.2)
    weight = [0.8, 1.1, 1.2, 1.0]
    expected = [-w * a * lp for w, a, lp in zip(weight, adv[0].tolist(), logp[0].tolist())]
    assert loss[0].tolist() == pytest.approx(expected, rel=1e-5)
    loss.sum().backward()
    # detached weight: exactly −clip(r)·Â (with the weight not detached, the in-band token would also get −r·Â·log p)
    assert logp.grad[0].tolist() == pytest.approx([-w * a for w, a in zip(weight, adv[0].tolist())], rel=1e-5)
    assert m["clip_frac"].item() == pytest.approx(0.5)  # two weights at a bound, both still with a gradient
    ppo_logp = logp.detach().clone().requires_grad_(True)
    ppo, _ = ppo_clip_loss(ppo_logp, old, adv, mask, 0.2, 0.2)
    ppo.sum().backward()
    assert ppo_logp.grad[0, 0].item() == 0.0 and ppo_logp.grad[0, 2].item() == 0.0  # PPO-clip drops both
    assert logp.grad[0, 0].item() != 0.0 and logp.grad[0, 2].item() != 0.0


def test_cispo_on_policy_is_ppo_and_takes_the_is_weight_and_no_lower_bound():
    old = torch.log(torch.tensor([[0.3, 0.6]]))
    adv, mask = torch.tensor([[1.0, -2.0]]), torch.ones(1, 2)
    grads = []
    for fn in (cispo_loss, ppo_clip_loss):
        logp = old.clone().requires_grad_(True)
        fn(logp, old, adv, mask, 0.2, 0.2)[0].sum().backward()
        grads.append(logp.grad)
    assert torch.allclose(grads[0], grads[1]) and torch.allclose(grads[0], -adv)  # r = 1: both −Â·∇log π
    w = torch.tensor([[0.5, 0.0]])  # e.g. a mismatch weight: the dropped token sends nothing
    logp = old.clone().requires_grad_(True)
    cispo_loss(logp, old, adv, mask, 0.2, 0.2, is_weight=w)[0].sum().backward()
    assert logp.grad.tolist()[0] == pytest.approx([-0.5, 0.0])
    # ε_low = 1 (the preset's): no lower bound, a ratio of 0.01 is its own weight
    far = torch.log(torch.tensor([[0.003, 0.6]]))
    loss, m = cispo_loss(far, old, adv, mask, clip_low=1.0, clip_high=4.0)
    assert loss[0, 0].item() == pytest.approx(-0.01 * 1.0 * math.log(0.003), rel=1e-4) and m["clip_frac"] == 0


def test_policy_loss_fn_runs_cispo_and_measures_the_mismatch_on_request():
    a = AlgoConfig(policy_loss="cispo", clip_low=1.0, clip_high=4.0)
    mask = torch.tensor([[1.0, 1, 1, 1, 0]])
    mb = {"old_logprobs": BEHAVIOUR, "advantages": torch.ones(1, 5), "loss_mask": mask}
    loss, m = policy_loss_fn(a)(PROX, mb)
    direct, _ = cispo_loss(PROX, BEHAVIOUR, mb["advantages"], mask, 1.0, 4.0)
    assert torch.equal(loss, direct) and not any(k.startswith("mismatch/") for k in m)
    _, measured = policy_loss_fn(a, measure_mismatch=True)(PROX, mb)
    expected = mismatch_metrics(PROX, BEHAVIOUR, mask)
    assert {k: v.item() for k, v in measured.items() if k.startswith("mismatch/")} == \
        {k: v.item() for k, v in expected.items()}


def test_the_proximal_correction_weights_masks_and_reports_the_batch():
    from megarl.trainer.rl_update import proximal_correction, proximal_level

    batch = build_batch([[5, 6]], [[7, 8, 9, 10, 11]], [BEHAVIOUR[0].tolist()], [1.0])
    prox = torch.zeros_like(batch.old_logprobs)
    prox[:, -5:] = PROX  # the response's label positions
    a = AlgoConfig(tis="mask_token", mask_low=0.5, mask_high=2.0)
    assert proximal_level(a, False) == "mask_token"
    out = proximal_correction(prox, batch, proximal_level(a, False), a)
    assert batch.is_weight[0, -5:].tolist() == [0.0, 0.5, 1.5, 2.0, 0.0] and not batch.is_weight[0, :-5].any()
    assert torch.equal(batch.old_logprobs, prox)  # the ratio is now against the proximal policy
    assert out["mismatch/masked_token_frac"] == pytest.approx(0.4) and out["mismatch/masked_seq_frac"] == 1.0
    assert out["mismatch/abs_max"] == pytest.approx(math.log(4)) and out["mismatch/kl"] > 0
    tis = build_batch([[5, 6]], [[7, 8, 9, 10, 11]], [BEHAVIOUR[0].tolist()], [1.0])
    assert "mismatch/masked_token_frac" not in proximal_correction(prox, tis, "token", AlgoConfig(tis="token"))


def test_k3_estimates_keep_their_precision_for_small_log_ratios():
    """k3 = e^x − 1 − x at the small |x| of a near-on-policy step: computed through expm1, fp32 keeps ~1e-6 of it
    (through exp(x) − 1 a relative error of ~1e-3 at x = 1e-2: the packed and padded runs' metrics then differed by
    1e-4 from rounding alone)."""
    from megarl.algo.losses import kl_penalty, mismatch_metrics, ppo_clip_loss

    x64 = torch.linspace(-3e-2, 3e-2, 101, dtype=torch.float64).unsqueeze(0)
    exact = (torch.expm1(x64) - x64).mean()
    x = x64.float()
    zeros, ones = torch.zeros_like(x), torch.ones_like(x)
    _, metrics = ppo_clip_loss(x, zeros, ones, ones, 0.2, 0.2)
    assert float(metrics["approx_kl"]) == pytest.approx(float(exact), rel=1e-5)
    each, big = torch.expm1(x64) - x64, x64.abs() >= 5e-3  # k3 of every token with |x| ≥ 5e-3: each within 1e-4
    error = (kl_penalty(zeros, x, "k3").double() - each).abs() / each.clamp(min=1e-12)
    assert error[big].max() < 1e-4  # (through exp(x) − 1: up to 5e-3)
    assert float(mismatch_metrics(x, zeros, ones)["mismatch/kl"]) == pytest.approx(float(exact), rel=1e-5)
