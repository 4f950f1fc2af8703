"""Running the real ``rlhf-lit`` console script in a subprocess, from the repository root."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from tests.conftest import REPO_ROOT


def console_script() -> str:
    """The installed ``rlhf-lit`` script of this environment (beside the running Python)."""
    script = Path(sys.executable).with_name("rlhf-lit")
    return str(script) if script.exists() else shutil.which("rlhf-lit") or "rlhf-lit"


def run_cli(*args: str, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """``rlhf-lit <args>`` with CWD = the repository root, one thread, offline; captures stdout and stderr."""
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
    )


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
