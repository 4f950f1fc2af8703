"""``rlhf-lit evaluate``: score a preference model on preference files, with no training run and no checkpoint.

    rlhf-lit evaluate --model <export_dir> --data <file> [--data <file2> ...] [--out <dir>] [--format hh]
    rlhf-lit evaluate --model <export_dir> --heldout      # the export's own validation pairs, per file

Per file: accuracy (ties 1/2) ± SE, the "longer wins" / "shorter wins" rules and the model's paired
difference to the better one, accuracy when the chosen response is longer / shorter, length-matched accuracy
(lengths within 10%, in the model's tokens), Spearman(score, length), and the NLL / ECE of
``sigmoid((s_chosen - s_rejected) / T)`` at the export's recorded T and at a T re-fitted on the file
(``rlhf_lit.evaluation.report``); a warning when a file's lengths or scores sit far from the validation pairs
the export was calibrated on. With several files, a last column ``all`` pools every distinct pair (each row
of its ``all.scores.jsonl`` names its ``file``). ``--heldout`` scores
the pairs the export's training run held out for validation (the split its ``rlhf_lit.json`` records, rebuilt
exactly; ``RewardExportScorer.read_heldout``) instead of, or beside, ``--data`` files. Printed as a markdown
table; with ``--out``, also written there: ``evaluation.json``, ``evaluation.md`` and ``<file>.scores.jsonl``
(one line per pair: ``chosen_score``, ``rejected_score`` uncalibrated, ``chosen_tokens``, ``rejected_tokens``),
each written to a temporary sibling and renamed when complete.

The model is read behind ``scorers.PairScorer`` (``read_pairs`` in its own encoding, ``score_pairs``), so a
preference model other than a reward-model export can be added as a second scorer.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import torch

from rlhf_lit.errors import ConfigError, UserError
from rlhf_lit.evaluation.report import SHIFT_THRESHOLD, evaluate_scores, markdown_table, shift_warnings
from rlhf_lit.evaluation.scorers import PairScorer, RewardExportScorer
from rlhf_lit.outputs import replace_file

__all__ = ["evaluate_file", "main"]

_FORMATS = ("auto", "hh", "explicit", "messages", "sharegpt", "ranked", "oasst_tree")


class _Parser(argparse.ArgumentParser):
    def error(
        self, message: str
    ):  # one line and exit 2 through rlhf_lit.cli.main, not argparse's usage block
        raise ConfigError(f"evaluate: {message} (rlhf-lit evaluate --help)")


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="rlhf-lit evaluate",
        description="Score a reward-model export on preference files: accuracy, length rules, length bias "
        "and calibration, per file.",
    )
    parser.add_argument("--model", required=True, help="a reward-model export folder (the run's export_dir)")
    parser.add_argument(
        "--data", action="append", default=[], help="a preference file (repeat for several files)"
    )
    parser.add_argument(
        "--heldout",
        action="store_true",
        help="also score the export's own validation pairs (the split recorded in its rlhf_lit.json)",
    )
    parser.add_argument("--out", help="write evaluation.json, evaluation.md and per-pair scores here")
    parser.add_argument("--format", default="auto", choices=_FORMATS, help="row format (default: per file)")
    parser.add_argument(
        "--max-tokens", type=int, default=8192, help="padded tokens per forward (pairs sorted by length)"
    )
    return parser


def evaluate_file(
    scorer: PairScorer, path: str, format: str = "auto", read: tuple[list, str] | None = None
) -> tuple[dict, list[dict]]:
    """Read, score and evaluate one file: ``(report, per_pair_rows)``. The report is ``evaluate_scores``'s,
    plus ``data`` (the data module's kept / skipped line), ``warnings`` (``shift_warnings``) and ``seconds``
    (reading, when not already ``read``, and scoring). ``read``: the file's ``scorer.read_pairs`` already."""
    start = time.perf_counter()
    pairs, data_line = read if read is not None else scorer.read_pairs(path, format)
    chosen, rejected = scorer.score_pairs(pairs)
    rows = [
        {
            "pair": i,
            "chosen_score": c,
            "rejected_score": r,
            "chosen_tokens": len(p.chosen_ids),
            "rejected_tokens": len(p.rejected_ids),
        }
        for i, (c, r, p) in enumerate(zip(chosen.tolist(), rejected.tolist(), pairs))
    ]
    report = report_rows(scorer, rows)
    report["data"] = data_line
    report["seconds"] = round(time.perf_counter() - start, 2)
    return report, rows


def report_rows(scorer: PairScorer, rows: list[dict]) -> dict:
    """``evaluate_scores`` of per-pair rows (``chosen_score``, ``rejected_score``, ``chosen_tokens``,
    ``rejected_tokens``), plus ``warnings`` (``shift_warnings`` against the scorer's validation summary)."""
    column = {
        k: [row[k] for row in rows]
        for k in ("chosen_score", "rejected_score", "chosen_tokens", "rejected_tokens")
    }
    report = evaluate_scores(
        torch.tensor(column["chosen_score"], dtype=torch.float32),
        torch.tensor(column["rejected_score"], dtype=torch.float32),
        torch.tensor(column["chosen_tokens"], dtype=torch.long),
        torch.tensor(column["rejected_tokens"], dtype=torch.long),
        scorer.temperature,
    )
    report["warnings"] = shift_warnings(report["summary"], scorer.reference)
    return report


def _unique_names(paths: list[str]) -> list[str]:
    from rlhf_lit.data.loading import source_name

    names: list[str] = []
    for path in paths:
        name, k = source_name(path), 2
        unique = name
        while unique in names:
            unique, k = f"{name}_{k}", k + 1
        names.append(unique)
    return names


def _json_safe(value):
    if isinstance(value, float) and not math.isfinite(value):
        return None if math.isnan(value) else ("inf" if value > 0 else "-inf")
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_json_safe(v) for v in value]
    return value


