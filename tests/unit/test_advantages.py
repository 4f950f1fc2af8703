"""GAE and explained variance (docs/pitfalls.md: score slot, GAE over padding, a plain reference loop)."""

import pytest
import torch
from torch.testing import assert_close

from rlhf_lit.functional import explained_variance, gae


def close(actual, expected, atol=1e-6):
    assert_close(actual, torch.as_tensor(expected, dtype=actual.dtype), atol=atol, rtol=1e-6)


def reference_gae(rewards, values, mask, gamma, lam):
    """A plain per-row loop (padding: no reward, no value, no carry)."""
    adv, last, next_v = [0.0] * len(rewards), 0.0, 0.0
    for t in reversed(range(len(rewards))):
        if not mask[t]:
            continue
        delta = rewards[t] + gamma * next_v - values[t]
        last = delta + gamma * lam * last
        adv[t], next_v = last, values[t]
    return adv, [a + v if m else 0.0 for a, v, m in zip(adv, values, mask)]


# pitfall: GAE over padding (b): rewards from shaped_rewards, values with a padded slot
REWARDS = torch.tensor([[-0.02, 0.01, 0.95, 0.0]])
MASK = torch.tensor([[1, 1, 1, 0]], dtype=torch.bool)


def values_with_pad(pad: float) -> torch.Tensor:
    return torch.tensor([[0.5, 0.4, 0.6, pad]])


def test_gae_b07a_pad_value_100_does_not_leak():
    rewards, values = torch.tensor([[0.0, 1.0, 0.0]]), torch.tensor([[0.0, 0.0, 100.0]])
    adv, ret = gae(rewards, values, torch.tensor([[1, 1, 0]]), gamma=1.0, gae_lambda=0.95)
    # t=1: delta = 1 + 1*0 (V after the last real token) - 0 = 1 -> A = 1
    # t=0: delta = 0 + 1*0 - 0 = 0 -> A = 0 + 0.95 * 1 = 0.95   (the bug gives [5.7, 6.0])
    close(adv, [[0.95, 1.0, 0.0]])
    close(ret, [[0.95, 1.0, 0.0]])


def test_gae_b07b_gamma_1():
    adv, ret = gae(REWARDS, values_with_pad(9.9), MASK, gamma=1.0, gae_lambda=0.95)
    # t=2: delta = 0.95 + 0 - 0.6 = 0.35                          A2 = 0.35
    # t=1: delta = 0.01 + 0.6 - 0.4 = 0.21; A1 = 0.21 + 0.95*0.35 = 0.5425
    # t=0: delta = -0.02 + 0.4 - 0.5 = -0.12; A0 = -0.12 + 0.95*0.5425 = 0.395375
    close(adv, [[0.395375, 0.5425, 0.35, 0.0]])
    close(ret, [[0.895375, 0.9425, 0.95, 0.0]])  # A + V on real tokens


def test_gae_b07b_gamma_099():
    adv, ret = gae(REWARDS, values_with_pad(9.9), MASK, gamma=0.99, gae_lambda=0.95)
    # t=1: delta = 0.01 + 0.99*0.6 - 0.4 = 0.204; A1 = 0.204 + 0.9405*0.35 = 0.533175
    # t=0: delta = -0.02 + 0.99*0.4 - 0.5 = -0.124; A0 = -0.124 + 0.9405*0.533175 = 0.377451
    close(adv, [[0.377451, 0.533175, 0.35, 0.0]])
    close(ret, [[0.877451, 0.933175, 0.95, 0.0]])


@pytest.mark.parametrize("pad", [9.9, 100.0, 1e6, -1e6, float("nan"), float("inf")])
def test_gae_padding_values_change_nothing(pad):
    adv, ret = gae(REWARDS, values_with_pad(pad), MASK, gamma=1.0, gae_lambda=0.95)
    expected_adv, expected_ret = gae(REWARDS, values_with_pad(0.0), MASK, gamma=1.0, gae_lambda=0.95)
    assert torch.equal(adv, expected_adv) and torch.equal(ret, expected_ret)


def test_gae_one_token_response_and_fully_masked_row():
    rewards = torch.tensor([[2.0, 0.0, 0.0], [5.0, 5.0, 5.0]])
    values = torch.tensor([[0.5, 7.0, 7.0], [1.0, 1.0, 1.0]])
    mask = torch.tensor([[1, 0, 0], [0, 0, 0]])
    adv, ret = gae(rewards, values, mask, gamma=0.99, gae_lambda=0.95)
    close(adv, [[1.5, 0.0, 0.0], [0.0, 0.0, 0.0]])  # 2 + 0.99*0 - 0.5
    close(ret, [[2.0, 0.0, 0.0], [0.0, 0.0, 0.0]])


