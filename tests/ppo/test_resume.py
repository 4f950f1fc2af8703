"""Exact resume: N PPO iterations straight equal k iterations, a checkpoint, and N - k more.

Adaptive KL, reward normalisation and two minibatches per epoch are on, so the KL controller, the reward
statistics, the optimizer and scheduler state, the RNG and the prompt order must all be restored.
"""

from __future__ import annotations

import torch

from rlhf_lit.rl.settings import KLConfig, PPOConfig, RewardShapingConfig
from tests.ppo.helpers import make_data, make_module, make_trainer

N_ITER, K_ITER, BATCH, MINIBATCH, EPOCHS = 4, 2, 4, 2, 2
STEPS_PER_ITER = EPOCHS * BATCH // MINIBATCH


def _module():
    torch.manual_seed(0)
    return make_module(
        ppo=PPOConfig(ppo_epochs=EPOCHS, ppo_minibatch_size=MINIBATCH, total_iterations=N_ITER),
        kl=KLConfig(kl_coef=0.05, adaptive=True, target_kl=0.01, horizon=100),
        reward=RewardShapingConfig(normalize=True, clip=3.0),
    )


def _state(module, trainer):
    params = {n: p.detach().clone() for n, p in module.named_parameters() if p.requires_grad}
    opt = trainer.optimizers[0].state_dict()
    moments = [s["exp_avg"].clone() for s in opt["state"].values()]
    return params, moments, module.kl_ctl.value, module.score_stats.state_dict(), module.iteration


def test_resumed_run_equals_uninterrupted_run(tmp_path):
    module = _module()
    trainer = make_trainer(tmp_path / "straight")
    trainer.fit(module, datamodule=make_data(module, batch_size=BATCH))
    straight = _state(module, trainer)
    assert straight[4] == N_ITER

    module = _module()
    trainer = make_trainer(tmp_path / "first", max_steps=K_ITER * STEPS_PER_ITER)
    trainer.fit(module, datamodule=make_data(module, batch_size=BATCH))
    assert module.iteration == K_ITER
    ckpt = tmp_path / "k.ckpt"
    trainer.save_checkpoint(ckpt)
    saved = torch.load(ckpt, weights_only=False)
    assert all("lora_" in k or "value_head" in k for k in saved["state_dict"])  # no frozen base weights

    module = _module()
    trainer = make_trainer(tmp_path / "resumed")
    trainer.fit(module, datamodule=make_data(module, batch_size=BATCH), ckpt_path=str(ckpt))
    resumed = _state(module, trainer)

    assert resumed[4] == N_ITER
    for name, value in straight[0].items():
        torch.testing.assert_close(resumed[0][name], value, atol=1e-6, rtol=0)
    for a, b in zip(resumed[1], straight[1]):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)
    assert resumed[2] == straight[2] != 0.05  # the adaptive KL coefficient moved, and identically
    assert resumed[3] == straight[3]


