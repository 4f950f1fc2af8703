"""``scripts/slurm_multinode.sh`` with a stand-in ``srun``: the command it starts on every task parses.

No SLURM here: the stand-in records its arguments; the test then parses the ``rlhf-lit`` command line with the
CLI (nothing instantiated), so a renamed option or a wrong stacking order fails here, not on a cluster.
"""

from __future__ import annotations

import os
import subprocess

import pytest

from rlhf_lit.cli import RLHFCLI, cli_main
from tests.conftest import REPO_ROOT
from tests.tiny_runs import in_repo_root

SCRIPT = REPO_ROOT / "scripts" / "slurm_multinode.sh"


def _srun_args(tmp_path, env_extra: dict, *args: str) -> list[str]:
    stub = tmp_path / "bin" / "srun"
    stub.parent.mkdir()
    stub.write_text('#!/usr/bin/env bash\nprintf "%s\\n" "$@" > "$SRUN_ARGS"\n')
    stub.chmod(0o755)
    out = tmp_path / "srun_args.txt"
    env = {**os.environ, "PATH": f"{stub.parent}:{os.environ['PATH']}", "SRUN_ARGS": str(out), **env_extra}
    proc = subprocess.run(
        ["bash", str(SCRIPT), *args], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return out.read_text().splitlines()


def test_slurm_script_starts_rlhf_lit_with_the_allocation_and_the_args_parse(tmp_path, monkeypatch):
    env = {"SLURM_JOB_NUM_NODES": "2", "SLURM_NTASKS_PER_NODE": "8(x2)"}
    argv = _srun_args(tmp_path, env, "configs/ppo/tiny.yaml", "--model.init_args.ppo.total_iterations=3")
    assert argv[:2] == ["--kill-on-bad-exit=1", "rlhf-lit"]
    cli_args = argv[2:]
    assert cli_args[:5] == [
        "fit",
        "--config",
        "configs/ppo/tiny.yaml",
        "--config",
        "configs/trainer/fsdp_bf16.yaml",
    ]
    assert "--trainer.num_nodes=2" in cli_args and "--trainer.devices=8" in cli_args
    assert cli_args[-1] == "--model.init_args.ppo.total_iterations=3"  # the user's arguments come last
    monkeypatch.setattr(RLHFCLI, "instantiate_classes", lambda self: None)
    with in_repo_root():
        cli = cli_main(cli_args[1:], run=False)  # everything after the subcommand
    assert cli.config["trainer"]["num_nodes"] == 2 and int(cli.config["trainer"]["devices"]) == 8
    assert cli.config["trainer"]["strategy"]["class_path"].endswith("FSDP2Strategy")
    assert cli.config["model"]["init_args"]["ppo"]["total_iterations"] == 3


def test_slurm_script_refuses_to_run_outside_an_allocation(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    proc = subprocess.run(
        ["bash", str(SCRIPT), "configs/ppo/tiny.yaml"], cwd=REPO_ROOT, env=env, capture_output=True, text=True
    )
    assert proc.returncode != 0 and "run this under sbatch" in proc.stderr


@pytest.mark.parametrize("preset", ["none"])
def test_slurm_script_without_a_preset(tmp_path, preset):
    argv = _srun_args(
        tmp_path,
        {"SLURM_JOB_NUM_NODES": "3", "SLURM_NTASKS_PER_NODE": "4", "PRESET": preset},
        "configs/ppo/tiny.yaml",
    )
    assert argv[2:6] == ["fit", "--config", "configs/ppo/tiny.yaml", "--trainer.accelerator=gpu"]
    assert "--trainer.num_nodes=3" in argv and "--trainer.devices=4" in argv
