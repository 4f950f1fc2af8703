"""A PPO iteration with nothing left to learn from makes no optimizer step (``ppo.dynamic_sampling`` filtering
every group); the family's rollout figures are logged under their names."""

from __future__ import annotations

import torch

from rlhf_lit import metrics as M
from rlhf_lit.rl.generation import SamplingConfig
from rlhf_lit.rl.settings import PPOConfig
from tests.ppo.helpers import RecordingReward, make_data, make_module, make_trainer


def test_an_iteration_whose_every_group_is_filtered_makes_no_step(tmp_path, caplog):
    torch.manual_seed(0)
    module = make_module(
        sampling=SamplingConfig(max_new_tokens=4, temperature=0.7, num_samples_per_prompt=2),
        ppo=PPOConfig(
            advantage_estimator="grpo", ppo_epochs=2, ppo_minibatch_size=2, total_iterations=1, dynamic_sampling=True
        ),
    )
    # every response of the batch scores the same: every group has zero variance
    module.collector.reward_fn = RecordingReward(module.collector.reward_fn, replace=lambda s: torch.full_like(s, 0.5))
    before = {n: p.detach().clone() for n, p in module.named_parameters() if p.requires_grad}
    trainer = make_trainer(tmp_path)
    trainer.fit(module, datamodule=make_data(module, batch_size=3))
    logged = module.history[-1]
    assert logged[M.ROLLOUT_FILTERED_GROUPS] == 3.0  # 3 prompts x 2 samples, all filtered
    assert M.PPO_POLICY_LOSS not in logged and M.PPO_GRAD_NORM not in logged
    for name, p in module.named_parameters():
        if p.requires_grad:
            assert torch.equal(p.detach(), before[name]), name  # AdamW's weight decay did not run either
    assert not module.optimizers().optimizer.state  # no optimizer step: no Adam moments
    # the learning-rate schedule is sized in minibatches and moves on over all of them: 2 epochs x 6 / 2
    assert trainer.lr_scheduler_configs[0].scheduler.last_epoch == 2 * 3
    assert "no response is left for the update" in caplog.text
