"""Another library's log lines and warnings never come before ``rlhf-lit: error:``.

A library the command imports may log or warn on import (transformers 5.25 pulls in ``kernels``, which on an
avx512_bf16 CPU logs "Skipping publisher trust check ... offline mode" when bitsandbytes loads). Those lines are
held until the run starts: a user mistake found before that prints its one line alone, ``--verbose`` shows
them, and a command that ends well prints them (held, not lost). Tested with a stand-in library that logs and
warns at import time, imported by the config parser (a callback's ``class_path``), through the real console
script.
"""

from __future__ import annotations

import textwrap

import pytest

from tests.cli.helpers import SFT, run_cli

NOISY = textwrap.dedent(
    """
    import logging
    import warnings

    from lightning.pytorch.callbacks import Callback

    logging.getLogger("noisylib.hub").warning("noisylib: skipping a trust check, the hub is offline")
    warnings.warn("noisylib: an optional kernel is missing", UserWarning)


    class Quiet(Callback):
        pass
    """
)


@pytest.fixture(scope="module")
def noisy_env(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("noisylib")
    (root / "noisylib.py").write_text(NOISY)
    import os

    return {"PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]).strip(os.pathsep)}


def _mistake(tmp_path) -> list[str]:
    """``fit`` with the noisy library imported at parse time and a training file that does not exist."""
    return [
        "fit",
        "--config",
        SFT,
        "--trainer.callbacks+=noisylib.Quiet",
        f"--data.init_args.train_files=[{tmp_path}/missing.jsonl]",
        f"--trainer.default_root_dir={tmp_path}/run",
        f"--model.init_args.export_dir={tmp_path}/hf",
    ]


def test_a_user_mistake_prints_its_line_alone_whatever_a_library_logged(noisy_env, tmp_path):
    result = run_cli(*_mistake(tmp_path), env=noisy_env)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2, result.stderr[-3000:]
    assert len(lines) == 1 and lines[0].startswith("rlhf-lit: error: "), lines
    assert "missing.jsonl" in lines[0], lines
    assert "noisylib" not in result.stdout + result.stderr


def test_verbose_shows_the_library_lines_before_the_error(noisy_env, tmp_path):
    result = run_cli(*_mistake(tmp_path), "--verbose", env=noisy_env)
    assert result.returncode == 2, result.stderr[-3000:]
    err = result.stderr
    assert "skipping a trust check" in err and "an optional kernel is missing" in err, err
    assert err.index("skipping a trust check") < err.index("rlhf-lit: error: ")


def test_a_command_that_ends_well_prints_what_was_held(noisy_env):
    result = run_cli("plan", "--config", SFT, "--trainer.callbacks+=noisylib.Quiet", env=noisy_env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "skipping a trust check" in result.stderr, result.stderr
    assert "an optional kernel is missing" in result.stderr, result.stderr
