"""The README's promises that can drift: its two set-up commands and the metric glossary."""

from __future__ import annotations

from rlhf_lit.metrics import glossary_markdown


def _readme(repo_root) -> str:
    return (repo_root / "README.md").read_text()


def test_readme_opens_with_exactly_two_setup_commands_and_ci_runs_the_test_one(repo_root):
    text = _readme(repo_root)
    first_block = text.split("```bash\n", 1)[1].split("```", 1)[0]
    commands = [line.split("#")[0].strip() for line in first_block.splitlines() if line.strip()]
    assert len(commands) == 2
    assert commands[0].endswith("rlhf-lit demo")
    assert commands[1].endswith("python -m pytest -q")
    assert "python -m pytest -q" in (repo_root / ".ci" / "run").read_text()


def test_glossary_in_readme_is_generated_from_metrics(repo_root):
    text = _readme(repo_root)
    block = text.split("<!-- glossary:start", 1)[1].split("\n", 1)[1].split("<!-- glossary:end -->", 1)[0]
    assert block.strip() == glossary_markdown().strip()
