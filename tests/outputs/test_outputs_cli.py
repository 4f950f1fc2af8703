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


def _checkpointing_args(root) -> list[str]:
    """A 1-step tiny SFT fit that keeps ``last.ckpt`` in ``<root>/run/checkpoints`` and exports nothing."""
    args = [
        a
        for a in sft_args(root)
        if not a.startswith(("--trainer.enable_checkpointing", "--model.init_args.export"))
    ]
    return [*args, "--trainer.enable_checkpointing=true", "--model.init_args.export_dir=null"]


def test_a_fresh_run_beside_an_earlier_runs_checkpoints_is_refused_and_overwrite_replaces_them(
    tmp_path, capsys
):
    """Two runs' checkpoints never share a folder: a second fresh run there is refused before anything loads
    (one line: resume with --ckpt_path last, or --overwrite); --overwrite deletes the earlier ones (Lightning
    would otherwise save the new run's as last-v1.ckpt beside them); a resumed run is not refused."""
    folder = tmp_path / "run" / "checkpoints"
    code, err = run_main(_checkpointing_args(tmp_path), capsys)
    assert code == 0, err
    first = sorted(os.listdir(folder))
    assert "last.ckpt" in first
    stamp = os.path.getmtime(folder / "last.ckpt")
    code, err = run_main(_checkpointing_args(tmp_path), capsys)
    assert code == 2 and len(err) <= 2, err
    assert str(folder) in err[-1] and "--ckpt_path last" in err[-1] and "--overwrite" in err[-1]
    assert (
        sorted(os.listdir(folder)) == first and os.path.getmtime(folder / "last.ckpt") == stamp
    )  # untouched
    code, err = run_main(
        [*_checkpointing_args(tmp_path), "--ckpt_path=last", "--trainer.max_steps=2"], capsys
    )
    assert code == 0, err  # resuming writes beside its own checkpoints, by design
    code, err = run_main([*_checkpointing_args(tmp_path), "--overwrite"], capsys)
    assert code == 0, err
    names = sorted(os.listdir(folder))
    assert names == first and not any("-v1" in n for n in names), names  # the resumed run's step-2 file is gone
    assert os.path.getmtime(folder / "last.ckpt") > stamp
