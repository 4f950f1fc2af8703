"""The RL core is assembled and run without a LightningModule: ``rl.loading.build_models`` and
``rl.assembly.build_rl`` take typed settings, the models and the trainer's side as plain callables, and one
PPO iteration (collect, estimate, update) runs on them in plain PyTorch, as ``PPOModule.training_step`` runs it.
"""

from __future__ import annotations

import copy

import torch

from rlhf_lit import metrics as M
from rlhf_lit.data import PromptDataModule
from rlhf_lit.models import BackboneConfig, RewardModelConfig
from rlhf_lit.rl.assembly import TrainerHooks, build_rl, optimizer_groups
from rlhf_lit.rl.generation import SamplingConfig
from rlhf_lit.rl.loading import PPOSettings, build_models
from rlhf_lit.rl.settings import CriticConfig, PPOConfig
from rlhf_lit.rl.update import UpdateBatch, clip_global_grad_norm
from tests.conftest import TINY_GPT2
from tests.ppo.helpers import LORA


def _settings(**ppo) -> PPOSettings:
    return PPOSettings.build(
        backbone=BackboneConfig(tiny=TINY_GPT2, tokenizer="byte", lora=copy.deepcopy(LORA)),
        reward_model=RewardModelConfig(backbone=BackboneConfig(tiny=TINY_GPT2, tokenizer="byte", seed=1)),
        sampling=SamplingConfig(max_new_tokens=8, temperature=0.7),
        ppo=PPOConfig(ppo_epochs=2, ppo_minibatch_size=2, total_iterations=1, **ppo),
        critic=CriticConfig(lora=copy.deepcopy(LORA)),
    )


def test_one_iteration_runs_on_the_assembled_components_without_lightning():
    torch.manual_seed(0)
    settings = _settings(max_grad_norm=1.0)
    models = build_models(settings)
    optimizer = torch.optim.AdamW(optimizer_groups(models.policy, lr=1e-2, critic_lr=None))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    clipped = []

    def clip(opt):
        clipped.append(clip_global_grad_norm(opt, settings.ppo.max_grad_norm, "32-true"))
        return clipped[-1]

    hooks = TrainerHooks(
        backward=lambda loss: loss.backward(), clip=clip, optimizers=lambda: (optimizer, scheduler)
    )
    rl = build_rl(settings, models, hooks)
    data = PromptDataModule(
        train_files=["demo:prompts?n=8&seed=0&split=train"],
        val_size=0,
        batch_size=4,
        tokenizer=models.tokenizer,
    )
    data.setup("fit")
    batch = next(iter(data.train_dataloader()))
    before = {n: p.detach().clone() for n, p in models.policy.named_parameters() if p.requires_grad}

    rollout = rl.dynamic_sampling.collect(batch, 0)
    adv = rl.estimator(rollout, rl.kl_ctl.value, False)
    stats = rl.updater.update(UpdateBatch.from_rollout(rollout, adv), 0)

    assert rollout.response_ids.shape[0] == 4 and adv.advantages.shape == rollout.response_mask.shape
    assert len(clipped) == 2 * 2  # ppo_epochs x minibatches of 2 responses: one optimizer step each
    assert all(norm is not None and norm > 0 for norm in clipped)
    assert M.PPO_POLICY_LOSS in stats and M.PPO_VALUE_LOSS in stats
    moved = {
        n for n, p in models.policy.named_parameters() if p.requires_grad and not torch.equal(p, before[n])
    }
    assert any(".actor." in n for n in moved) and any(".critic." in n or "value_head" in n for n in moved)
    # the components share the models they were built with: the collector samples from the policy the updater trains
    assert rl.collector.policy is rl.updater.policy is models.policy


def test_the_settings_refuse_what_cannot_work_before_any_model_is_built():
    """``PPOSettings`` holds the joint checks: a critic-free estimator with one sample per prompt is refused when
    the settings are built, so nothing is loaded."""
    import pytest

    from rlhf_lit.errors import ConfigError

    with pytest.raises((ConfigError, ValueError), match="num_samples_per_prompt"):
        _settings(advantage_estimator="grpo")
