"""The length-control table of docs/experiments/length_control.md from ``rlhf-lit evaluate --heldout --out``
folders: one row per run, the pooled validation pairs' figures (the ``all`` column of each
``evaluation.json``), then the mean over seeds per recipe.

    python -m experiments.length_control_table plain_s0=/tmp/runs/plain_s0/eval plain_s1=... > table.md

A label ``<recipe>_s<seed>`` groups runs by recipe for the per-recipe mean.
"""

from __future__ import annotations

import json
import os
import sys
from collections import defaultdict

COLUMNS = (
    ("pooled accuracy", lambda r: f"{r['accuracy']:.3f} ± {r['accuracy_se']:.3f}"),
    ("chosen shorter", lambda r: f"{r['chosen_shorter']['accuracy']:.3f} (n {r['chosen_shorter']['pairs']})"),
    ("chosen longer", lambda r: f"{r['chosen_longer']['accuracy']:.3f} (n {r['chosen_longer']['pairs']})"),
    ("length-matched", lambda r: f"{r['length_matched']['accuracy']:.3f} (n {r['length_matched']['pairs']})"),
    ("Spearman(score, length)", lambda r: f"{r['score_length_spearman']:+.3f}"),
    ('"longer wins"', lambda r: f"{r['longer_wins']['accuracy']:.3f}"),
    ("ECE at recorded T", lambda r: f"{r['calibration']['recorded']['ece']:.3f}"),
)
# the figures averaged over seeds per recipe
MEANS = (
    ("pooled accuracy", lambda r: r["accuracy"]),
    ("chosen shorter", lambda r: r["chosen_shorter"]["accuracy"]),
    ("chosen longer", lambda r: r["chosen_longer"]["accuracy"]),
    ("length-matched", lambda r: r["length_matched"]["accuracy"]),
    ("Spearman(score, length)", lambda r: r["score_length_spearman"]),
)


def pooled(folder: str) -> dict:
    """The ``all`` column (or the only file) of ``<folder>/evaluation.json``."""
    with open(os.path.join(folder, "evaluation.json")) as f:
        files = json.load(f)["files"]
    return files["all"] if "all" in files else next(iter(files.values()))


def table(runs: dict[str, str]) -> str:
    reports = {label: pooled(folder) for label, folder in runs.items()}
    lines = ["| run | " + " | ".join(name for name, _ in COLUMNS) + " |", "|---|" + "---|" * len(COLUMNS)]
    for label, r in reports.items():
        lines.append(f"| {label} | " + " | ".join(fmt(r) for _, fmt in COLUMNS) + " |")
    recipes: dict[str, list[dict]] = defaultdict(list)
    for label, r in reports.items():
        recipes[label.rsplit("_s", 1)[0]].append(r)
    lines += [
        "",
        "| recipe (mean of seeds) | " + " | ".join(n for n, _ in MEANS) + " |",
        "|---|" + "---|" * len(MEANS),
    ]
    for recipe, rs in recipes.items():
        means = [sum(get(r) for r in rs) / len(rs) for _, get in MEANS]
        lines.append(
            f"| {recipe} ({len(rs)}) | "
            + " | ".join(f"{m:+.3f}" if "Spearman" in n else f"{m:.3f}" for (n, _), m in zip(MEANS, means))
            + " |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(table(dict(arg.split("=", 1) for arg in sys.argv[1:])), end="")
