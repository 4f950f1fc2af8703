"""``--ckpt_path`` through the real console script: a PPO run stopped after 3 iterations and resumed to 5
equals an uninterrupted 5-iteration run bit for bit, and ``validate`` evaluates a reward-model checkpoint.

The PPO run is configs/ppo/tiny.yaml made smaller from the command line, with adaptive KL control and
reward normalisation on (so the KL coefficient and the reward statistics must be restored) and two
minibatches per iteration. The interrupted run stops with ``--trainer.max_steps`` (whole iterations only)
and resumes from the ``last.ckpt`` that ModelCheckpoint writes. Both runs execute the same float operations
in the same order on one CPU thread, so the comparison is exact (``torch.equal``).
"""

from __future__ import annotations

import re

import pytest
import torch

from tests.cli.helpers import assert_same, run_cli, without_timings
from tests.tiny_runs import read_scalars

STEPS_PER_ITERATION = 2  # ppo_epochs 1 x (4 prompts / minibatch 2)
PPO_ARGS = [
    "--config",
    "configs/ppo/tiny.yaml",
    "--trainer.logger=false",
    "--trainer.enable_progress_bar=false",
    "--model.init_args.export_dir=null",
    "--model.init_args.ppo.total_iterations=5",
    "--model.init_args.ppo.ppo_epochs=1",
    "--model.init_args.ppo.ppo_minibatch_size=2",
    "--model.init_args.ppo.micro_batch_size=1",
    "--data.init_args.batch_size=4",
    "--data.init_args.max_prompt_length=32",
    "--model.init_args.sampling.max_new_tokens=8",
    "--model.init_args.kl.adaptive=true",
    "--model.init_args.kl.target_kl=0.01",
    "--model.init_args.kl.horizon=100",
    "--model.init_args.reward.normalize=true",
    "--model.init_args.log_samples_every=0",
    "--trainer.callbacks+=lightning.pytorch.callbacks.ModelCheckpoint",
    "--trainer.callbacks.save_last=true",
]


def _fit(root, *extra: str):
    result = run_cli(
        "fit",
        *PPO_ARGS,
        f"--trainer.default_root_dir={root}",
        f"--trainer.callbacks.dirpath={root / 'ck'}",
        *extra,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return torch.load(root / "ck" / "last.ckpt", map_location="cpu", weights_only=True)


@pytest.mark.slow
def test_ppo_stopped_at_3_and_resumed_to_5_equals_an_uninterrupted_run(tmp_path):
    straight = _fit(tmp_path / "straight")
    first = _fit(tmp_path / "first", f"--trainer.max_steps={3 * STEPS_PER_ITERATION}")
    assert first["ppo_state"]["iteration"] == 3 and first["global_step"] == 3 * STEPS_PER_ITERATION
    resumed = _fit(tmp_path / "resumed", "--ckpt_path", str(tmp_path / "first" / "ck" / "last.ckpt"))

    assert straight["ppo_state"]["iteration"] == resumed["ppo_state"]["iteration"] == 5
    assert straight["global_step"] == resumed["global_step"] == 5 * STEPS_PER_ITERATION
    assert_same(straight["state_dict"], resumed["state_dict"], "state_dict")  # adapters and value head
    assert straight["state_dict"].keys() and all(
        "lora_" in k or "value_head" in k for k in straight["state_dict"]
    )
    assert_same(straight["optimizer_states"], resumed["optimizer_states"], "optimizer")  # AdamW moments, step
    assert_same(straight["lr_schedulers"], resumed["lr_schedulers"], "scheduler")
    kl_straight, kl_resumed = straight["ppo_state"]["kl_controller"], resumed["ppo_state"]["kl_controller"]
    assert_same(kl_straight, kl_resumed, "kl_controller")
    assert kl_straight != first["ppo_state"]["kl_controller"]  # the adaptive coefficient kept moving
    assert_same(straight["ppo_state"]["score_stats"], resumed["ppo_state"]["score_stats"], "score_stats")
    assert_same(straight["ppo_state"]["rng"], resumed["ppo_state"]["rng"], "rng")
    assert_same(
        without_timings(straight["ppo_state"]["history"]), without_timings(resumed["ppo_state"]["history"])
    )
    # and the parameters did move away from the interrupted run's: the comparison is not of two copies
    assert any(
        not torch.equal(first["state_dict"][k], straight["state_dict"][k]) for k in straight["state_dict"]
    )


@pytest.mark.slow
def test_validate_prints_the_reward_models_validation_metrics_from_a_checkpoint(tmp_path):
    common = [
        "--config",
        "configs/reward/tiny.yaml",
        f"--trainer.default_root_dir={tmp_path}",
        f"--trainer.logger.init_args.save_dir={tmp_path}",
        "--model.init_args.export_dir=null",
        "--trainer.limit_train_batches=2",
        "--trainer.limit_val_batches=2",
        "--data.init_args.max_train_samples_per_file=16",
        "--data.init_args.val_size=8",
        "--trainer.enable_progress_bar=false",
    ]
    fit = run_cli("fit", *common)
    assert fit.returncode == 0, fit.stderr[-3000:]
    ckpt = next(tmp_path.glob("tb/version_0/checkpoints/*.ckpt"))
    fitted = read_scalars(tmp_path / "tb" / "version_0")

    result = run_cli("validate", *common, "--ckpt_path", str(ckpt))
    assert result.returncode == 0, result.stderr[-3000:]
    printed = {
        m[1]: float(m[2])
        for m in re.finditer(r"│\s*(reward/[a-z_]+|val/loss)\s*│\s*([-0-9.e]+)\s*│", result.stdout)
    }
    assert {"reward/accuracy", "reward/margin", "reward/ece", "reward/nll", "val/loss"} <= printed.keys()
    # the numbers are the trained checkpoint's: the end-of-epoch validation of the fit logged the same
    assert printed["reward/margin"] == pytest.approx(fitted["reward/margin"][-1][1], rel=1e-5, abs=1e-6)
    assert printed["reward/accuracy"] == pytest.approx(fitted["reward/accuracy"][-1][1])
