"""The figures ``rlhf-lit evaluate`` reports for one file of scored pairs, the shift warning, and the table.

Notation: N pairs; ``chosen``, ``rejected`` ``(N,)`` uncalibrated scores; ``len_chosen``, ``len_rejected``
``(N,)`` response lengths in the scorer's tokens (EOS included); margin ``m = chosen - rejected``.

* **accuracy**: the mean credit ``1[m > 0] + 0.5 * 1[m = 0]`` (a tie counts 1/2), with its standard error
  ``sd / sqrt(N)`` (``functional.summary.mean_se``).
* **length rules**: "longer wins" credits a pair 1 when the chosen response is longer, 0 when shorter, 1/2 for
  equal lengths; "shorter wins" is its complement. The **paired difference** is the model's credit minus the
  better rule's, pair by pair, mean and SE (``paired_difference``): > 0 means the model beats both rules.
* **chosen longer / shorter**: accuracy over the pairs whose chosen response is strictly longer / shorter.
* **length-matched**: accuracy over the pairs whose lengths differ by at most 10% of the longer
  (``length_matched``; lengths in tokens).
* **Spearman(score, length)** over all 2N responses (``score_length_spearman``).
* **calibration**: NLL (nats per pair) of ``sigmoid(m / T)`` for the label "chosen wins", and the ECE (10
  equal-width bins) of both orderings of every pair (``pairwise_calibration_inputs``, as the reward stage
  calibrates), at the **recorded** T (the export's, fitted on its validation pairs; 1 when none is recorded)
  and at a T **re-fitted** on this file (``fit_temperature``: the best a temperature can do here, an
  optimistic bound since it is fitted on the pairs it is scored on).
* **shift**: Cohen's d (``functional.shift.standardized_mean_difference``) of this file's response lengths
  and scores against the export's validation summary; |d| > :data:`SHIFT_THRESHOLD` on either gives a
  warning that the recorded temperature may not transfer.
"""

from __future__ import annotations

import math

import torch

from rlhf_lit.functional.calibration import (
    TEMPERATURE_BOUNDS,
    binary_nll,
    expected_calibration_error,
    fit_temperature,
    pairwise_calibration_inputs,
)
from rlhf_lit.functional.length_bias import (
    LENGTH_MATCH_TOLERANCE,
    length_matched,
    length_rule_wins,
    pair_credit,
    paired_difference,
    score_length_spearman,
)
from rlhf_lit.functional.shift import response_summary, standardized_mean_difference
from rlhf_lit.functional.summary import mean_se

__all__ = ["ECE_BINS", "SHIFT_THRESHOLD", "evaluate_scores", "markdown_table", "shift_warnings"]

ECE_BINS = 10
# |Cohen's d| above which a file's lengths or scores are "far" from the validation pairs' (a "medium" effect)
SHIFT_THRESHOLD = 0.5


def _subset(credit: torch.Tensor, keep: torch.Tensor) -> dict:
    accuracy, se = mean_se(credit[keep])
    return {"pairs": int(keep.sum()), "accuracy": accuracy, "accuracy_se": se}


def _calibration(margins: torch.Tensor, temperature: float) -> dict:
    probs, labels = pairwise_calibration_inputs(margins, temperature)
    return {
        "temperature": temperature,
        "nll": float(binary_nll(margins, torch.ones_like(margins), temperature)),
        "ece": float(expected_calibration_error(probs, labels, n_bins=ECE_BINS)),
    }


def evaluate_scores(
    chosen: torch.Tensor,
    rejected: torch.Tensor,
    len_chosen: torch.Tensor,
    len_rejected: torch.Tensor,
    recorded_temperature: float | None,
) -> dict:
    """Every figure of one file (module docstring), as plain floats.

    Args:
        chosen, rejected: ``(N,)`` uncalibrated scores, N >= 1.
        len_chosen, len_rejected: ``(N,)`` response lengths in tokens.
        recorded_temperature: the scorer's calibration temperature, or None (T = 1, reported as such).

    Returns:
        ``pairs``, ``accuracy`` / ``accuracy_se``, ``ties``, ``longer_wins`` and ``shorter_wins`` (each
        ``accuracy`` / ``accuracy_se``), ``better_rule``, ``vs_better_rule`` (``difference``, ``se``),
        ``chosen_longer``, ``chosen_shorter``, ``length_matched`` (each ``pairs``, ``accuracy``,
        ``accuracy_se``; ``length_matched`` also ``tolerance``), ``equal_length_pairs``,
        ``score_length_spearman``, ``calibration`` (``recorded`` and ``refit``: ``temperature``, ``nll``,
        ``ece``; ``recorded`` also ``source``, ``refit`` also ``at_bound``) and ``summary`` (the lengths' and
        scores' mean and SD, as the export records its validation pairs').

    Raises:
        ValueError: if there are no pairs.
    """
    if chosen.numel() == 0:
        raise ValueError("no pairs to evaluate")
    margins = (chosen.double() - rejected.double()).float()
    credit = pair_credit(margins)
    longer = length_rule_wins(len_chosen, len_rejected)
    shorter = 1.0 - longer
    accuracy, accuracy_se = mean_se(credit)
    rules = {"longer_wins": longer, "shorter_wins": shorter}
    rule_stats = {name: dict(zip(("accuracy", "accuracy_se"), mean_se(v))) for name, v in rules.items()}
    # the better rule on this file; "longer wins" on a tie
    better = max(rules, key=lambda name: (rule_stats[name]["accuracy"], name == "longer_wins"))
    difference, difference_se = paired_difference(credit, rules[better])
    refit = fit_temperature(margins, torch.ones_like(margins), *TEMPERATURE_BOUNDS)
    recorded = 1.0 if recorded_temperature is None else recorded_temperature
    return {
        "pairs": int(margins.numel()),
        "accuracy": accuracy,
        "accuracy_se": accuracy_se,
        "ties": int((margins == 0).sum()),
        **rule_stats,
        "better_rule": better,
        "vs_better_rule": {"difference": difference, "se": difference_se},
        "chosen_longer": _subset(credit, len_chosen > len_rejected),
        "chosen_shorter": _subset(credit, len_chosen < len_rejected),
        "equal_length_pairs": int((len_chosen == len_rejected).sum()),
        "length_matched": {
            **_subset(credit, length_matched(len_chosen, len_rejected, LENGTH_MATCH_TOLERANCE)),
            "tolerance": LENGTH_MATCH_TOLERANCE,
        },
        "score_length_spearman": score_length_spearman(
            torch.cat([chosen, rejected]), torch.cat([len_chosen, len_rejected])
        ),
        "calibration": {
            "recorded": {
                **_calibration(margins, recorded),
                "source": "none recorded (T = 1)" if recorded_temperature is None else "export",
            },
            "refit": {**_calibration(margins, refit), "at_bound": refit in TEMPERATURE_BOUNDS},
        },
        "summary": response_summary(chosen, rejected, len_chosen, len_rejected),
    }


