"""``--ckpt_path`` through the real console script: a PPO run stopped after 3 iterations and resumed to 5
equals an uninterrupted 5-iteration run bit for bit, ``validate`` evaluates a reward-model checkpoint, and a
shipped SFT config (no checkpoint settings of its own) resumes with ``--ckpt_path last`` (one line when there is
nothing to resume from yet).

The PPO run is configs/ppo/tiny.yaml made smaller from the command line, with adaptive KL control and
reward normalisation on (so the KL coefficient and the reward statistics must be restored) and two
minibatches per iteration. The interrupted run stops with ``--trainer.max_steps`` (whole iterations only)
and resumes from the ``last.ckpt`` that ModelCheckpoint writes. Both runs execute the same float operations
in the same order on one CPU thread, so the comparison is exact (``torch.equal``).
"""

from __future__ import annotations

import json
import logging
import re

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from rlhf_lit.callbacks.checkpoints import missing_last_note, run_folder_checkpoint
from rlhf_lit.cli import RLHFCLI, cli_main
from tests.cli.helpers import assert_same, run_cli, stderr_lines, without_timings
from tests.tiny_runs import in_repo_root, read_scalars

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
    ckpt = next(tmp_path.glob("checkpoints/epoch=*.ckpt"))  # the run's folder (run_folder_checkpoint)
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


NO_LAST = "there is no last checkpoint available"  # Lightning's warning, which rlhf-lit's own line replaces


def _sft_tiny_args(tmp_path) -> list[str]:
    """configs/sft/tiny.yaml shrunk to 2 training batches of 4 and one validation batch, its checkpoints and
    logs in ``tmp_path``, no export."""
    return [
        "--config",
        "configs/sft/tiny.yaml",
        f"--trainer.default_root_dir={tmp_path}",
        f"--trainer.logger.init_args.save_dir={tmp_path}",
        "--model.init_args.export_dir=null",
        "--trainer.limit_train_batches=2",
        "--trainer.limit_val_batches=1",
        "--data.init_args.max_train_samples_per_file=16",
        "--data.init_args.val_size=8",
        "--data.init_args.batch_size=4",
        "--trainer.enable_progress_bar=false",
    ]


@pytest.mark.slow
def test_ckpt_path_last_resumes_a_shipped_sft_config_and_says_so_when_there_is_nothing_yet(tmp_path):
    """configs/sft/tiny.yaml names no ModelCheckpoint. ``ckpt_path: last`` given from the first run on ("set and
    forget"): the first run (1 epoch of 2 batches) finds nothing, says where it looked in one line and trains
    from the start; the same command with ``max_epochs=2`` restores its ``last.ckpt`` and trains epoch 1 only."""
    args = ["fit", *_sft_tiny_args(tmp_path), "--ckpt_path", "last"]
    first = run_cli(*args, "--trainer.max_epochs=1")
    assert first.returncode == 0, first.stderr[-3000:]
    said = [line for line in stderr_lines(first) if "last" in line and "checkpoint" in line]
    assert said == [
        f"WARNING rlhf_lit: --ckpt_path last: no last checkpoint in {tmp_path / 'checkpoints'}; "
        "training starts from the beginning"
    ], said
    assert NO_LAST not in first.stderr
    folder = tmp_path / "checkpoints"
    assert sorted(p.name for p in folder.iterdir()) == ["epoch=0-step=2.ckpt", "last.ckpt"]

    resumed = run_cli(*args, "--trainer.max_epochs=2")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"Restoring states from the checkpoint path at {folder / 'last.ckpt'}" in resumed.stderr
    assert "no last checkpoint" not in resumed.stderr and NO_LAST not in resumed.stderr
    assert "exists and is not empty" not in resumed.stderr  # it resumes from that folder: no warning about it
    # the resumed run trained epoch 1 (batches 3 and 4) and replaced both files (no last-v1.ckpt beside them)
    assert sorted(p.name for p in folder.iterdir()) == ["epoch=1-step=4.ckpt", "last.ckpt"]
    last = torch.load(folder / "last.ckpt", map_location="cpu", weights_only=True)
    assert last["epoch"] == 1 and last["global_step"] == 4
    assert "validation loss before training" in first.stderr
    assert "validation loss before training" not in resumed.stderr  # a fresh start would measure it again


