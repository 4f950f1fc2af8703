"""The critic-free estimators of ``rlhf_lit.rl`` on a hand-made rollout (literal tensors), and the algorithm
registry."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch.testing import assert_close

from rlhf_lit.errors import ConfigError
from rlhf_lit.rl import (
    AlgorithmSpec,
    GAEEstimator,
    GroupEstimator,
    ReinforcePPEstimator,
    algorithm_names,
    build_estimator,
    get_algorithm,
    register_algorithm,
)
from rlhf_lit.rl.settings import PPOConfig

MASK = torch.tensor([[True, True, False], [True, False, False]])


def _rollout(scores, kl, finite=None):
    finite = torch.ones(len(scores), dtype=torch.bool) if finite is None else finite
    return SimpleNamespace(
        scores=torch.tensor(scores),
        kl=torch.tensor(kl),
        response_mask=MASK,
        update_mask=MASK & finite.unsqueeze(-1),
        finite=finite,
        old_values=None,
    )


def test_reinforce_pp_returns_then_global_whitening():
    # kl_coef 0.5: rewards row 0 = [-0.05, -0.1 + 1] = [-0.05, 0.9], row 1 = [-0.15 + 0]
    # returns (gamma 1): [0.85, 0.9], [-0.15]; mean 1.6 / 3, unbiased var 0.7016667 / 2 = 0.3508333
    rollout = _rollout([1.0, 0.0], [[0.1, 0.2, 9.0], [0.3, 9.0, 9.0]])
    adv = ReinforcePPEstimator(gamma=1.0)(rollout, 0.5, distributed=False)
    mean, std = 1.6 / 3, (0.7016667 / 2 + 1e-8) ** 0.5
    expected = torch.tensor([[0.85 - mean, 0.9 - mean, 0.0], [-0.15 - mean, 0.0, 0.0]]) / std
    assert_close(adv.advantages, expected, atol=1e-5, rtol=1e-5)
    assert adv.returns is None
    assert_close(adv.raw_advantage_mean, torch.tensor(mean), atol=1e-6, rtol=1e-6)


def test_rloo_takes_the_summed_kl_penalty_into_the_sequence_reward():
    # sequence rewards: 1 - 0.5 * (0.1 + 0.1) = 0.9 and 3 - 0.5 * 0.4 = 2.8; RLOO (n = 2): -1.9, +1.9
    rollout = _rollout([1.0, 3.0], [[0.1, 0.1, 9.0], [0.4, 9.0, 9.0]])
    adv = GroupEstimator("rloo", 2)(rollout, 0.5, distributed=False)
    assert_close(adv.advantages, torch.tensor([[-1.9, -1.9, 0.0], [1.9, 0.0, 0.0]]), atol=1e-6, rtol=1e-6)


def test_grpo_with_kl_coef_zero_uses_the_score_alone():
    # the module passes kl_coef 0 with the KL in the loss: scores 1, 3 -> mean 2, std sqrt(2) -> -+0.7071
    rollout = _rollout([1.0, 3.0], [[0.1, 0.1, 9.0], [0.4, 9.0, 9.0]])
    adv = GroupEstimator("grpo", 2)(rollout, 0.0, distributed=False)
    s = 1 / (2**0.5 + 1e-6)
    assert_close(adv.advantages, torch.tensor([[-s, -s, 0.0], [s, 0.0, 0.0]]), atol=1e-6, rtol=1e-6)
    # a dropped (non-finite) response: its group has one valid member -> no baseline, advantages 0
    dropped = _rollout([1.0, 3.0], [[0.0] * 3] * 2, finite=torch.tensor([True, False]))
    assert (GroupEstimator("grpo", 2)(dropped, 0.0, distributed=False).advantages == 0).all()


def test_build_estimator_follows_the_config():
    assert isinstance(build_estimator(PPOConfig(), 1), GAEEstimator) and PPOConfig().needs_critic
    config = PPOConfig(advantage_estimator="grpo", scale_by_std=False)
    grpo = build_estimator(config, 4)
    assert (grpo.kind, grpo.group_size, grpo.scale_by_std, config.needs_critic) == ("grpo", 4, False, False)
    assert build_estimator(PPOConfig(advantage_estimator="rloo"), 2).kind == "rloo"
    assert isinstance(
        build_estimator(PPOConfig(advantage_estimator="reinforce_pp", gamma=0.9), 1), ReinforcePPEstimator
    )


def test_the_registry_holds_what_each_estimator_needs():
    facts = {
        name: (spec.needs_critic, spec.needs_groups, spec.kl_placement)
        for name in algorithm_names()
        for spec in [get_algorithm(name)]
    }
    assert facts["gae"] == (True, False, "reward")
    assert facts["grpo"] == (False, True, "loss")
    assert facts["rloo"] == (False, True, "reward")
    assert facts["reinforce_pp"] == (False, False, "reward")
    # PPOConfig's properties are the registry's facts, not a copy of them
    for name in ("gae", "grpo", "rloo", "reinforce_pp"):
        config = PPOConfig(advantage_estimator=name)
        assert (config.needs_critic, config.needs_groups) == facts[name][:2]
        assert config.kl_in_loss() == (facts[name][2] == "loss")


def test_an_unknown_estimator_is_one_line_naming_the_registered_ones():
    with pytest.raises(ConfigError) as err:
        PPOConfig(advantage_estimator="ppo2")
    message = str(err.value)
    assert "\n" not in message and "'ppo2'" in message
    assert all(name in message for name in ("gae", "grpo", "rloo", "reinforce_pp"))


def test_a_name_is_registered_once_and_defaults_are_checked():
    with pytest.raises(ValueError, match="already registered"):
        register_algorithm(AlgorithmSpec("gae", lambda ppo, n: None, needs_critic=True))
    with pytest.raises(ValueError, match="loss_aggregation"):
        register_algorithm(AlgorithmSpec("bad_agg", lambda ppo, n: None, False, loss_aggregation="sum"))
    assert "bad_agg" not in algorithm_names()
