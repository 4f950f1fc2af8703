"""The stage LightningModules."""

from rlhf_lit.modules.reward import RewardModule
from rlhf_lit.modules.sft import SFTModule

__all__ = ["RewardModule", "SFTModule"]
