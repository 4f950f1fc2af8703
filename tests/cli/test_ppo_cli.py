"""PPO through the CLI in-process: ``--trainer.max_steps`` stops at a whole iteration where the progress bar
says, and ``validate --ckpt_path`` scores sampled responses (``val/*``) without touching the training RNG."""

from __future__ import annotations

import math
import os
import subprocess

import torch

from rlhf_lit import metrics as M
from rlhf_lit.callbacks import StageProgressBar
from rlhf_lit.cli import cli_main
from tests.cli.helpers import console_script
from tests.conftest import REPO_ROOT
from tests.tiny_runs import in_repo_root, one_thread

SMALL = [
    "--config",
    "configs/ppo/tiny.yaml",
    "--trainer.logger=false",
    "--model.init_args.export_dir=null",
    "--model.init_args.ppo.ppo_epochs=1",
    "--model.init_args.ppo.ppo_minibatch_size=2",
    "--data.init_args.batch_size=4",
    "--data.init_args.max_prompt_length=32",
    "--model.init_args.sampling.max_new_tokens=8",
    "--model.init_args.log_samples_every=0",
]


def test_max_steps_stops_ppo_where_the_progress_bar_says_and_validate_scores_the_checkpoint(tmp_path, caplog):
    with in_repo_root(), one_thread():
        cli = cli_main(
            [
                "fit",
                *SMALL,
                f"--trainer.default_root_dir={tmp_path}",
                "--trainer.max_steps=6",
                "--trainer.callbacks+=lightning.pytorch.callbacks.ModelCheckpoint",
                f"--trainer.callbacks.dirpath={tmp_path / 'ck'}",
                "--trainer.callbacks.save_last=true",
            ]
        )
        bar = next(c for c in cli.trainer.callbacks if isinstance(c, StageProgressBar))
        # 6 optimizer steps = 3 iterations of 2 (ppo_epochs 1 x 4 prompts / minibatch 2), of the 8 configured
        assert cli.model.iteration == 3 and cli.trainer.global_step == 6
        assert cli.model.ppo.total_iterations == 8 and bar.train_progress_bar.total == 3

        validated = cli_main(
            [
                "validate",
                *SMALL,
                f"--trainer.default_root_dir={tmp_path}",
                "--data.init_args.val_size=8",
                "--ckpt_path",
                str(tmp_path / "ck" / "last.ckpt"),
            ]
        )
        assert "rebuilt with the checkpoint's settings" not in caplog.text  # the same config: nothing differs
        model, batch = validated.model, next(iter(validated.datamodule.val_dataloader()))
        logged = []
        model.log = lambda name, value, **kwargs: logged.append((name, float(value)))
        rng = torch.get_rng_state()
        model.validation_step(batch, 0)
        assert torch.equal(torch.get_rng_state(), rng)  # validation samples from a forked generator
        model.validation_step(batch, 0)
        assert logged[:3] == logged[3:]  # and repeatably (seeded from ppo.seed and the batch index)
    metrics = validated.trainer.callback_metrics
    assert validated.model.iteration == 3  # restored from the checkpoint
    for name in (M.VAL_SCORE_MEAN, M.VAL_KL_REF, M.VAL_RESPONSE_LEN):
        assert math.isfinite(float(metrics[name])), name
    assert 1 <= float(metrics[M.VAL_RESPONSE_LEN]) <= 8
    # the trained adapters differ from the reference, so the sampled responses' KL is not exactly zero
    assert float(metrics[M.VAL_KL_REF]) != 0.0


def test_the_rollout_batch_size_is_linked_from_the_data_module_at_parse_time():
    """The module learns the rollout size from the config (``link_arguments``), not by reading the data module
    during fit: the schedule's optimizer steps per iteration follow ``data.init_args.batch_size``."""
    with in_repo_root(), one_thread():
        cli = cli_main(
            SMALL + ["--data.init_args.batch_size=8"],
            run=False,
        )
    assert cli.config["model"]["init_args"]["rollout_batch_size"] == 8
    assert cli.model.rollout_batch_size == 8
    assert cli.model.optimizer_steps_per_iteration() == 1 * (8 // 2)  # ppo_epochs 1 x 4 minibatches


def test_a_mid_run_error_starts_its_own_line_after_the_progress_bar(tmp_path):
    """The guard stops iteration 1 (``strict_sync``; ``min_new_tokens`` suppresses the stop tokens while sampling
    only: a real gap above float32's 1e-3). With stdout and stderr in one stream (``2>&1``) the progress bar's
    line ends before the message (``StageProgressBar.on_exception``, the CLI flushes stdout first)."""
    result = subprocess.run(
        [
            console_script(),
            "fit",
            *SMALL,
            f"--trainer.default_root_dir={tmp_path}",
            "--model.init_args.sampling.min_new_tokens=8",
            "--model.init_args.sampling.strict_sync=true",
        ],
        cwd=REPO_ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=300,
    )
    assert result.returncode == 2, result.stdout[-2000:]
    assert "it/s]" in result.stdout  # the bar was drawn
    errors = [line for line in result.stdout.splitlines() if "rlhf-lit: error:" in line]
    assert len(errors) == 1 and errors[0].startswith(
        "rlhf-lit: error: PPO iteration 1: the sampler is not the policy being trained"
    ), errors
