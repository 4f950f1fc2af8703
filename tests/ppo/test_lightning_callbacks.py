"""PPO's metrics reach Lightning's callbacks: ``ModelCheckpoint(monitor="rollout/score_mean", mode="max",
every_n_train_steps=1)`` keeps the checkpoint of the best iteration (one training batch = one iteration, however many
optimizer steps it takes)."""

from __future__ import annotations

import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from rlhf_lit import metrics as M
from rlhf_lit.rl.settings import PPOConfig
from tests.ppo.helpers import make_data, make_module, make_trainer

ITERATIONS = 4


def test_model_checkpoint_on_the_rollout_score_keeps_the_best_iteration(tmp_path):
    torch.manual_seed(0)
    # 4 optimizer steps per iteration (2 epochs x 2 minibatches): every_n_train_steps=1 still checks each iteration
    module = make_module(ppo=PPOConfig(ppo_epochs=2, ppo_minibatch_size=2, total_iterations=ITERATIONS))
    best = ModelCheckpoint(
        dirpath=tmp_path / "ckpt",
        monitor=M.ROLLOUT_SCORE_MEAN,
        mode="max",
        save_top_k=1,
        every_n_train_steps=1,
    )
    trainer = make_trainer(tmp_path, enable_checkpointing=True, callbacks=[best])
    trainer.fit(module, datamodule=make_data(module, batch_size=4))
    scores = [h[M.ROLLOUT_SCORE_MEAN] for h in module.history]
    assert len(scores) == ITERATIONS and len(set(scores)) == ITERATIONS  # distinct: the best is unique
    assert M.ROLLOUT_SCORE_MEAN in trainer.callback_metrics
    best_iteration = max(range(ITERATIONS), key=scores.__getitem__) + 1
    assert float(best.best_model_score) == torch.tensor(max(scores)).item()
    saved = torch.load(best.best_model_path, map_location="cpu", weights_only=False)
    assert saved["ppo_state"]["iteration"] == best_iteration
    assert saved["ppo_state"]["history"][-1][M.ROLLOUT_SCORE_MEAN] == max(scores)
    assert len(list((tmp_path / "ckpt").glob("*.ckpt"))) == 1
    assert trainer.global_step == 4 * ITERATIONS  # optimizer steps, not iterations