def test_gae_lambda_1_gamma_1_returns_are_reward_to_go():
    rewards = torch.tensor([[1.0, 2.0, 3.0, 0.0]])
    values = torch.tensor([[0.3, -0.2, 0.9, 4.0]])
    adv, ret = gae(rewards, values, torch.tensor([[1, 1, 1, 0]]), gamma=1.0, gae_lambda=1.0)
    close(ret, [[6.0, 5.0, 3.0, 0.0]])  # 1+2+3, 2+3, 3
    close(adv, [[5.7, 5.2, 2.1, 0.0]])  # reward-to-go minus V


def test_gae_equals_plain_loop_on_random_masks():
    gen = torch.Generator().manual_seed(0)
    batch, length = 8, 11
    rewards = torch.randn(batch, length, generator=gen, dtype=torch.float64)
    values = torch.randn(batch, length, generator=gen, dtype=torch.float64)
    lengths = torch.randint(1, length + 1, (batch,), generator=gen)
    positions = torch.arange(length).expand(batch, length)
    right = positions < lengths[:, None]
    left = positions >= (length - lengths[:, None])
    interior = torch.rand(batch, length, generator=gen) > 0.4
    for mask in (right, left, interior):
        for gamma, lam in ((1.0, 0.95), (0.99, 0.9), (0.5, 0.0)):
            adv, ret = gae(rewards, values, mask, gamma, lam)
            for b in range(batch):
                row = reference_gae(rewards[b].tolist(), values[b].tolist(), mask[b].tolist(), gamma, lam)
                assert_close(adv[b], torch.tensor(row[0], dtype=torch.float64))
                assert_close(ret[b], torch.tensor(row[1], dtype=torch.float64))


def test_gae_does_not_edit_inputs_and_upcasts_bf16():
    rewards, values = REWARDS.to(torch.bfloat16), values_with_pad(9.9).to(torch.bfloat16)
    before = values.clone()
    adv, _ = gae(rewards, values, MASK, 1.0, 0.95)
    assert adv.dtype == torch.float32
    assert torch.equal(values, before)


def test_gae_bad_arguments_raise():
    with pytest.raises(ValueError, match="gamma"):
        gae(REWARDS, values_with_pad(0.0), MASK, gamma=1.5, gae_lambda=0.95)
    with pytest.raises(ValueError, match=r"\(B, R\)"):
        gae(REWARDS, values_with_pad(0.0)[:, :3], MASK, gamma=1.0, gae_lambda=0.95)


def test_explained_variance_hand_computed():
    values = torch.tensor([[1.0, 2.0, 3.0, 50.0]])
    returns = torch.tensor([[1.0, 2.0, 4.0, -50.0]])
    mask = torch.tensor([[1, 1, 1, 0]])
    # Var(R) over [1, 2, 4] = (16/9 + 1/9 + 25/9) / 2 = 7/3
    # Var(R - V) over [0, 0, 1] = (1/9 + 1/9 + 4/9) / 2 = 1/3  ->  1 - (1/3) / (7/3) = 6/7
    close(explained_variance(values, returns, mask), 6 / 7)


def test_explained_variance_perfect_constant_and_degenerate():
    returns = torch.tensor([[1.0, 2.0, 4.0]])
    mask = torch.ones(1, 3, dtype=torch.bool)
    close(explained_variance(returns.clone(), returns, mask), 1.0)  # perfect critic
    close(explained_variance(torch.full((1, 3), 7 / 3), returns, mask), 0.0)  # the mean of R
    close(explained_variance(torch.zeros(1, 3), torch.full((1, 3), 2.0), mask), 0.0)  # Var(R) = 0
    close(explained_variance(torch.zeros(1, 3), returns, torch.tensor([[1, 0, 0]])), 0.0)  # n = 1


def test_explained_variance_property_decreases_with_critic_noise():
    gen = torch.Generator().manual_seed(0)
    returns = torch.randn(4, 50, generator=gen)
    noise = torch.randn(4, 50, generator=gen)
    mask = torch.ones(4, 50, dtype=torch.bool)
    evs = [float(explained_variance(returns + s * noise, returns, mask)) for s in (0.0, 0.1, 0.5, 1.0, 2.0)]
    assert evs == sorted(evs, reverse=True) and evs[0] == 1.0 and evs[-1] < 0
