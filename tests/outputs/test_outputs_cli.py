"""What is never lost, through the command's entry point (``rlhf_lit.cli.main``, and the console script in a
subprocess for the full-disk case): a second run on a locked folder, a reused export folder, a full disk at
export. Each refusal exits 2 with at most 3 lines on stderr naming the folder, no traceback, and the earlier
output is neither lost nor mixed with the new run's files."""

from __future__ import annotations

import hashlib
import json
import os
import re
import resource
import signal
import socket
import subprocess
import sys

import pytest

from rlhf_lit.cli import main
from tests.cli.helpers import console_script
from tests.tiny_runs import REPO_ROOT, in_repo_root, one_thread

SFT = "configs/sft/tiny.yaml"


def sft_args(root, *extra: str) -> list[str]:
    """A 1-step tiny SFT run with every output under ``root``."""
    return [
        "fit",
        "--config",
        SFT,
        f"--trainer.default_root_dir={root}/run",
        f"--trainer.logger.init_args.save_dir={root}/run",
        f"--model.init_args.export_dir={root}/hf",
        "--trainer.max_steps=1",
        "--trainer.enable_checkpointing=false",
        "--data.init_args.max_train_samples_per_file=16",
        "--data.init_args.val_size=0",
        *extra,
    ]


def run_main(args, capsys) -> tuple[int, list[str]]:
    with in_repo_root(), one_thread():
        try:
            main(args)
            code = 0
        except SystemExit as exit_:
            code = exit_.code
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    return code, err


def digest(folder) -> dict[str, str]:
    """File name -> sha256 of every file in ``folder``."""
    out = {}
    for root, _, files in os.walk(folder):
        for name in files:
            path = os.path.join(root, name)
            with open(path, "rb") as f:
                out[os.path.relpath(path, folder)] = hashlib.sha256(f.read()).hexdigest()
    return out


def assert_one_line_error(code, err, *needles):
    assert code == 2, err
    assert 1 <= len(err) <= 3, err
    assert not any("Traceback" in line for line in err), err
    assert err[0].startswith("rlhf-lit: error: ")
    for needle in needles:
        assert needle in "\n".join(err), (needle, err)


@pytest.fixture(scope="module")
def first_export(tmp_path_factory):
    """One real tiny SFT export (the earlier run's output the cases below must not lose)."""
    root = tmp_path_factory.mktemp("first")
    with in_repo_root(), one_thread():
        main(sft_args(root))
    assert os.path.exists(root / "hf" / "rlhf_lit.json")
    return root


def copy_export(src, dst) -> None:
    import shutil

    shutil.copytree(src / "hf", dst / "hf")


def test_second_run_on_a_locked_export_folder_is_refused(tmp_path, capsys):
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        lock = tmp_path / ".hf.rlhf_lit.lock"
        started = "2026-12-02T00:00:00+00:00"
        lock.write_text(json.dumps({"pid": sleeper.pid, "host": socket.gethostname(), "started": started}))
        code, err = run_main(sft_args(tmp_path), capsys)
    finally:
        sleeper.kill()
        sleeper.wait()
    assert_one_line_error(code, err, f"{tmp_path}/hf", f"pid {sleeper.pid}", started)
    assert not (tmp_path / "hf").exists()  # nothing written by the refused run
    assert json.loads(lock.read_text())["pid"] == sleeper.pid  # the other run's lock is untouched


def test_second_run_on_a_locked_log_folder_is_refused(tmp_path, capsys):
    lock = tmp_path / ".run.rlhf_lit.lock"
    lock.write_text(json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "started": "then"}))
    code, err = run_main(sft_args(tmp_path), capsys)
    assert_one_line_error(code, err, f"{tmp_path}/run", f"pid {os.getpid()}")


def test_a_reused_export_folder_is_refused_and_kept(first_export, tmp_path, capsys):
    copy_export(first_export, tmp_path)
    before = digest(tmp_path / "hf")
    code, err = run_main(sft_args(tmp_path), capsys)
    assert_one_line_error(code, err, f"{tmp_path}/hf", "--overwrite")
    assert digest(tmp_path / "hf") == before


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


def _limit_file_size(limit: int):
    def apply():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return apply


def test_full_disk_at_export_keeps_the_earlier_export_loadable(first_export, tmp_path):
    copy_export(first_export, tmp_path)
    before = digest(tmp_path / "hf")
    weights = max(os.path.getsize(tmp_path / "hf" / f) for f in before)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO_ROOT)}
    env.pop("RLHF_LIT_DEBUG", None)
    result = subprocess.run(
        [console_script(), *sft_args(tmp_path), "--overwrite"],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        preexec_fn=_limit_file_size(weights // 2),  # every file may grow to half the weights file
    )
    err = [line for line in result.stderr.splitlines() if line.strip() and "rlhf-lit: error" in line]
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    assert_one_line_error(2, err, f"{tmp_path}/hf", "bytes")
    assert digest(tmp_path / "hf") == before  # the earlier export, whole
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(tmp_path / "hf")  # and loadable
    assert sorted(e for e in os.listdir(tmp_path) if e.startswith(".")) == []


def test_the_cli_writes_checkpoints_atomically(tmp_path):
    from rlhf_lit.checkpoint_io import AtomicCheckpointIO
    from rlhf_lit.lightning_cli import cli_main

    with in_repo_root(), one_thread():
        cli = cli_main(sft_args(tmp_path)[1:], run=False)
    assert isinstance(cli.trainer.strategy.checkpoint_io, AtomicCheckpointIO)


def test_full_disk_at_a_checkpoint_is_one_line_naming_the_folder(first_export, tmp_path):
    weights = os.path.getsize(first_export / "hf" / "model.safetensors")
    args = [a for a in sft_args(tmp_path) if a != "--trainer.enable_checkpointing=false"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO_ROOT)}
    env.pop("RLHF_LIT_DEBUG", None)
    result = subprocess.run(
        [console_script(), *args],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        preexec_fn=_limit_file_size(weights // 2),  # the checkpoint (weights + optimizer state) cannot fit
    )
    err = [line for line in result.stderr.splitlines() if line.strip() and "rlhf-lit: error" in line]
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    assert_one_line_error(2, err, "checkpoint", f"{tmp_path}/run", "bytes")
    assert not (tmp_path / "hf").exists()  # the run failed: no export, no staging folder left
    assert sorted(e for e in os.listdir(tmp_path) if e.startswith(".")) == []
    leftovers = [f for _, _, files in os.walk(tmp_path / "run") for f in files if ".tmp-" in f]
    assert leftovers == []  # no half-written checkpoint
