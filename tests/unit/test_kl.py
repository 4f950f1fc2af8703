"""KL estimators and shaped token rewards (docs/pitfalls.md: score slot, GAE over padding, KL estimators)."""

import pytest
import torch
from torch.testing import assert_close

from rlhf_lit.functional import kl_per_token, shaped_rewards


def close(actual, expected, atol=1e-6):
    assert_close(actual, torch.as_tensor(expected, dtype=actual.dtype), atol=atol, rtol=1e-6)


# pitfall: KL estimators: sampled-token log-probs
LOGP = torch.tensor([[-1.0, -2.0]])
REF = torch.tensor([[-1.5, -1.0]])


def test_k1_b09_can_be_negative():
    kl = kl_per_token(LOGP, REF, "k1")
    close(kl, [[0.5, -1.0]])  # -1 - (-1.5), -2 - (-1)
    close(kl.mean(), -0.25)


def test_k2_b09():
    close(kl_per_token(LOGP, REF, "k2"), [[0.125, 0.5]])  # 0.5 * 0.5^2, 0.5 * 1^2


def test_k3_b09_nonnegative():
    kl = kl_per_token(LOGP, REF, "k3")
    # ref - logp = -0.5: e^-0.5 - 1 + 0.5 = 0.606531 - 0.5 = 0.106531
    # ref - logp = +1.0: e^1 - 1 - 1 = 0.718282
    close(kl, [[0.106531, 0.718282]])
    close(kl.mean(), 0.412406)


def test_abs_b09():
    close(kl_per_token(LOGP, REF, "abs"), [[0.5, 1.0]])


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3", "abs"])
def test_policy_equal_to_reference_gives_exact_zero(estimator):
    logp = torch.tensor([[-0.3, -2.2, -7.0]])
    assert torch.equal(kl_per_token(logp, logp.clone(), estimator), torch.zeros(1, 3))


def test_property_k2_k3_abs_nonnegative_and_k3_second_order_matches_k2():
    gen = torch.Generator().manual_seed(0)
    logp = -torch.rand(8, 16, generator=gen, dtype=torch.float64) * 5
    ref = logp + 0.01 * torch.randn(8, 16, generator=gen, dtype=torch.float64)
    for estimator in ("k2", "k3", "abs"):
        assert bool((kl_per_token(logp, ref, estimator) >= 0).all())
    # near r = 1, k3 = (r - 1) - log r ~ 0.5 (log r)^2 = k2 (differs at third order)
    assert_close(kl_per_token(logp, ref, "k3"), kl_per_token(logp, ref, "k2"), atol=1e-6, rtol=0.05)


def test_log_ratio_is_clamped_to_20_nats_so_every_estimator_stays_finite():
    # policy log-prob -101, reference -1: log-ratio -100 (and +100 the other way round)
    logp = torch.tensor([[-101.0, -1.0, -1.0]])
    ref = torch.tensor([[-1.0, -101.0, -1.5]])
    assert torch.isinf(torch.expm1(torch.tensor(100.0)))  # unclamped k3 = e^100 - 1 - 100: inf in float32
    # clamped: k1 = [-20, 20, 0.5]; k3 = e^20 - 1 - 20 = 485165174.4 at -20, e^-20 - 1 + 20 at +20
    close(kl_per_token(logp, ref, "k1"), [[-20.0, 20.0, 0.5]])
    k3 = kl_per_token(logp, ref, "k3")
    assert torch.isfinite(k3).all()
    assert_close(k3, torch.tensor([[485165174.4, 19.0, 0.106531]]), rtol=1e-6, atol=1e-6)
    close(kl_per_token(logp, ref, "k2"), [[200.0, 200.0, 0.125]])
    # inside the range nothing changes; the clamp can be switched off; NaN is not hidden
    close(kl_per_token(logp, ref, "k1", log_ratio_clamp=None), [[-100.0, 100.0, 0.5]])
    assert torch.isnan(kl_per_token(torch.tensor([[float("nan")]]), torch.tensor([[-1.0]]), "k3")).all()
    with pytest.raises(ValueError, match="log_ratio_clamp"):
        kl_per_token(logp, ref, "k1", log_ratio_clamp=0.0)


