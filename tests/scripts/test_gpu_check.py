"""The GPU check's CPU dry run (``bash scripts/gpu_check.sh --dry-run``), under an import blocker that makes
``datasets``, ``jsonargparse``, ``bitsandbytes``, ``docstring_parser`` and ``gguf`` unimportable, as they are on
the GPU machine: every measurement must run (or give its reason), and the JSON and the table must be complete."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO_ROOT / "scripts"))
import gpu_check  # noqa: E402  (scripts/ is no package)

BLOCKED = ("datasets", "jsonargparse", "bitsandbytes", "docstring_parser", "gguf")

# installed in every Python process of the run through PYTHONPATH. It makes the packages look NOT INSTALLED, as on
# the GPU machine: every finder on sys.meta_path is wrapped so that it finds none of them, hence
# ``importlib.util.find_spec`` gives None and ``import`` raises ModuleNotFoundError (an ImportError). A finder
# that raised instead would break libraries that probe with ``find_spec`` (peft does), which the GPU machine
# would not. The log says the hook is active and what it hid.
SITECUSTOMIZE = f"""
import os
import sys

BLOCKED = {BLOCKED!r}
LOG = os.environ["GPU_CHECK_BLOCK_LOG"]


class Hide:
    def __init__(self, inner):
        self.inner = inner

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            with open(LOG, "a") as f:
                f.write("hid " + name + "\\n")
            return None
        return self.inner.find_spec(name, path, target)

    def __getattr__(self, attr):
        return getattr(self.inner, attr)


for name in BLOCKED:
    sys.modules.pop(name, None)
sys.meta_path[:] = [Hide(f) if hasattr(f, "find_spec") else f for f in sys.meta_path]
with open(LOG, "a") as f:
    f.write("active " + " ".join(sys.argv[:2]) + "\\n")
