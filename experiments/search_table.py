"""Print the markdown table of reward-model runs (experiments/minilm_search.sh, or any folders holding
``hf/eval_results.json`` and ``run.json``): pooled and per-file accuracy against the length rule, the paired
z, length-matched accuracy, the score-length Spearman correlation, ECE, wall time and load average.

    python experiments/search_table.py [checkpoints/search/*]
"""

from __future__ import annotations

import glob
import json
import os
import sys


def row(folder: str) -> str | None:
    try:
        with open(os.path.join(folder, "run.json")) as f:
            run = json.load(f)
        with open(os.path.join(folder, "hf", "eval_results.json")) as f:
            results = json.load(f)
    except (OSError, ValueError):
        return None
    m, bias = results["metrics"], results["length_bias"]
    files = " / ".join(f"{v['accuracy']:.3f}" for v in results["per_file"].values())
    rules = " / ".join(f"{v['length_rule_accuracy']:.3f}" for v in results["per_file"].values())
    matched = bias["length_matched"]
    return (
        f"| {run['name']} | `{run['args'] or '(the recipe)'}` | **{bias['accuracy']:.3f}** | "
        f"{bias['length_rule_accuracy']:.3f} | {bias['vs_length_rule']['z']:.1f} | {files} | {rules} | "
        f"{matched['accuracy']:.3f} ({matched['pairs']}) | {bias['score_length_spearman']:.2f} | "
        f"{m['reward/ece']:.3f} → {m.get('reward/ece_calibrated', m['reward/ece']):.3f} | "
        f"{run['wall_s'] / 60:.1f} | {_load(run)} |"
    )


def _load(run: dict) -> str:
    """The 1-minute load average sampled every 30 s during the run (mean, max), else at its start and end."""
    if "load_mean_max" in run:
        mean, peak = run["load_mean_max"].split()
        return f"{mean} (max {peak})"
    return f"{run['load_start'].split()[0]} → {run['load_end'].split()[0]} (start → end)"


def main(folders: list[str]) -> None:
    print(
        "| run | overrides | accuracy | length rule | z (paired SE) | per file | length rule per file | "
        "length-matched (pairs) | Spearman(score, length) | ECE → calibrated | wall (min) | load average |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for folder in folders:
        line = row(folder)
        if line:
            print(line)


if __name__ == "__main__":
    main(sys.argv[1:] or sorted(glob.glob("checkpoints/search/*")))
