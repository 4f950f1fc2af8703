"""Programmable rewards: built-in verifiable reward functions and weighted mixtures of reward sources.

``reward_model`` in a PPO config may be a list of :class:`RewardSourceConfig` (learned reward models and
``module:function`` reward functions, with weights; :class:`MixedReward`). The built-in functions
(:mod:`rlhf_lit.rewards.functions`) are importable from here, e.g. ``rlhf_lit.rewards:gsm8k_answer_match``.
"""

from rlhf_lit.rewards.functions import (
    ends_with,
    excludes_keyword,
    gsm8k_answer_match,
    includes_keyword,
    instruction_constraints,
    parse_number,
    valid_json,
    word_count_in_range,
)
from rlhf_lit.rewards.mixture import MixedReward, RewardSourceConfig, load_function

__all__ = [
    "MixedReward",
    "RewardSourceConfig",
    "ends_with",
    "excludes_keyword",
    "gsm8k_answer_match",
    "includes_keyword",
    "instruction_constraints",
    "load_function",
    "parse_number",
    "valid_json",
    "word_count_in_range",
]
