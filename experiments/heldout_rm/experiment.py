"""The experiment from two reward-model exports: split checks, prompt files, the PPO fit (package docstring)."""

from __future__ import annotations

import argparse
import json
import logging
import os
import time

import torch

from experiments.heldout_rm.callback import HeldOutRewardCallback
from experiments.heldout_rm.report import report_markdown, write_report
from rlhf_lit.outputs import replace_file

log = logging.getLogger("rlhf_lit")


def _data_record(export: str) -> dict:
    from rlhf_lit.models.export import read_meta

    record = read_meta(export).get("data")
    if not record:
        raise ValueError(f"{export!r} records no training data (exported by an older rlhf_lit?); retrain it")
    return record


def check_disjoint(record_a: dict, record_b: dict) -> None:
    """Refuse two reward models that do not share one validation split or whose training pairs overlap.

    Raises:
        ValueError: naming the setting that differs.
    """
    split = ("train_files", "val_files", "val_size", "seed", "format", "max_length", "min_prompt_tokens")
    for key in split:
        if record_a.get(key) != record_b.get(key):
            raise ValueError(
                f"RM-A and RM-B were not split alike: {key} is {record_a.get(key)!r} vs {record_b.get(key)!r}"
            )
    a, b = record_a.get("train_part"), record_b.get("train_part")
    if a is None or b is None or a[1] != b[1] or a[0] == b[0]:
        raise ValueError(
            f"RM-A and RM-B must be trained on different parts of one split (data.train_part), got {a} and {b}"
        )
    if record_a.get("max_train_samples_per_file") != record_b.get("max_train_samples_per_file"):
        raise ValueError("RM-A and RM-B use different max_train_samples_per_file")


def write_prompt_files(export_a: str, out: str, num_eval: int, seed: int = 0) -> tuple[str, str, dict]:
    """The PPO training prompts (of the training pairs, all parts) and ``num_eval`` evaluation prompts (of
    the validation pairs, the same number from each file, a seeded sample) as JSONL files in ``out``.

    The split is rebuilt with the preference data module and RM-A's recorded settings; each line holds the
    pair's chosen transcript (``{"chosen": ...}``, the ``hh`` prompt format, whose prompt is the transcript up
    to its last ``"\n\nAssistant:"``: the pair's prompt). Returns the two paths and counts.
    """
    from rlhf_lit.data import PreferenceDataModule
    from rlhf_lit.data.formats import Fields
    from rlhf_lit.data.loading import load_rows
    from rlhf_lit.data.preference_formats import preference_records
    from rlhf_lit.models.tokenizer import load_tokenizer

    record = dict(_data_record(export_a))
    record["train_part"] = None  # every training pair's prompt may serve PPO
    data = PreferenceDataModule(**record, tokenizer=load_tokenizer(export_a))
    data.setup("fit")
    if data.format not in ("hh", "auto"):
        raise ValueError(
            f"the held-out experiment reads HH transcripts; RM-A was trained on {data.format!r} data"
        )
    prompts: dict[tuple[int, int], str] = {}
    for source, path in enumerate(data._source_specs):
        rows = load_rows(path)
        for _, rec in preference_records(rows, "hh", Fields(), False, source, path):
            if not isinstance(rec, str):
                prompts[(source, rec["row"])] = rows[rec["row"]]["chosen"]
    train = sorted({(e["source"], e["row"]) for e in data.train_dataset.examples})
    val = sorted({(e["source"], e["row"]) for e in data.val_dataset.examples})
    if set(train) & set(val):
        raise AssertionError("training and validation pairs overlap")  # split_examples guarantees they do not
    g = torch.Generator().manual_seed(seed)
    per_file = {}
    for key in val:
        per_file.setdefault(key[0], []).append(key)
    take = num_eval // max(1, len(per_file))
    chosen = []
    for keys in per_file.values():
        order = torch.randperm(len(keys), generator=g).tolist()[:take]
        chosen += [keys[i] for i in order]
    # interleave the files so that the first batches already mix them
    chosen = [k for group in zip(*[[k for k in chosen if k[0] == s] for s in per_file]) for k in group]
    os.makedirs(out, exist_ok=True)
    paths = (os.path.join(out, "prompts_train.jsonl"), os.path.join(out, "prompts_eval.jsonl"))
    for path, keys in zip(paths, (train, chosen)):
        replace_file(path, "".join(json.dumps({"chosen": prompts[k]}) + "\n" for k in keys))
    return (
        paths[0],
        paths[1],
        {"train_prompts": len(train), "eval_prompts": len(chosen), "val_pairs": len(val)},
    )


def arm_cli(config: str, out: str, arm: str, train_file: str, extra: list[str], *settings: str):
    """``rlhf-lit fit``'s CLI, not run, for one arm of the experiment: ``config`` with ``train_file`` as its
    data, and its log, checkpoints and export under ``<out>/<arm>`` (``<out>/<arm>/hf``), then ``settings``
    and the user's ``extra`` overrides."""
    from rlhf_lit.cli import cli_main

    folder = os.path.join(os.path.abspath(out), arm)
    return cli_main(
        [
            "--config",
            config,
            *settings,
            f"--data.init_args.train_files=[{train_file}]",
            f"--trainer.default_root_dir={folder}",
            f"--trainer.logger.init_args.save_dir={folder}",
            f"--model.init_args.export_dir={folder}/hf",
            *extra,
        ],
        run=False,
    )


def main(argv: list[str] | None = None) -> dict:
    """Run the experiment (see the module docstring); extra arguments after ``--`` go to ``rlhf-lit fit``."""
    parser = argparse.ArgumentParser(
        prog="python -m experiments.heldout_rm",
        description="PPO against reward model A, judged before and after on held-out prompts by reward model B.",
    )
    parser.add_argument("--rm-a", required=True, help="export folder of the reward model PPO optimises")
    parser.add_argument("--rm-b", required=True, help="export folder of the held-out reward model")
    parser.add_argument("--config", default="configs/ppo/smollm2_heldout_rm.yaml", help="the PPO config")
    parser.add_argument("--out", default="checkpoints/heldout_rm", help="output folder")
    parser.add_argument("--eval-prompts", type=int, default=96, help="held-out evaluation prompts")
    parser.add_argument("--eval-batch-size", type=int, default=16)
    parser.add_argument("fit_args", nargs=argparse.REMAINDER, help="-- then overrides for rlhf-lit fit")
    args = parser.parse_args(argv)
    extra = [a for a in args.fit_args if a != "--"]
    t0 = time.perf_counter()
    try:
        check_disjoint(_data_record(args.rm_a), _data_record(args.rm_b))
    except ValueError as err:
        parser.exit(2, f"error: {err}\n")
    train_file, eval_file, counts = write_prompt_files(args.rm_a, args.out, args.eval_prompts)
    out = os.path.abspath(args.out)
    cli = arm_cli(
        args.config, out, "ppo", train_file, extra, f"--model.init_args.reward_model.path={args.rm_a}"
    )
    callback = HeldOutRewardCallback(
        args.rm_b, eval_file, args.eval_prompts, args.eval_batch_size, report_dir=out
    )
    cli.trainer.callbacks.append(callback)
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    report = json.load(open(os.path.join(out, "heldout_report.json")))
    report["prompt_files"] = counts
    report["timings"]["total_s"] = time.perf_counter() - t0
    report["load_average"] = list(os.getloadavg())
    write_report(report, out)
    print(report_markdown(report))
    return report