def _sources(args, scorer: PairScorer) -> list[tuple[str, str, tuple[list, str]]]:
    """The columns to score, ``[(name, file, (pairs, data line))]``: each ``--data`` file (read, so every data
    error comes before any scoring; a file the export was trained on gets a warning), then with ``--heldout``
    the export's validation pairs per file.

    Raises:
        UserError: ``--heldout`` for a scorer with no recorded split (checked before any file is read), or
            two columns of one name.
    """
    record = (getattr(scorer, "meta", None) or {}).get("data") or {}
    if args.heldout and not (hasattr(scorer, "read_heldout") and record):
        raise UserError(
            f"evaluate: --heldout: {scorer.name} records no validation split (an export saved outside a fit, "
            "or by an older rlhf_lit)" + ("" if args.data else "; score files with --data instead")
        )
    read = [scorer.read_pairs(path, args.format) for path in args.data]
    sources = list(zip(_unique_names(args.data), args.data, read))
    trained_on = {os.path.abspath(f) for f in record.get("train_files") or []}
    for name, path, _ in sources:
        if os.path.abspath(path) in trained_on:
            print(
                f"rlhf-lit: warning: {name}: this file holds the pairs {args.model} was trained on (and validated "
                "on); its figures are optimistic. --heldout scores only the pairs it never trained on",
                file=sys.stderr,
            )
    if args.heldout:
        sources += [
            (f"{name}_validation", f"{name}: the validation pairs of {args.model}", (pairs, line))
            for name, pairs, line in scorer.read_heldout()
        ]
    names = [name for name, _, _ in sources]
    if len(set(names)) < len(names):
        raise UserError(
            f"evaluate: two files are both called {sorted(n for n in names if names.count(n) > 1)[0]!r}"
        )
    return sources


def main(argv: list[str] | None = None, scorer: PairScorer | None = None) -> dict:
    """Run ``rlhf-lit evaluate`` (``argv`` without the subcommand) and return ``{file name: report}``.

    Args:
        argv: the command-line arguments after ``evaluate``.
        scorer: score with this instead of loading ``--model`` (another kind of preference model).

    Raises:
        UserError: a missing or non-reward-model ``--model``, or an unreadable ``--data`` file (the ``rlhf-lit``
            command prints it as one line and exits 2).
    """
    args = _parser().parse_args(sys.argv[1:] if argv is None else argv)
    if not args.data and not args.heldout:
        raise ConfigError("evaluate: give --data <file> (repeatable) or --heldout (rlhf-lit evaluate --help)")
    if args.max_tokens < 1:
        raise ConfigError(f"evaluate: --max-tokens must be >= 1, got {args.max_tokens}")
    for path in args.data:
        if ":" not in path and not os.path.exists(path):
            raise UserError(f"evaluate: --data {path}: no such file (resolved to {os.path.abspath(path)})")
    if args.out and os.path.exists(args.out) and not os.path.isdir(args.out):
        raise UserError(f"evaluate: --out {args.out} is a file, not a folder")
    if scorer is None:
        scorer = RewardExportScorer(args.model, max_tokens=args.max_tokens)
    sources = _sources(args, scorer)
    names = [name for name, _, _ in sources]
    reports: dict[str, dict] = {}
    scores: dict[str, list[dict]] = {}
    pooled: dict[tuple, dict] = {}  # one row per distinct pair (a pair in two columns counts once)
    for name, path, (pairs, line) in sources:
        reports[name], scores[name] = evaluate_file(scorer, path, args.format, (pairs, line))
        reports[name]["file"] = path
        for pair, row in zip(pairs, scores[name]):
            key = (tuple(pair.prompt_ids), tuple(pair.chosen_ids), tuple(pair.rejected_ids))
            pooled.setdefault(key, {**row, "file": name})
    if len(sources) > 1:  # every distinct pair of every column, pooled
        name = "all" if "all" not in names else "all_pairs"
        scores[name] = [{**row, "pair": i} for i, row in enumerate(pooled.values())]
        reports[name] = report_rows(scorer, scores[name])
        reports[name]["file"] = "every distinct pair of the columns before, pooled"
    for name, report in reports.items():
        for warning in report["warnings"]:
            print(f"rlhf-lit: warning: {name}: {warning}", file=sys.stderr)
    table = markdown_table(args.model, reports)
    print(table)
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        record = {
            "model": args.model,
            "heldout": bool(args.heldout),
            "length_unit": "tokens of the model's tokenizer, EOS included",
            "shift_threshold": SHIFT_THRESHOLD,
            "reference": scorer.reference,
            "files": reports,
        }
        replace_file(
            os.path.join(args.out, "evaluation.json"), json.dumps(_json_safe(record), indent=2) + "\n"
        )
        replace_file(os.path.join(args.out, "evaluation.md"), table)
        for name, rows in scores.items():
            text = "".join(json.dumps(row) + "\n" for row in rows)
            replace_file(os.path.join(args.out, f"{name}.scores.jsonl"), text)
    return reports
