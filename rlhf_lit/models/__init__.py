"""Backbones, LoRA adapters, scalar heads, the shared-base actor-critic, reward sources and export."""

from rlhf_lit.models.adapters import AdaptedLM
from rlhf_lit.models.backbone import BackboneConfig, LoraSettings, load_backbone, load_backbone_tokenizer
from rlhf_lit.models.export import RewardScorer, load_reward_model, save_causal_lm
from rlhf_lit.models.heads import ScalarHead, score_last_token
from rlhf_lit.models.policy import ActorCritic
from rlhf_lit.models.reward_source import RewardModelConfig, RewardSource
from rlhf_lit.models.tokenizer import build_byte_tokenizer, load_tokenizer

__all__ = [
    "ActorCritic",
    "AdaptedLM",
    "BackboneConfig",
    "LoraSettings",
    "RewardModelConfig",
    "RewardScorer",
    "RewardSource",
    "ScalarHead",
    "build_byte_tokenizer",
    "load_backbone",
    "load_backbone_tokenizer",
    "load_reward_model",
    "load_tokenizer",
    "save_causal_lm",
    "score_last_token",
]
