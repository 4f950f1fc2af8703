"""Running the real ``rlhf-lit`` console script in a subprocess, from the repository root."""

from __future__ import annotations

import hashlib
import os
import resource
import shutil
import signal
import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO_ROOT


def console_script() -> str:
    """The installed ``rlhf-lit`` script of this environment (beside the running Python)."""
    script = Path(sys.executable).with_name("rlhf-lit")
    return str(script) if script.exists() else shutil.which("rlhf-lit") or "rlhf-lit"


SFT = "configs/sft/tiny.yaml"


def run_cli(
    *args: str, env: dict | None = None, timeout: float = 300, file_size_limit: int | None = None
) -> subprocess.CompletedProcess:
    """``rlhf-lit <args>`` with CWD = the repository root, one thread, offline; captures stdout and stderr.

    ``file_size_limit`` (bytes): no file the command writes may grow past it (``RLIMIT_FSIZE``; a write past
    it fails with ``EFBIG``, as a full disk fails with ``ENOSPC``)."""
    full_env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
    }
    full_env.pop("RLHF_LIT_DEBUG", None)
    full_env.update(env or {})
    return subprocess.run(
        [console_script(), *args],
        cwd=REPO_ROOT,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=timeout,
        preexec_fn=None if file_size_limit is None else _limit_file_size(file_size_limit),
    )


def _limit_file_size(limit: int):
    def apply():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return apply


def sft_args(root, *extra: str) -> list[str]:
    """``fit`` of a 1-step tiny SFT run with every output under ``root`` (``run/``, ``hf/``), no checkpoint."""
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


def digest(folder) -> dict[str, str]:
    """Path relative to ``folder`` -> sha256, of every file under ``folder`` (two equal digests: the same files,
    byte for byte, and no other)."""
    out = {}
    for root, _, files in os.walk(folder):
        for name in files:
            path = os.path.join(root, name)
            with open(path, "rb") as f:
                out[os.path.relpath(path, folder)] = hashlib.sha256(f.read()).hexdigest()
    return out


def stderr_lines(result: subprocess.CompletedProcess) -> list[str]:
    return [line for line in result.stderr.splitlines() if line.strip()]


def assert_same(a, b, where: str = "") -> None:
    """``a`` equals ``b`` exactly, through nested dicts, lists and tuples: tensors by dtype and
    ``torch.equal`` (bit for bit), everything else by ``==``; ``where`` names the first difference."""
    import torch

    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for key in a:
            assert_same(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def without_timings(history: list[dict]) -> list[dict]:
    """A PPO history without its ``perf/`` wall-time figures (the only ones that differ between equal runs)."""
    return [{k: v for k, v in h.items() if not k.startswith("perf/")} for h in history]
