"""The policy-gradient family's impossible settings are refused before anything loads, by the CLI's checks
(one ``ConfigError`` line naming the keys) and by the settings themselves when built in Python."""

from __future__ import annotations

import pytest
import torch

from rlhf_lit.errors import ConfigError
from rlhf_lit.rl.generation import SamplingConfig
from rlhf_lit.rl.reward_norm import RunningMeanStd, ScoreShaper
from rlhf_lit.rl.settings import (
    CriticConfig,
    PPOConfig,
    RewardShapingConfig,
    check_advantage_estimator,
    check_overlong,
    check_stop_tokens,
)
from tests.cli.test_checks import _set, check, parsed, refused

P = "model.init_args."


@pytest.mark.parametrize(
    "changes, expected",
    [
        ({"ppo.dynamic_sampling": True}, r"ppo.dynamic_sampling filters groups .* >= 2 \(it is 1\)"),
        (
            {"ppo.dynamic_sampling_max_rounds": 2},
            r"^model.init_args.ppo.dynamic_sampling_max_rounds=2 .* model.init_args.ppo.dynamic_sampling filters, "
            r"which is off",
        ),
        (
            {"ppo.dynamic_sampling": True, "sampling.num_samples_per_prompt": 2, "ppo.dynamic_sampling_max_rounds": -1},
            r"ppo.dynamic_sampling_max_rounds must be a whole number >= 0",
        ),
        ({"ppo.policy_loss": "cispo", "ppo.dual_clip": 2.0}, r"ppo.dual_clip caps .*cispo has no such term"),
        ({"ppo.tis_mode": "mask"}, r"ppo.tis_level / ppo.tis_mode .* set ppo.tis_cap"),
        ({"ppo.tis_level": "sequence"}, r"set ppo.tis_cap"),
        ({"reward.overlong_buffer": 10_000}, r"reward.overlong_buffer=10000 must be at most model.init_args.sampling.max_new_tokens"),
        ({"ppo.top_entropy_quantile": 0.0}, r"ppo.top_entropy_quantile must be a number in \(0, 1\], got 0.0"),
        ({"ppo.top_entropy_quantile": 1.5}, r"ppo.top_entropy_quantile must be"),
        ({"ppo.clip_range_high": 0.0}, r"ppo.clip_range_high must be a number > 0"),
        ({"ppo.clip_range_low": -0.1}, r"ppo.clip_range_low must be a number > 0"),
        ({"reward.overlong_buffer": 0}, r"reward.overlong_buffer must be a whole number >= 1"),
        ({"reward.overlong_penalty": -1.0}, r"reward.overlong_penalty must be a number >= 0"),
        (
            {"ppo.mask_truncated_completions": True, "sampling.stop_at_eos": False},
            r"model.init_args.ppo.mask_truncated_completions needs a stop token, but none is set "
            r"\(model.init_args.sampling.stop_at_eos is off",
        ),
        (
            {"reward.overlong_penalty": 0.5},
            r"model.init_args.reward.overlong_penalty=0.5 is set but model.init_args.reward.overlong_buffer is not",
        ),
        (
            {"reward.missing_eos_penalty": 1.0, "sampling.stop_at_eos": False},
            r"model.init_args.reward.missing_eos_penalty=1.0 needs a stop token",
        ),
    ],
    ids=[
        "dynamic_sampling_one_sample",
        "max_rounds_without_dynamic_sampling",
        "max_rounds_negative",
        "cispo_dual_clip",
        "tis_mode_without_cap",
        "tis_level_without_cap",
        "overlong_buffer_too_long",
        "entropy_quantile_zero",
        "entropy_quantile_above_one",
        "clip_high_zero",
        "clip_low_negative",
        "overlong_buffer_zero",
        "overlong_penalty_negative",
        "mask_truncated_without_a_stop_token",
        "overlong_penalty_without_a_buffer",
        "missing_eos_penalty_without_a_stop_token",
    ],
)
def test_impossible_family_settings_are_refused_by_the_checks(changes, expected):
    refused(changes, expected, P)


