"""Critic-free advantages on hand-computed groups (GRPO, Dr.GRPO, RLOO, REINFORCE++ returns)."""

import pytest
import torch
from torch.testing import assert_close

from rlhf_lit.functional.group_advantages import (
    discounted_returns,
    group_relative_advantages,
    leave_one_out_advantages,
    token_advantages,
)

# one group of 4 with rewards 1, 2, 3, 6: mean 3, deviations -2, -1, 0, 3
# unbiased variance (4 + 1 + 0 + 9) / 3 = 14 / 3, std = 2.1602469
GROUP = torch.tensor([1.0, 2.0, 3.0, 6.0])
STD = (14.0 / 3.0) ** 0.5


def test_grpo_one_group_of_four():
    adv = group_relative_advantages(GROUP, 4, eps=0.0)
    assert_close(adv, torch.tensor([-2.0, -1.0, 0.0, 3.0]) / STD)
    assert_close(adv, torch.tensor([-0.9258201, -0.4629100, 0.0, 1.3887301]))


def test_dr_grpo_does_not_divide_by_the_std():
    assert_close(
        group_relative_advantages(GROUP, 4, scale_by_std=False), torch.tensor([-2.0, -1.0, 0.0, 3.0])
    )


def test_rloo_one_group_of_four():
    # 1 - (2 + 3 + 6) / 3 = -8/3; 2 - 10/3 = -4/3; 3 - 9/3 = 0; 6 - 6/3 = 4
    adv = leave_one_out_advantages(GROUP, 4)
    assert_close(adv, torch.tensor([-8 / 3, -4 / 3, 0.0, 4.0]))
    # property: RLOO = n / (n - 1) * Dr.GRPO
    assert_close(adv, 4 / 3 * group_relative_advantages(GROUP, 4, scale_by_std=False))


def test_groups_are_consecutive_rows_and_independent():
    # groups [1, 3] and [10, 10]: the second has equal rewards -> 0 (eps keeps it finite)
    scores = torch.tensor([1.0, 3.0, 10.0, 10.0])
    # group 1: mean 2, std sqrt(2) -> -1/sqrt(2), +1/sqrt(2)
    assert_close(group_relative_advantages(scores, 2, eps=0.0)[:2], torch.tensor([-(0.5**0.5), 0.5**0.5]))
    assert_close(group_relative_advantages(scores, 2)[2:], torch.zeros(2))
    # RLOO group 1: 1 - 3 = -2, 3 - 1 = 2
    assert_close(leave_one_out_advantages(scores, 2), torch.tensor([-2.0, 2.0, 0.0, 0.0]))


def test_invalid_responses_leave_their_group_statistics():
    # response 3 (score nan upstream, 0 here) is dropped: the group is [1, 2, 3]: mean 2, unbiased std 1
    valid = torch.tensor([True, True, True, False])
    scores = torch.tensor([1.0, 2.0, 3.0, 1e6])
    assert_close(
        group_relative_advantages(scores, 4, valid=valid, eps=0.0), torch.tensor([-1.0, 0.0, 1.0, 0.0])
    )
    # RLOO: 1 - 2.5 = -1.5, 2 - 2 = 0, 3 - 1.5 = 1.5
    assert_close(leave_one_out_advantages(scores, 4, valid=valid), torch.tensor([-1.5, 0.0, 1.5, 0.0]))
    # one valid response: no baseline, advantage 0
    lone = torch.tensor([True, False])
    assert_close(group_relative_advantages(torch.tensor([5.0, 1.0]), 2, valid=lone), torch.zeros(2))
    assert_close(leave_one_out_advantages(torch.tensor([5.0, 1.0]), 2, valid=lone), torch.zeros(2))


@pytest.mark.parametrize("n, b", [(1, 4), (3, 4)])
def test_bad_group_sizes_are_refused(n, b):
    with pytest.raises(ValueError, match="group"):
        group_relative_advantages(torch.zeros(b), n)
    with pytest.raises(ValueError, match="group"):
        leave_one_out_advantages(torch.zeros(b), n)


def test_discounted_returns_skip_padding():
    rewards = torch.tensor([[-0.02, 0.01, 0.95, 0.0], [0.5, 0.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]], dtype=torch.bool)
    # gamma 1: row 0 = [-0.02 + 0.01 + 0.95, 0.01 + 0.95, 0.95, 0]; row 1 = [0.5, 0, 0, 0]
    assert_close(
        discounted_returns(rewards, mask), torch.tensor([[0.94, 0.96, 0.95, 0.0], [0.5, 0.0, 0.0, 0.0]])
    )
    # gamma 0.5: [-0.02 + 0.5 * (0.01 + 0.5 * 0.95), 0.01 + 0.5 * 0.95, 0.95] = [0.2225, 0.485, 0.95]
    assert_close(discounted_returns(rewards, mask, 0.5)[0], torch.tensor([0.2225, 0.485, 0.95, 0.0]))


def test_token_advantages_fill_real_tokens_only():
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]], dtype=torch.bool)
    assert_close(
        token_advantages(torch.tensor([2.0, -1.0]), mask), torch.tensor([[2.0, 2.0, 0.0], [-1.0, 0.0, 0.0]])
    )