def test_resumed_critic_free_run_equals_uninterrupted_run(tmp_path):
    """The same for GRPO with 2 samples per prompt (KL in the loss, sequence-mean aggregation): the
    checkpoint holds only the actor adapter, and the resumed run equals the straight one."""
    from rlhf_lit.rl.generation import SamplingConfig

    n, steps_per_iter = 2, EPOCHS * BATCH * 2 // (2 * MINIBATCH)

    def module_():
        torch.manual_seed(0)
        return make_module(
            sampling=SamplingConfig(max_new_tokens=8, temperature=0.7, num_samples_per_prompt=n),
            ppo=PPOConfig(
                ppo_epochs=EPOCHS,
                ppo_minibatch_size=2 * MINIBATCH,
                total_iterations=N_ITER,
                advantage_estimator="grpo",
            ),
            kl=KLConfig(kl_coef=0.05, adaptive=True, target_kl=0.01, horizon=100),
            reward=RewardShapingConfig(normalize=True, clip=3.0),
        )

    module = module_()
    trainer = make_trainer(tmp_path / "straight")
    trainer.fit(module, datamodule=make_data(module, batch_size=BATCH))
    straight = _state(module, trainer)
    assert straight[4] == N_ITER and module.trainer.global_step == N_ITER * steps_per_iter

    module = module_()
    trainer = make_trainer(tmp_path / "first", max_steps=K_ITER * steps_per_iter)
    trainer.fit(module, datamodule=make_data(module, batch_size=BATCH))
    assert module.iteration == K_ITER
    ckpt = tmp_path / "k.ckpt"
    trainer.save_checkpoint(ckpt)
    saved = torch.load(ckpt, weights_only=False)
    assert saved["state_dict"] and all("lora_" in k and ".actor." in k for k in saved["state_dict"])

    module = module_()
    trainer = make_trainer(tmp_path / "resumed")
    trainer.fit(module, datamodule=make_data(module, batch_size=BATCH), ckpt_path=str(ckpt))
    resumed = _state(module, trainer)
    assert resumed[4] == N_ITER
    moved = 0.0
    for name, value in straight[0].items():
        torch.testing.assert_close(resumed[0][name], value, atol=1e-6, rtol=0)
        moved = max(moved, float(value.abs().max()) if "lora_B" in name else 0.0)
    assert moved > 1e-6  # the actor learnt something (lora_B starts at 0)
    for a, b in zip(resumed[1], straight[1]):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)
    assert resumed[2] == straight[2] != 0.05
    assert resumed[3] == straight[3]


def test_resumed_run_with_a_pretraining_mix_reads_the_same_ptx_batches(tmp_path):
    """With ``ptx.coef > 0`` the checkpoint records how many PTX batches were used (``ptx_consumed``) and the
    resumed run's stream moves past them: it reads the batches the straight run read next, so the weights and
    the stream's position end equal. Control: a resumed run whose stream restarts (count dropped from the
    checkpoint) ends with other weights."""
    from rlhf_lit.rl.settings import PTXConfig

    ptx = PTXConfig(
        coef=0.5,
        train_files=["demo:sft?n=12&seed=3&split=train"],
        format="explicit",
        batch_size=4,  # 3 batches a pass over the 12 rows: the 8 used are not whole passes
        max_length=40,
    )

    def module_():
        torch.manual_seed(0)
        return make_module(
            ppo=PPOConfig(ppo_epochs=EPOCHS, ppo_minibatch_size=MINIBATCH, total_iterations=N_ITER), ptx=ptx
        )

    module = module_()
    trainer = make_trainer(tmp_path / "straight")
    trainer.fit(module, datamodule=make_data(module, batch_size=BATCH))
    straight, straight_consumed = _state(module, trainer), module.updater.ptx_stream.consumed
    assert straight_consumed == N_ITER * STEPS_PER_ITER  # one PTX batch per optimizer step

    module = module_()
    trainer = make_trainer(tmp_path / "first", max_steps=K_ITER * STEPS_PER_ITER)
    trainer.fit(module, datamodule=make_data(module, batch_size=BATCH))
    ckpt, restarted = tmp_path / "k.ckpt", tmp_path / "restarted.ckpt"
    trainer.save_checkpoint(ckpt)
    saved = torch.load(ckpt, weights_only=False)
    assert saved["ppo_state"]["ptx_consumed"] == K_ITER * STEPS_PER_ITER
    saved["ppo_state"]["ptx_consumed"] = 0
    torch.save(saved, restarted)

    ends = {}
    for name, path in (("resumed", ckpt), ("restarted", restarted)):
        module = module_()
        trainer = make_trainer(tmp_path / name)
        trainer.fit(module, datamodule=make_data(module, batch_size=BATCH), ckpt_path=str(path))
        ends[name] = (_state(module, trainer), module.updater.ptx_stream.consumed)
    resumed, consumed = ends["resumed"]
    assert resumed[4] == N_ITER and consumed == straight_consumed
    for name, value in straight[0].items():
        torch.testing.assert_close(resumed[0][name], value, atol=1e-6, rtol=0)
    restarted_params = ends["restarted"][0][0]
    assert max(float((restarted_params[n] - v).abs().max()) for n, v in straight[0].items()) > 1e-6