def shift_warnings(summary: dict, reference: dict | None, threshold: float = SHIFT_THRESHOLD) -> list[str]:
    """Warnings for the quantities whose |Cohen's d| against ``reference`` (the export's
    ``validation_summary``) exceeds ``threshold``; none without a reference.

    Args:
        summary: this file's ``response_summary``.
        reference: the validation pairs' ``response_summary``, or None.
        threshold: the largest |d| accepted.

    Returns:
        One sentence per quantity that moved, naming both means and d.
    """
    if not reference:
        return []
    warnings = []
    for key, what in (("response_tokens", "response length (tokens)"), ("score", "score (uncalibrated)")):
        ref, new = reference.get(key), summary[key]
        if not ref:
            continue
        d = standardized_mean_difference((ref["mean"], ref["sd"]), (new["mean"], new["sd"]))
        if not math.isnan(d) and abs(d) > threshold:
            warnings.append(
                f"{what}: mean {new['mean']:.3g} (sd {new['sd']:.3g}) against {ref['mean']:.3g} "
                f"(sd {ref['sd']:.3g}) on the validation pairs, Cohen's d = {d:+.2f} (|d| > {threshold}): "
                "the recorded temperature may not transfer to these pairs"
            )
    return warnings


def _pm(value: float, se: float) -> str:
    if math.isnan(value):
        return "n/a"
    return f"{value:.3f} ± {se:.3f}" if not math.isnan(se) else f"{value:.3f}"


def _split(subset: dict) -> str:
    return f"{_pm(subset['accuracy'], subset['accuracy_se'])} (n = {subset['pairs']})"


def _nll_ece(cal: dict) -> str:
    flag = ", at a bound" if cal.get("at_bound") else ""
    flag += ", none recorded" if cal.get("source", "export") != "export" else ""
    return f"{cal['nll']:.3f} / {cal['ece']:.3f} (T = {cal['temperature']:.3g}{flag})"


def _rows(r: dict) -> list[tuple[str, str]]:
    """(label, cell) of one file's report; the labels are the same for every file."""
    vs = r["vs_better_rule"]
    lengths = r["summary"]["response_tokens"]
    tolerance = r["length_matched"]["tolerance"]
    return [
        ("pairs", str(r["pairs"])),
        ("accuracy (ties count 1/2)", _pm(r["accuracy"], r["accuracy_se"])),
        ('"longer wins" rule', _pm(r["longer_wins"]["accuracy"], r["longer_wins"]["accuracy_se"])),
        ('"shorter wins" rule', _pm(r["shorter_wins"]["accuracy"], r["shorter_wins"]["accuracy_se"])),
        (
            "model minus the better rule (paired)",
            f"{_pm(vs['difference'], vs['se'])} (vs {r['better_rule'].replace('_', ' ')})",
        ),
        ("accuracy, chosen longer", _split(r["chosen_longer"])),
        ("accuracy, chosen shorter", _split(r["chosen_shorter"])),
        (f"accuracy, length-matched (within {tolerance:.0%} in tokens)", _split(r["length_matched"])),
        ("Spearman(score, length in tokens)", f"{r['score_length_spearman']:.3f}"),
        ("NLL / ECE at the recorded T", _nll_ece(r["calibration"]["recorded"])),
        ("NLL / ECE at T re-fitted on these pairs", _nll_ece(r["calibration"]["refit"])),
        ("response tokens, mean (sd)", f"{lengths['mean']:.1f} ({lengths['sd']:.1f})"),
    ]


def markdown_table(model: str, reports: dict[str, dict]) -> str:
    """A markdown table: one row per figure, one column per file (``reports``: file name -> report of
    ``evaluate_scores``, with ``warnings``), then the files' shift warnings as lines below it."""
    names = list(reports)
    rows = {name: _rows(r) for name, r in reports.items()}
    lines = [
        f"Model: `{model}`. Lengths in the model's tokens (EOS included); ± one standard error; NLL in nats "
        "per pair (a coin's: 0.693); ECE over 10 bins.",
        "",
        "| figure | " + " | ".join(names) + " |",
        "|---|" + "---|" * len(names),
    ]
    for i, (label, _) in enumerate(rows[names[0]]):
        lines.append(f"| {label} | " + " | ".join(rows[name][i][1] for name in names) + " |")
    for name in names:
        for warning in reports[name].get("warnings", []):
            lines.append(f"\n**Warning** ({name}): {warning}")
    return "\n".join(lines) + "\n"
