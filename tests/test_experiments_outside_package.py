"""Experiment code lives in ``experiments/``, outside the installed package: the package never imports it
(an installed ``rlhf_lit`` has no ``experiments`` beside it), packaging leaves it out, and each experiment
has its report under docs/experiments/."""

from __future__ import annotations

import ast

import pytest

from tests.conftest import REPO_ROOT

EXPERIMENTS = REPO_ROOT / "experiments"


def _imports(path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
    return names


def test_the_package_never_imports_experiment_code():
    files = sorted((REPO_ROOT / "rlhf_lit").rglob("*.py"))
    assert len(files) > 50  # the walk sees the package
    offenders = [
        str(p.relative_to(REPO_ROOT))
        for p in files
        if any(name == "experiments" or name.startswith("experiments.") for name in _imports(p))
    ]
    assert offenders == []


def test_packaging_leaves_experiments_out():
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())
    include = project["tool"]["setuptools"]["packages"]["find"]["include"]
    assert include and all(pattern.startswith("rlhf_lit") for pattern in include)
    assert not (REPO_ROOT / "rlhf_lit" / "heldout_rm").exists()


def test_experiment_code_is_importable_from_the_repository_root():
    from experiments.heldout_rm import check_disjoint, main

    assert callable(check_disjoint) and callable(main)
    assert (EXPERIMENTS / "constraint_proof.py").is_file() and (EXPERIMENTS / "constraint_eval.py").is_file()


def test_every_experiment_names_its_report():
    """Each experiment's code is referenced by a report under docs/experiments/."""
    reports = "".join(p.read_text() for p in (REPO_ROOT / "docs" / "experiments").glob("*.md"))
    for entry in ("heldout_rm", "constraint_proof.py", "minilm_search.sh", "search_table.py", "bf16_autocast_step.py"):
        assert f"experiments/{entry}" in reports or f"experiments.{entry}" in reports, entry
