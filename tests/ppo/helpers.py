"""Building tiny PPO runs for the PPO tests (tiny GPT-2 policy, tiny random reward model, demo prompts)."""

from __future__ import annotations

import copy

import lightning as L

from rlhf_lit.data import PromptDataModule
from rlhf_lit.generation import SamplingConfig
from rlhf_lit.models import BackboneConfig, LoraSettings, RewardModelConfig
from rlhf_lit.modules import PPOModule
from rlhf_lit.modules.ppo_config import CriticConfig, KLConfig, PPOConfig, RewardShapingConfig
from tests.conftest import TINY_GPT2

LORA = LoraSettings(r=4, alpha=8, target_modules=["c_attn", "c_fc"])


def make_module(tokenizer: str = "byte", **overrides) -> PPOModule:
    """A tiny PPO module; ``overrides`` replace whole constructor arguments."""
    kwargs = dict(
        backbone=BackboneConfig(tiny=TINY_GPT2, tokenizer=tokenizer, lora=copy.deepcopy(LORA)),
        reward_model=RewardModelConfig(backbone=BackboneConfig(tiny=TINY_GPT2, tokenizer=tokenizer, seed=1)),
        sampling=SamplingConfig(max_new_tokens=8, temperature=0.7),
        ppo=PPOConfig(ppo_epochs=1, ppo_minibatch_size=4, total_iterations=1),
        kl=KLConfig(kl_coef=0.05),
        reward=RewardShapingConfig(),
        critic=CriticConfig(lora=copy.deepcopy(LORA)),
        log_samples_every=0,
    )
    kwargs.update(overrides)
    return PPOModule(**kwargs)


def make_data(module: PPOModule, batch_size: int = 4, n: int = 32) -> PromptDataModule:
    return PromptDataModule(
        train_files=[f"demo:prompts?n={n}&seed=0&split=train"],
        val_size=0,
        batch_size=batch_size,
        tokenizer=module.tokenizer,
    )


def make_trainer(tmp_path, **kwargs) -> L.Trainer:
    defaults = dict(
        accelerator="cpu",
        devices=1,
        max_epochs=-1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=str(tmp_path),
        num_sanity_val_steps=0,
    )
    defaults.update(kwargs)
    return L.Trainer(**defaults)