def test_the_family_settings_pass_the_checks_when_consistent():
    config = parsed("ppo")
    for key, value in {
        "sampling.num_samples_per_prompt": 2,
        "ppo.dynamic_sampling": True,
        "ppo.dynamic_sampling_max_rounds": 4,
        "ppo.policy_loss": "cispo",
        "ppo.tis_cap": 2.0,
        "ppo.tis_level": "sequence",
        "ppo.tis_mode": "mask",
        "reward.overlong_buffer": 4,
        "ppo.clip_range_low": 0.2,
        "ppo.clip_range_high": 0.28,
        "ppo.top_entropy_quantile": 0.2,
    }.items():
        _set(config, P + key, value)
    check(config)


@pytest.mark.parametrize(
    "stop",
    [
        {},
        {"sampling.stop_at_eos": False, "sampling.stop_token_ids": [5]},
        {"sampling.stop_at_eos": False, "sampling.stop_strings": ["."]},
    ],
    ids=["eos_of_the_tokenizer", "stop_token_ids", "stop_strings"],
)
def test_a_stop_token_the_config_may_give_passes_the_checks(stop):
    """Refused before loading only where the config alone rules every stop token out: with stop_at_eos on
    (the default) the tokenizer's EOS decides when the module is built."""
    config = parsed("ppo")
    for key, value in {"ppo.mask_truncated_completions": True, "reward.missing_eos_penalty": 1.0, **stop}.items():
        _set(config, P + key, value)
    check(config)


def test_the_settings_refuse_them_when_built_in_python():
    with pytest.raises(ConfigError, match="cispo has no such term"):
        PPOConfig(policy_loss="cispo", dual_clip=2.0)
    with pytest.raises(ConfigError, match="set ppo.tis_cap"):
        PPOConfig(tis_mode="mask")
    with pytest.raises(ConfigError, match=r"top_entropy_quantile must be a number in \(0, 1\]"):
        PPOConfig(top_entropy_quantile=0.0)
    assert PPOConfig(clip_range=0.3).clip_bounds == (0.3, 0.3)  # unset sides read clip_range
    assert PPOConfig(clip_range=0.3, clip_range_high=0.4).clip_bounds == (0.3, 0.4)
    assert PPOConfig(clip_range_low=0.1).clip_bounds == (0.1, 0.2)
    with pytest.raises(ValueError, match=r"dynamic_sampling .* >= 2 \(it is 1\)"):
        check_advantage_estimator(PPOConfig(dynamic_sampling=True), SamplingConfig(), CriticConfig())
    with pytest.raises(ValueError, match="overlong_buffer=9 must be at most sampling.max_new_tokens=8"):
        check_overlong(9, None, max_new_tokens=8)
    check_overlong(8, 0.5, max_new_tokens=8)
    with pytest.raises(ConfigError, match="^reward.overlong_penalty=0.5 is set but reward.overlong_buffer is not"):
        RewardShapingConfig(overlong_penalty=0.5)
    assert RewardShapingConfig(overlong_buffer=4).overlong_penalty is None  # DAPO's 1.0, below
    with pytest.raises(ValueError, match="^ppo.mask_truncated_completions needs a stop token"):
        check_stop_tokens(None, mask_truncated=True, has_stop_token=False)
    with pytest.raises(ValueError, match="^reward.missing_eos_penalty=0.5 needs a stop token"):
        check_stop_tokens(0.5, mask_truncated=False, has_stop_token=False)
    check_stop_tokens(0.5, mask_truncated=True, has_stop_token=True)
    check_stop_tokens(None, mask_truncated=False, has_stop_token=False)


def test_an_unset_overlong_penalty_is_dapos_one_within_the_buffer():
    """max_new_tokens 10, buffer 4: the window starts after 6 tokens; penalty 1 * ((10 - 4) - L) / 4."""
    shaper = ScoreShaper(RewardShapingConfig(overlong_buffer=4), RunningMeanStd(), True, max_new_tokens=10)
    scores = shaper(torch.zeros(4), torch.ones(4, dtype=torch.bool), torch.ones(4, dtype=torch.bool),
                    torch.tensor([5, 6, 7, 10]))
    assert scores.tolist() == [0.0, 0.0, -0.25, -1.0]  # 7 tokens: (6 - 7) / 4; 10 tokens: (6 - 10) / 4
