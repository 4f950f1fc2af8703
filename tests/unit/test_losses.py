"""Bradley–Terry loss, SFT NLL, PPO policy/value losses, entropy (docs/pitfalls.md: degenerate pairs, dropout, value positions, SFT labels)."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch.testing import assert_close

from rlhf_lit.functional import (
    bt_pairwise_loss,
    entropy_from_logits,
    ppo_policy_loss,
    ppo_value_loss,
    sft_nll,
)
from rlhf_lit.functional.policy_gradient import rollout_is_weights


def close(actual, expected, atol=1e-6):
    assert_close(actual, torch.as_tensor(expected, dtype=actual.dtype), atol=atol, rtol=1e-6)


# ---------------------------------------------------------------- Bradley–Terry


def test_bt_loss_hand_values():
    chosen, rejected = torch.tensor([1.0, 0.0, 2.0]), torch.tensor([0.0, 0.0, 3.0])
    # d = [1, 0, -1]; loss = ln(1 + e^-d) = [ln 1.367879, ln 2, ln 3.718282]
    close(bt_pairwise_loss(chosen, rejected), [0.313262, 0.693147, 1.313262])


def test_bt_loss_identical_pair_is_ln2_b02():
    loss = bt_pairwise_loss(torch.tensor([0.37]), torch.tensor([0.37]))
    close(loss, [math.log(2)])


def test_bt_loss_margin_llama2():
    # d = 1 - 0 - 0.5 = 0.5 -> ln(1 + e^-0.5) = ln(1.606531) = 0.474077
    loss = bt_pairwise_loss(torch.tensor([1.0]), torch.tensor([0.0]), margin=torch.tensor([0.5]))
    close(loss, [0.474077])


def test_bt_loss_label_smoothing():
    # -(0.9) log s(1) - 0.1 log s(-1) = 0.9 * 0.313262 + 0.1 * 1.313262 = 0.413262
    loss = bt_pairwise_loss(torch.tensor([1.0, 0.0]), torch.tensor([0.0, 0.0]), label_smoothing=0.1)
    close(loss, [0.413262, 0.693147])  # d = 0 stays ln 2
    with pytest.raises(ValueError, match="label_smoothing"):
        bt_pairwise_loss(torch.tensor([1.0]), torch.tensor([0.0]), label_smoothing=0.6)


def test_bt_loss_property_decreasing_in_margin_and_stable():
    d = torch.linspace(-50, 50, 101, dtype=torch.float64)
    loss = bt_pairwise_loss(d, torch.zeros_like(d))
    assert torch.all(loss[1:] < loss[:-1])
    # smoothed: softplus(-d) + s*d is smallest at d = ln((1 - s) / s) = ln 19 = 2.944439 for s = 0.05
    d = torch.linspace(0, 6, 601, dtype=torch.float64)
    smoothed = bt_pairwise_loss(d, torch.zeros_like(d), label_smoothing=0.05)
    close(d[smoothed.argmin()], 2.94, atol=0.006)
    close(bt_pairwise_loss(torch.tensor([-100.0]), torch.tensor([0.0])), [100.0])  # no inf
    chosen = torch.tensor([0.0], requires_grad=True)
    bt_pairwise_loss(chosen, torch.tensor([0.0])).sum().backward()
    close(chosen.grad, [-0.5])  # d/dd softplus(-d) = -sigmoid(-d) = -0.5 at d = 0


# ---------------------------------------------------------------- SFT


def test_sft_nll_shift_alignment_hand_value():
    logits = torch.tensor(
        [
            [
                [2.0, 1.0, 0.0],  # predicts labels[1] = 0: log p = -0.407606
                [0.0, 0.0, 0.0],  # predicts labels[2] = 2: log p = -ln 3 = -1.098612
                [50.0, -50.0, 0.0],  # predicts nothing (no label after the last token)
            ]
        ]
    )
    loss, num_tokens = sft_nll(logits, torch.tensor([[-100, 0, 2]]))
    close(loss, (0.407606 + 1.098612) / 2)  # 0.753109
    assert num_tokens == 2


def test_sft_nll_b16_labels_token_mean():
    labels = torch.tensor([[-100, -100, -100, -100, 6, 7, 2], [-100, -100, -100, -100, 6, 2, -100]])
    loss, num_tokens = sft_nll(torch.zeros(2, 7, 8), labels)
    assert num_tokens == 5  # 3 + 2 response tokens, EOS included
    close(loss, math.log(8))  # uniform over 8 tokens


def test_sft_nll_equals_cross_entropy_on_random_input():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 6, 10, generator=gen)
    labels = torch.randint(0, 10, (3, 6), generator=gen)
    labels[0, :3] = -100
    labels[2, 4:] = -100
    expected = F.cross_entropy(logits[:, :-1].reshape(-1, 10), labels[:, 1:].reshape(-1), ignore_index=-100)
    loss, _ = sft_nll(logits, labels)
    assert_close(loss, expected)


def test_sft_nll_no_label_tokens_raises():
    with pytest.raises(ValueError, match="no label tokens"):
        sft_nll(torch.zeros(1, 3, 4), torch.tensor([[5, -100, -100]]))  # labels[0] is never used


# ---------------------------------------------------------------- PPO policy loss


def policy_case():
    # pitfall: value positions: (ratio 1.5, A +1), (0.5, -1), (0.5, +1), then a padded slot with garbage
    old = torch.zeros(1, 4)
    new = torch.tensor([[math.log(1.5), math.log(0.5), math.log(0.5), 30.0]], requires_grad=True)
    adv = torch.tensor([[1.0, -1.0, 1.0, 5.0]])
    return new, old, adv, torch.tensor([[1, 1, 1, 0]], dtype=torch.bool)


def test_policy_loss_b13_per_token():
    for ratio, adv, expected in ((1.5, 1.0, -1.2), (0.5, -1.0, 0.8), (0.5, 1.0, -0.5)):
        # (1.5,+1): max(-1.5, -1.2); (0.5,-1): max(0.5, 0.8); (0.5,+1): max(-0.5, -0.8)
        logp = torch.tensor([[math.log(ratio)]])
        loss, _ = ppo_policy_loss(logp, torch.zeros(1, 1), torch.tensor([[adv]]), torch.ones(1, 1), 0.2)
        close(loss, expected)


def test_policy_loss_b13_batch_stats_and_gradient():
    new, old, adv, mask = policy_case()
    loss, stats = ppo_policy_loss(new, old, adv, mask, clip_range=0.2)
    close(loss, (-1.2 + 0.8 - 0.5) / 3)  # -0.3; the pad is ignored
    close(stats["clipfrac"], 2 / 3)  # the clipped term binds on tokens 0 and 1
    # approx_kl = mean((r - 1) - ln r) = (0.094535 + 0.193147 + 0.193147) / 3
    close(stats["approx_kl"], 0.160276)
    close(stats["ratio_mean"], (1.5 + 0.5 + 0.5) / 3)
    close(stats["dual_clipfrac"], 0.0)
    assert all(not v.requires_grad for v in stats.values())
    loss.backward()
    # clipped tokens get no gradient; token 2: d(-A r)/d logp / 3 = -0.5 / 3
    close(new.grad, [[0.0, 0.0, -0.5 / 3, 0.0]])


def test_policy_loss_first_minibatch_ratio_one_b12():
    adv = torch.tensor([[0.5, -1.5, 2.0]])
    logp = torch.tensor([[-1.0, -2.0, -3.0]])
    loss, stats = ppo_policy_loss(logp, logp.clone(), adv, torch.ones(1, 3), 0.2)
    close(loss, -1.0 / 3)  # -mean(A) = -(0.5 - 1.5 + 2) / 3
    close(stats["clipfrac"], 0.0)
    close(stats["approx_kl"], 0.0)
    close(stats["ratio_mean"], 1.0)


def test_policy_loss_dual_clip():
    logp = torch.log(torch.tensor([[5.0, 2.0, 5.0]]))
    adv = torch.tensor([[-1.0, -1.0, 1.0]])
    loss, stats = ppo_policy_loss(logp, torch.zeros(1, 3), adv, torch.ones(1, 3), 0.2, dual_clip=3.0)
    # A<0, r=5: max(5, 1.2) = 5 capped at -3*A = 3; A<0, r=2: 2 < 3 stays; A>0, r=5: max(-5, -1.2) = -1.2
    close(loss, (3.0 + 2.0 - 1.2) / 3)
    close(stats["dual_clipfrac"], 1 / 3)
    with pytest.raises(ValueError, match="dual_clip"):
        ppo_policy_loss(logp, torch.zeros(1, 3), adv, torch.ones(1, 3), 0.2, dual_clip=1.0)
    with pytest.raises(ValueError, match="clip_range"):
        ppo_policy_loss(logp, torch.zeros(1, 3), adv, torch.ones(1, 3), 0.0)


def test_policy_loss_with_truncated_importance_weights_by_hand():
    # ratios 1.1, 0.5, 2.0 (eps 0.2) with A = +1, -1, +1: clipped terms -1.1, +0.8, -1.2; weights 0.5, 2, 1;
    # the third token is padding (mask 0): (-0.55 + 1.6) / 2 = 0.525; the statistics ignore the weights
    logp = torch.log(torch.tensor([[1.1, 0.5, 2.0]])).requires_grad_()
    adv = torch.tensor([[1.0, -1.0, 1.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    is_weights = torch.tensor([[0.5, 2.0, 1.0]])
    loss, stats = ppo_policy_loss(logp, torch.zeros(1, 3), adv, mask, 0.2, is_weights=is_weights)
    close(loss, 0.525)
    _, plain = ppo_policy_loss(logp, torch.zeros(1, 3), adv, mask, 0.2)
    for key in ("clipfrac", "approx_kl", "ratio_mean"):
        close(stats[key], plain[key])
    loss.backward()  # token 1 is unclipped: d/dlogp of -A r w = -1.1 x 0.5 / 2 tokens; token 2 is clipped: 0
    close(logp.grad, torch.tensor([[-0.275, 0.0, 0.0]]))


def test_truncated_is_weights_by_hand():
    """Token-level truncated importance sampling (``ppo.tis_cap``; the ``token`` / ``truncate`` defaults)."""
    trainer = torch.tensor([[-1.0, -2.0, -0.5, -3.0]])
    sampler = torch.tensor([[-1.5, -1.0, float("-inf"), -3.0]])
    known = torch.tensor([[True, True, False, True]])
    mask = torch.ones_like(known)
    # exp(0.5) = 1.6487 capped at 1.5; exp(-1) = 0.36788; unknown: 1 (its -inf never read); equal: 1
    weights, affected = rollout_is_weights(trainer, sampler, known, mask, 1.5)
    close(weights, torch.tensor([[1.5, 0.36788, 1.0, 1.0]]))
    assert affected.tolist() == [[True, False, False, False]]
    with pytest.raises(ValueError, match=">= 1"):
        rollout_is_weights(trainer, sampler, known, mask, 0.5)
    with pytest.raises(ValueError, match="one shape"):
        rollout_is_weights(trainer, sampler[:, :3], known, mask, 2.0)


def test_policy_loss_property_monotone_in_ratio_for_positive_advantage():
    ratios = torch.linspace(0.5, 1.5, 21)
    losses = [
        float(
            ppo_policy_loss(
                torch.log(r).view(1, 1), torch.zeros(1, 1), torch.ones(1, 1), torch.ones(1, 1), 0.2
            )[0]
        )
        for r in ratios
    ]
    assert all(b <= a for a, b in zip(losses, losses[1:]))  # non-increasing, flat beyond 1 + eps
    close(torch.tensor(losses[-1]), -1.2)


# ---------------------------------------------------------------- PPO value loss


def test_value_loss_b13_case_1_and_2():
    returns, mask = torch.tensor([[10.0]]), torch.ones(1, 1)
    # case 1: old 5, new 1 -> clipped 4.8; 0.5 * max((1-10)^2 = 81, (4.8-10)^2 = 27.04) = 40.5
    loss, stats = ppo_value_loss(torch.tensor([[1.0]]), torch.tensor([[5.0]]), returns, mask, 0.2)
    close(loss, 40.5)
    close(stats["value_clipfrac"], 1.0)  # |1 - 5| = 4 > 0.2, measured before clipping
    # case 2: old 1, new 5 -> clipped 1.2; 0.5 * max(25, (1.2-10)^2 = 77.44) = 38.72
    loss, _ = ppo_value_loss(torch.tensor([[5.0]]), torch.tensor([[1.0]]), returns, mask, 0.2)
    close(loss, 38.72, atol=1e-5)


def test_value_loss_batch_with_padding_and_no_clip():
    values = torch.tensor([[1.0, 5.0, 123.0]])
    old = torch.tensor([[5.0, 1.0, -7.0]])
    returns = torch.tensor([[10.0, 10.0, 0.0]])
    mask = torch.tensor([[1, 1, 0]])
    loss, stats = ppo_value_loss(values, old, returns, mask, value_clip_range=0.2)
    close(loss, 0.5 * (81.0 + 77.44) / 2, atol=1e-5)  # 39.61
    close(stats["value_clipfrac"], 1.0)
    loss, stats = ppo_value_loss(values, old, returns, mask)
    close(loss, 0.5 * (81.0 + 25.0) / 2)  # 26.5
    close(stats["value_clipfrac"], 0.0)


def test_value_loss_new_equals_old_clipped_equals_unclipped():
    values = torch.tensor([[0.3, -1.2, 2.5]])
    returns = torch.tensor([[1.0, 0.0, 2.0]])
    clipped, stats = ppo_value_loss(values, values.clone(), returns, torch.ones(1, 3), 0.2)
    unclipped, _ = ppo_value_loss(values, values.clone(), returns, torch.ones(1, 3))
    assert_close(clipped, unclipped)
    close(unclipped, 0.5 * (0.49 + 1.44 + 0.25) / 3)
    close(stats["value_clipfrac"], 0.0)
    with pytest.raises(ValueError, match="value_clip_range"):
        ppo_value_loss(values, values, returns, torch.ones(1, 3), 0.0)


# ---------------------------------------------------------------- entropy


def test_entropy_hand_values():
    logits = torch.tensor(
        [
            [
                [0.0, 0.0, 0.0, 0.0],  # uniform over 4: ln 4 = 1.386294
                [0.0, 0.0, math.log(2.0), float("-inf")],  # p = [.25, .25, .5, 0]: 0.5 ln 4 + 0.5 ln 2
                [0.0, 0.0, float("-inf"), float("-inf")],  # ln 2, and 0 log 0 = 0
            ]
        ]
    )
    close(entropy_from_logits(logits), [[1.386294, 1.039721, 0.693147]])


def test_entropy_temperature_and_chunks():
    logits = torch.tensor([[[0.0, 0.0, 2 * math.log(2.0)]]])
    close(entropy_from_logits(logits, temperature=2.0), [[1.039721]])  # logits / 2 = [0, 0, ln 2]
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 4, 9, generator=gen)
    expected = torch.distributions.Categorical(logits=logits).entropy()
    assert_close(entropy_from_logits(logits, chunk_size=2), expected)
    assert entropy_from_logits(logits.to(torch.bfloat16)).dtype == torch.float32


def test_entropy_property_increases_with_temperature():
    logits = torch.tensor([[[3.0, 1.0, 0.0, -2.0]]])
    values = [float(entropy_from_logits(logits, temperature=t)) for t in (0.25, 0.5, 1.0, 2.0, 8.0)]
    assert values == sorted(values) and values[-1] < math.log(4)


def test_label_smoothing_has_one_range_everywhere_it_is_checked():
    # eps = 0.5 says nothing about a pair (the loss is smallest at a zero margin whatever the label), so every
    # place refuses it: the reward model's loss, DPO's, and the checks `plan`/`validate` run before loading
    from rlhf_lit.checks.rules import model_ranges
    from rlhf_lit.functional.preference import preference_loss
    from rlhf_lit.ranges import LABEL_SMOOTHING
    from rlhf_lit.stages import STAGES, import_path

    zero = torch.zeros(1)
    for eps, allowed in ((0.0, True), (0.49, True), (0.5, False), (-0.01, False), (float("nan"), False)):
        assert LABEL_SMOOTHING.allows(eps) is allowed
        for stage in ("reward", "dpo"):
            rules = model_ranges(import_path(STAGES[stage].module), STAGES[stage])  # what the CLI's checks read
            assert rules["label_smoothing"].allows(eps) is allowed
        calls = (
            lambda e=eps: bt_pairwise_loss(zero, zero, label_smoothing=e),
            lambda e=eps: preference_loss(zero, zero, beta=0.1, loss_type="label_smoothing", label_smoothing=e),
        )
        for call in calls:
            if allowed:
                assert torch.isfinite(call()).all()
            else:
                with pytest.raises(ValueError, match=r"label_smoothing must be a (finite )?number in \[0, 0.5\)"):
                    call()