def test_unknown_estimator_raises():
    with pytest.raises(ValueError, match="k1"):
        kl_per_token(LOGP, REF, "full")


def test_shaped_rewards_b07():
    # policy [-1, -0.5, -2], ref [-1.2, -0.4, -2.5] -> k1 [0.2, -0.1, 0.5]; the 4th slot is padding
    logp = torch.tensor([[-1.0, -0.5, -2.0, 0.0]])
    ref = torch.tensor([[-1.2, -0.4, -2.5, -9.0]])
    mask = torch.tensor([[1, 1, 1, 0]], dtype=torch.bool)
    kl = kl_per_token(logp, ref)
    close(kl[:, :3], [[0.2, -0.1, 0.5]])
    rewards, non_score = shaped_rewards(torch.tensor([1.0]), kl, mask, kl_coef=0.1)
    close(non_score, [[-0.02, 0.01, -0.05, 0.0]])  # -0.1 * kl; 0 on padding
    close(rewards, [[-0.02, 0.01, 0.95, 0.0]])  # score 1 at the last real token (-0.05 + 1)


def test_shaped_rewards_b05_eos_no_eos_and_left_padding():
    kl = torch.tensor(
        [
            [0.2, -0.1, 0.5, 0.0, 0.0],  # [t0, t1, EOS, PAD, PAD]
            [0.0, 0.0, 0.0, 0.0, 0.0],  # no EOS: filled max_new_tokens = 5
            [0.0, 0.0, 0.1, 0.2, 0.0],  # left padded: real tokens at 2..4
        ]
    )
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [0, 0, 1, 1, 1]])
    rewards, _ = shaped_rewards(torch.tensor([1.0, 2.0, 3.0]), kl, mask, kl_coef=0.1)
    expected = [
        [-0.02, 0.01, 0.95, 0.0, 0.0],  # score at index 2 (the EOS), not on the pad at 3
        [0.0, 0.0, 0.0, 0.0, 2.0],  # score at index 4
        [0.0, 0.0, -0.01, -0.02, 3.0],  # score at the last real token, index 4
    ]
    close(rewards, expected)
    # positions that reach the losses = real response tokens: 3, 5, 3
    assert mask.sum(-1).tolist() == [3, 5, 3]


def test_shaped_rewards_one_token_response_and_garbage_on_padding():
    kl = torch.tensor([[0.3, float("nan"), float("inf")]])
    rewards, non_score = shaped_rewards(torch.tensor([2.0]), kl, torch.tensor([[1, 0, 0]]), 0.1)
    close(rewards, [[1.97, 0.0, 0.0]])  # -0.1 * 0.3 + 2
    close(non_score, [[-0.03, 0.0, 0.0]])


def test_shaped_rewards_tensor_coef_no_in_place_and_empty_row_raises():
    kl = torch.tensor([[0.2, 0.4]])
    before = kl.clone()
    rewards, _ = shaped_rewards(torch.tensor([0.5]), kl, torch.ones(1, 2), torch.tensor(0.5))
    close(rewards, [[-0.1, 0.3]])  # -0.5 * 0.2; -0.5 * 0.4 + 0.5
    assert torch.equal(kl, before)
    with pytest.raises(ValueError, match="no real token"):
        shaped_rewards(torch.tensor([1.0]), kl, torch.zeros(1, 2), 0.1)


def test_shaped_rewards_property_total_reward_is_score_minus_beta_total_kl():
    gen = torch.Generator().manual_seed(0)
    kl = torch.randn(5, 7, generator=gen, dtype=torch.float64)
    mask = torch.arange(7).expand(5, 7) < torch.tensor([[1], [3], [7], [4], [2]])
    scores = torch.randn(5, generator=gen, dtype=torch.float64)
    rewards, _ = shaped_rewards(scores, kl, mask, 0.05)
    assert_close(rewards.sum(-1), scores - 0.05 * (kl * mask).sum(-1))
