"""Everything the repository cites is in the repository: no code, test, config or doc names a document
that a user of a clone cannot open (a list of pitfalls kept outside the project was cited 55 times,
three of them in error messages). What a pitfall teaches is said inline or in docs/pitfalls.md, whose
headings are the names that ``pitfall: <name>`` comments use."""

from __future__ import annotations

import re
from pathlib import Path

from tests.conftest import REPO_ROOT

TEXT_SUFFIXES = {".py", ".md", ".yaml", ".yml", ".sh", ".toml", ".txt"}
OUTSIDE_NAME = "PIT" + "FALLS"  # spelt in two pieces so this file does not match itself
OUTSIDE_DOCUMENT = OUTSIDE_NAME + ".md"
# the team's design and style notes live beside the repository, not in it: a citation reads as a dead link
OUTSIDE_NOTES = ("DE" + "SIGN.md", "ST" + "YLE.md")


def _files():
    skip = {".git", "checkpoints", ".bench-artifacts", "__pycache__"}
    for path in REPO_ROOT.rglob("*"):
        if path.is_file() and path.suffix in TEXT_SUFFIXES and not skip & set(path.parts):
            yield path


def test_no_file_cites_a_document_outside_the_repository():
    offenders = []
    for path in _files():
        text = path.read_text(errors="replace")
        if (
            OUTSIDE_DOCUMENT in text
            or re.search(OUTSIDE_NAME + r"\s+B\d\d", text)
            or "../shared/" + "DESIGN" in text
            or any(note in text for note in OUTSIDE_NOTES)
        ):
            offenders.append(str(path.relative_to(REPO_ROOT)))
    assert offenders == []


def test_every_pitfall_cited_is_a_heading_of_docs_pitfalls():
    """Each ``pitfall: <name>`` (or ``docs/pitfalls.md: <name>``) in the code starts with a heading of
    docs/pitfalls.md, so a reader can find what it refers to."""
    headings = [
        line[3:].strip()
        for line in (REPO_ROOT / "docs" / "pitfalls.md").read_text().splitlines()
        if line.startswith("## ")
    ]
    citations, unknown = 0, []
    for path in _files():
        if path.suffix != ".py" or path.name == Path(__file__).name:
            continue
        text = path.read_text()
        for match in re.finditer(r"(?:pitfall|docs/pitfalls\.md): ", text):
            citations += 1
            after = text[match.end() : match.end() + 60]
            if not any(after.startswith(h) for h in headings):
                unknown.append(f"{path.relative_to(REPO_ROOT)}: {after[:40]!r}")
    assert citations > 20, "few pitfall citations found: the pattern of this test is stale"
    assert unknown == []
