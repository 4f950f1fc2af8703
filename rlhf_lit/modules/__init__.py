"""The stage LightningModules."""

from rlhf_lit.modules.dpo import DPOModule
from rlhf_lit.modules.ppo import PPOModule
from rlhf_lit.modules.reward import RewardModule
from rlhf_lit.modules.sft import SFTModule

__all__ = ["DPOModule", "PPOModule", "RewardModule", "SFTModule"]
