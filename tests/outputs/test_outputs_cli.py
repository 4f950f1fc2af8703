"""What is never lost, through the command's entry point (``rlhf_lit.cli.main``): ``--overwrite`` replaces an
earlier export whole (never two runs' files mixed) and takes over a stale lock; checkpoints are written
atomically. The refusals (a locked folder, a reused export folder, a full disk at export or at a checkpoint) are
cases of tests/cli/test_catalogue.py, through the console script."""

from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys

import pytest

from rlhf_lit.cli import main
from tests.cli.helpers import SFT, sft_args
from tests.tiny_runs import in_repo_root, one_thread, run_tiny


def run_main(args, capsys) -> tuple[int, list[str]]:
    with in_repo_root(), one_thread():
        try:
            main(args)
            code = 0
        except SystemExit as exit_:
            code = exit_.code
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    return code, err


@pytest.fixture(scope="module")
def first_export(tmp_path_factory):
    """The folder whose ``hf/`` holds a real tiny SFT export (the earlier run's output; copied, never written)."""
    root = run_tiny(SFT, tmp_path_factory).root
    assert os.path.exists(root / "hf" / "rlhf_lit.json")
    return root


def copy_export(src, dst) -> None:
    import shutil

    shutil.copytree(src / "hf", dst / "hf")


def test_overwrite_replaces_the_earlier_export_whole_and_takes_over_a_stale_lock(
    first_export, tmp_path, capsys
):
    copy_export(first_export, tmp_path)
    (tmp_path / "hf" / "eval_results.json").write_text("{}")  # an earlier reward run's file
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    lock = tmp_path / ".hf.rlhf_lit.lock"
    lock.write_text(json.dumps({"pid": dead.pid, "host": socket.gethostname(), "started": "then"}))
    code, err = run_main([*sft_args(tmp_path), "--overwrite"], capsys)
    assert code == 0, err
    files = set(os.listdir(tmp_path / "hf"))
    assert "eval_results.json" not in files and "rlhf_lit.json" in files  # never two runs' files mixed
    assert sorted(e for e in os.listdir(tmp_path) if e.startswith(".")) == []  # no lock, no staging left
    # --overwrite is an option of this command only: the config saved beside the run must not carry it into
    # a later run started from that file
    saved = [os.path.join(r, f) for r, _, fs in os.walk(tmp_path / "run") for f in fs if f == "config.yaml"]
    assert saved and not any(re.search(r"^\s*overwrite:", open(f).read(), re.M) for f in saved)


def test_overwrite_is_listed_in_fit_help(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["fit", "--help"])
    assert exit_.value.code == 0
    assert "--overwrite" in capsys.readouterr().out


def test_the_cli_writes_checkpoints_atomically(tmp_path):
    from rlhf_lit.checkpoint_io import AtomicCheckpointIO
    from rlhf_lit.lightning_cli import cli_main

    with in_repo_root(), one_thread():
        cli = cli_main(sft_args(tmp_path)[1:], run=False)
    assert isinstance(cli.trainer.strategy.checkpoint_io, AtomicCheckpointIO)
