"""``ppo.checkpoint_every``: its range, when a trainer gets the periodic checkpoint, and its cadence in
iterations. The kill -9 tests (``tests/cli/test_kill_resume.py``) resume from what it writes."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from rlhf_lit.callbacks import IterationCheckpoint, periodic_checkpoint
from rlhf_lit.errors import ConfigError
from rlhf_lit.ranges import dataclass_ranges
from rlhf_lit.rl.settings import PPOConfig
from tests.ppo.helpers import make_data, make_module, make_trainer


def test_checkpoint_every_is_a_whole_number_of_iterations_or_null():
    assert PPOConfig().checkpoint_every is None
    assert PPOConfig(checkpoint_every=3).checkpoint_every == 3
    for bad in (0, -1, 1.5):
        with pytest.raises(
            ConfigError, match=r"ppo\.checkpoint_every must be a whole number >= 1 \(or null\)"
        ):
            PPOConfig(checkpoint_every=bad)
    rule = dataclass_ranges(PPOConfig)["checkpoint_every"]  # the CLI's checks read the same declaration
    assert rule.allows(None) and rule.allows(2) and not rule.allows(0)


def test_a_trainer_gets_one_unless_its_own_checkpointing_says_otherwise(tmp_path):
    default = L.Trainer(default_root_dir=str(tmp_path), logger=False)  # Lightning's default ModelCheckpoint
    (added,) = periodic_checkpoint(2, default)
    assert isinstance(added, IterationCheckpoint) and added.every_n_iterations == 2
    assert added.save_last and added.save_top_k == 0 and added.dirpath == str(tmp_path.resolve())
    assert periodic_checkpoint(None, default) == []
    assert periodic_checkpoint(2, L.Trainer(enable_checkpointing=False, logger=False)) == []
    own = L.Trainer(logger=False, callbacks=[ModelCheckpoint(dirpath=str(tmp_path / "ck"), save_last=True)])
    assert periodic_checkpoint(2, own) == []
    assert periodic_checkpoint(2, None) == []
    from lightning.pytorch.trainer.states import TrainerFn

    default.state.fn = TrainerFn.VALIDATING  # validate writes nothing: the checkpoint's own callbacks stay
    assert periodic_checkpoint(2, default) == []


def test_last_ckpt_is_written_every_n_iterations_and_replaces_the_default_checkpoint(tmp_path):
    """3 iterations, ``checkpoint_every: 2``: one ``last.ckpt``, holding iteration 2 (not 3: a cadence in
    iterations, though each iteration makes 2 optimizer steps); Lightning's default top-1 file is not written."""
    torch.manual_seed(0)
    module = make_module(
        ppo=PPOConfig(ppo_epochs=1, ppo_minibatch_size=2, total_iterations=3, checkpoint_every=2)
    )
    trainer = make_trainer(tmp_path, enable_checkpointing=True)
    trainer.fit(module, datamodule=make_data(module, batch_size=4))
    assert module.iteration == 3 and trainer.global_step == 6
    assert [type(c) for c in trainer.checkpoint_callbacks] == [IterationCheckpoint]
    assert sorted(p.name for p in tmp_path.rglob("*.ckpt")) == ["last.ckpt"]
    saved = torch.load(tmp_path / "last.ckpt", weights_only=True)
    assert saved["ppo_state"]["iteration"] == 2 and saved["global_step"] == 4