def test_an_epoch_stage_checkpoint_keeps_last_ckpt_in_the_run_folder_unless_the_trainer_says_otherwise(
    tmp_path,
):
    default = L.Trainer(default_root_dir=str(tmp_path), logger=False)  # Lightning's default ModelCheckpoint
    (added,) = run_folder_checkpoint(default)
    assert type(added) is ModelCheckpoint and added.save_last is True and added.save_top_k == 1
    assert added.dirpath == str((tmp_path / "checkpoints").resolve())
    assert run_folder_checkpoint(L.Trainer(enable_checkpointing=False, logger=False)) == []
    own = L.Trainer(logger=False, callbacks=[ModelCheckpoint(dirpath=str(tmp_path / "ck"))])
    assert run_folder_checkpoint(own) == []  # a folder of the user's: kept
    own = L.Trainer(logger=False, callbacks=[ModelCheckpoint(save_last=True)])
    assert run_folder_checkpoint(own) == []


def test_missing_last_note_names_where_it_looked(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    trainer = L.Trainer(
        default_root_dir="run",
        logger=False,
        callbacks=run_folder_checkpoint(L.Trainer(default_root_dir="run", logger=False)),
    )
    assert missing_last_note(trainer) == (
        "--ckpt_path last: no last checkpoint in run/checkpoints; training starts from the beginning"
    )
    assert missing_last_note(trainer, "validate").endswith("; validate uses the untrained model")
    (tmp_path / "run" / "checkpoints").mkdir(parents=True)
    (tmp_path / "run" / "checkpoints" / "epoch=0-step=2.ckpt").write_bytes(b"")
    assert "no last checkpoint" in missing_last_note(trainer)  # only last*.ckpt is resumed from
    (tmp_path / "run" / "checkpoints" / "last-v1.ckpt").write_bytes(b"")
    assert missing_last_note(trainer) is None
    off = L.Trainer(enable_checkpointing=False, logger=False)
    assert missing_last_note(off) == (
        "--ckpt_path last: checkpointing is off (trainer.enable_checkpointing: false), so no run of this config "
        "writes a last.ckpt; training starts from the beginning"
    )


def test_a_listed_checkpoint_of_any_modelcheckpoint_class_is_the_configs_own():
    """A ``ModelCheckpoint`` subclass in ``trainer.callbacks`` is kept as the config's own (not replaced by the
    run-folder checkpoint), whatever its class is named."""
    from types import SimpleNamespace

    from rlhf_lit.lightning_cli import _is_checkpoint

    listed = SimpleNamespace(class_path="rlhf_lit.callbacks.checkpoints.IterationCheckpoint", init_args={})
    assert _is_checkpoint(listed)
    assert _is_checkpoint(SimpleNamespace(class_path="lightning.pytorch.callbacks.ModelCheckpoint"))
    assert not _is_checkpoint(SimpleNamespace(class_path="rlhf_lit.callbacks.StageProgressBar"))


@pytest.mark.slow
def test_validate_ckpt_path_last_finds_the_fits_last_checkpoint(tmp_path):
    """``validate --ckpt_path last`` with the config a fit ran: it restores that fit's
    ``<default_root_dir>/checkpoints/last.ckpt`` (before, it looked in a new logger folder, found nothing and
    validated the untrained model)."""
    args = [*_sft_tiny_args(tmp_path), "--trainer.max_epochs=1"]
    fit = run_cli("fit", *args)
    assert fit.returncode == 0, fit.stderr[-3000:]
    last = tmp_path / "checkpoints" / "last.ckpt"
    assert last.exists()
    validate = run_cli("validate", *args, "--ckpt_path", "last")
    assert validate.returncode == 0, validate.stderr[-3000:]
    assert f"Restoring states from the checkpoint path at {last}" in validate.stderr
    assert "no last checkpoint" not in validate.stderr and NO_LAST not in validate.stderr
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == [
        "epoch=0-step=2.ckpt",
        "last.ckpt",
    ]


def test_ckpt_path_last_rebuilds_the_model_from_the_checkpoint_and_names_what_the_config_changed(
    tmp_path, monkeypatch, caplog
):
    """Lightning rebuilds the model from a checkpoint's hyper-parameters only for a file path; with ``last`` a
    changed setting won silently. Now ``last`` is found where the run keeps it, the checkpoint's settings are
    used and the changed one is named, as for a file path; ``ckpt_path`` stays ``last`` for Lightning. A run
    setting (``ppo.total_iterations``, RUN_CONTROL_SETTINGS) is the config's, said in a line of its own.
    (Changed: total_iterations used to be named among the settings not used.)"""
    root = tmp_path / "run"
    _fit(root, "--model.init_args.ppo.total_iterations=1")
    monkeypatch.setattr(RLHFCLI, "before_instantiate_classes", lambda self: None)
    monkeypatch.setattr(RLHFCLI, "instantiate_classes", lambda self: None)
    monkeypatch.setattr(RLHFCLI, "_run_subcommand", lambda self, subcommand: None)
    args = [
        "fit",
        *PPO_ARGS,
        f"--trainer.default_root_dir={root}",
        f"--trainer.callbacks.dirpath={root / 'ck'}",
    ]
    with in_repo_root(), caplog.at_level(logging.WARNING, logger="rlhf_lit"):
        cli = cli_main([*args, "--ckpt_path", "last", "--model.init_args.sampling.temperature=0.9"])
    sampling = cli.config.fit.model.init_args.sampling
    temperature = sampling.init_args.temperature if "init_args" in sampling else sampling.temperature
    assert temperature == 0.7 and cli.config.fit.ckpt_path == "last"
    assert cli.config.fit.model.init_args.ppo.total_iterations == 5  # run control: the config's, not the 1 saved
    (used, not_used) = sorted(r.getMessage() for r in caplog.records if "ckpt_path:" in r.getMessage())
    assert "sampling.temperature" in not_used and "not used" in not_used and "total_iterations" not in not_used
    assert used.startswith("ckpt_path: the config's ppo.total_iterations=5 (the checkpoint's 1) is used"), used
    assert "not an exact resume: ppo.total_iterations: the learning-rate schedule" in used
    caplog.clear()
    with in_repo_root(), caplog.at_level(logging.WARNING, logger="rlhf_lit"):
        same = ["--model.init_args.ppo.total_iterations=1", "--ckpt_path", "last"]  # as the checkpoint
        cli_main([*args, *same])
    assert not [r for r in caplog.records if "ckpt_path:" in r.getMessage()]


def test_a_finished_ppo_run_resumes_to_train_longer_and_exports_elsewhere(tmp_path):
    """Issue 37: the same command with ``total_iterations`` 3 (was 2), another ``export_dir`` and ``--ckpt_path``
    used to rebuild the run from the checkpoint's settings and refuse the checkpoint's export folder. Run
    settings follow the config (RUN_CONTROL_SETTINGS): the run trains iterations 3 only, writes the new export,
    and the first export stays byte for byte as it was."""
    from tests.cli.helpers import digest

    root = tmp_path / "run"
    _fit(root, "--model.init_args.ppo.total_iterations=2", f"--model.init_args.export_dir={tmp_path / 'hf'}")
    first = digest(tmp_path / "hf")
    assert json.loads((tmp_path / "hf" / "rlhf_lit.json").read_text())["iterations"] == 2
    resumed = _fit(
        root,
        "--model.init_args.ppo.total_iterations=3",
        f"--model.init_args.export_dir={tmp_path / 'hf3'}",
        "--ckpt_path",
        str(root / "ck" / "last.ckpt"),
    )
    assert resumed["ppo_state"]["iteration"] == 3 and resumed["global_step"] == 3 * STEPS_PER_ITERATION
    assert len(resumed["ppo_state"]["history"]) == 3  # iterations 1-2 restored, iteration 3 trained
    assert json.loads((tmp_path / "hf3" / "rlhf_lit.json").read_text())["iterations"] == 3
    assert digest(tmp_path / "hf") == first  # the first run's export, untouched
    assert resumed["hyper_parameters"]["export_dir"] == str(tmp_path / "hf3")