"""

ITERATION_FIELDS = ("iteration_s", "tokens_per_s", "generation_s", "experience_s", "update_s", "update_mfu")


def _blocked_env(tmp_path: Path) -> tuple[dict, Path]:
    site = tmp_path / "blocker"
    site.mkdir()
    (site / "sitecustomize.py").write_text(SITECUSTOMIZE)
    log = tmp_path / "blocked.log"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(site), str(REPO_ROOT)]),
        "GPU_CHECK_BLOCK_LOG": str(log),
        "OMP_NUM_THREADS": "1",
        "PYTHON": sys.executable,
    }
    return env, log


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _is_reason(value) -> bool:
    return isinstance(value, str) and value.startswith(("skipped: ", "unavailable: ")) and len(value) > 20


def test_the_blocker_refuses_the_packages_the_gpu_machine_lacks(tmp_path):
    env, log = _blocked_env(tmp_path)
    for name in BLOCKED:
        proc = subprocess.run(
            [sys.executable, "-c", f"import {name}"], env=env, capture_output=True, text=True
        )
        assert proc.returncode != 0 and "ModuleNotFoundError" in proc.stderr, name
        probe = subprocess.run(
            [sys.executable, "-c", f"import importlib.util; print(importlib.util.find_spec({name!r}))"],
            env=env,
            capture_output=True,
            text=True,
        )
        assert probe.stdout.strip() == "None", (name, probe.stdout, probe.stderr)
    assert log.read_text().count("active") == 2 * len(BLOCKED)
    assert all(f"hid {name}" in log.read_text() for name in BLOCKED)


@pytest.mark.slow
def test_dry_run_measures_every_backend_without_the_missing_packages(tmp_path):
    env, log = _blocked_env(tmp_path)
    out = tmp_path / "out"
    proc = subprocess.run(
        ["bash", "scripts/gpu_check.sh", "--dry-run", "--out", str(out)],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "active" in log.read_text()  # the blocker was installed in the run's processes

    results = json.loads((out / "gpu_check.json").read_text())
    assert results["dry_run"] is True and results["peak_flops_bf16"] == 989e12
    assert results["backends"] == ["hf", "static", "static_compiled", "paged"]
    model = results["models"]["tiny"]
    assert isinstance(model, dict), model
    assert _is_number(model["params"]) and model["params"] > 0
    for backend in results["backends"]:
        value = model["sampling"][backend]
        assert _is_reason(value) or (
            _is_number(value["tokens_per_s"])
            and value["tokens_per_s"] > 0
            and value["new_tokens"] > 0
            and (_is_number(value["peak_gpu_memory_mib"]) or _is_reason(value["peak_gpu_memory_mib"]))
        ), (backend, value)
    # the CPU measures the uncompiled and compiled static cache and the hf path (no reason accepted)
    for backend in ("hf", "static", "static_compiled"):
        assert isinstance(model["sampling"][backend], dict), model["sampling"][backend]
    for algorithm in ("ppo", "grpo"):
        assert set(model[algorithm]) == {"hf", "static", "vllm", "paged"}
        # vllm: colocated iterations where vLLM imports; this environment has none
        assert model[algorithm]["vllm"] == gpu_check.VLLM_MISSING
        # paged: the module offers no continuous batching; hf and static run through PPOModule
        assert model[algorithm]["paged"].startswith("unavailable: PPOModule's sampling.backend is hf, static or vllm")
        for backend in ("hf", "static"):
            value = model[algorithm][backend]
            assert isinstance(value, dict), (algorithm, backend, value)
            for field in ITERATION_FIELDS:
                assert _is_number(value[field]) and value[field] > 0, (algorithm, field, value)
            # the phase split adds up to the iteration
            phases = value["generation_s"] + value["experience_s"] + value["update_s"]
            assert phases == pytest.approx(value["iteration_s"], rel=1e-6)
            assert value["update_passes"] == (2 if algorithm == "ppo" else 1)
    assert model["nf4"]["sampling_hf"].startswith("skipped: bitsandbytes not installed")
    assert model["nf4"]["grpo_hf"].startswith("skipped: bitsandbytes not installed")

    table = (out / "gpu_check.md").read_text()
    assert "| model | params | backend | sampling tokens/s | peak GPU MiB |" in table
    for backend in results["backends"]:
        assert f"| tiny | 0M | {backend} |" in table
    assert "| tiny | PPO | hf |" in table and "| tiny | GRPO | hf |" in table
    assert "| tiny | PPO | static |" in table and "| tiny | GRPO | static |" in table
    assert "| tiny | PPO | vllm | skipped |" in table and "| tiny | GRPO | vllm | skipped |" in table


def test_sampling_backends_chooses_which_samplers_are_timed_alone(tmp_path):
    # the second H100 run's form: iterations only; every sampling cell says why it is empty
    results = gpu_check.main(["--out", str(tmp_path), "--dry-run", "--sampling-backends", "", "--budget-s", "0"])
    sampling = results["models"]["tiny"]["sampling"]
    assert sampling == {b: "skipped: not asked for (--sampling-backends)" for b in gpu_check.BACKENDS}
    # --budget-s 0: the iterations give the budget's reason rather than run
    assert results["models"]["tiny"]["ppo"]["hf"].startswith("skipped: time budget")
    with pytest.raises(SystemExit) as exit_info:
        gpu_check.main(["--out", str(tmp_path), "--dry-run", "--sampling-backends", "hf,vllm"])
    assert exit_info.value.code == 2  # argparse's usage error: vllm is an iteration backend, not a sampler here


def test_update_mfu_is_six_n_per_token_over_the_h200_peak():
    # 6 x 1e9 params x 1e4 tokens x 1 pass = 6e13 FLOP in 0.1 s = 6e14 FLOP/s; / 989e12 = 0.60667
    assert gpu_check.update_mfu(10**9, 10**4, 1, 0.1) == pytest.approx(0.60667, rel=1e-4)
    # PPO's two passes (actor, then critic) double the FLOPs: 1.21334
    assert gpu_check.update_mfu(10**9, 10**4, 2, 0.1) == pytest.approx(1.21334, rel=1e-4)


@pytest.mark.parametrize("size, params", [("0.5b", 494_032_768), ("1.5b", 1_543_714_304)])
def test_the_sizes_have_the_parameter_counts_of_qwen2_5(size, params):
    # Qwen2.5-0.5B: 494.03M parameters, Qwen2.5-1.5B: 1.54B (their model cards; tied embeddings counted once)
    model = gpu_check.build_causal_lm(gpu_check.SIZES[size], torch.bfloat16, torch.device("meta"))
    assert gpu_check.count_params(model) == params
