"""DPO on reward model A's training pairs, for the held-out judge (``python -m experiments.heldout_rm.dpo``).

The PPO arm of the experiment (``python -m experiments.heldout_rm``) optimises RM-A, a reward model trained on
one half of the HH pairs. The DPO arm trains on those same pairs directly (no reward model): the two methods see
the same preference information, and RM-B, trained on the other half, judges both on the same held-out prompts
(``experiments.heldout_rm.judge``).

``main`` checks the two reward models as the PPO arm does, writes the evaluation prompts (the same file, the same
seeded sample) and ``pairs_train.jsonl``: the HH rows of RM-A's training part, rebuilt from RM-A's recorded
split, minus every pair whose prompt is also an evaluation prompt's (HH files repeat prompts across files, so a
training pair may share its prompt with a validation pair), at most ``--pairs`` of them (a seeded sample), and
runs ``rlhf-lit fit`` on the DPO config with that file.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch

from experiments.heldout_rm.experiment import _data_record, arm_cli, check_disjoint, write_prompt_files
from rlhf_lit.outputs import replace_file

HH_REPLY = "\n\nAssistant:"


def hh_prompt(transcript: str) -> str:
    """An HH transcript's prompt: everything before its last ``"\\n\\nAssistant:"``."""
    return transcript[: transcript.rfind(HH_REPLY)]


def write_pair_file(export_a: str, eval_file: str, out: str, max_pairs: int | None, seed: int = 0) -> dict:
    """Write ``out/pairs_train.jsonl``: the ``{"chosen", "rejected"}`` rows RM-A trained on (see the module
    docstring). Returns the counts: ``train_pairs`` (RM-A's part), ``dropped_shared_prompt``, ``written``.

    Raises:
        ValueError: RM-A records no split, or was trained on non-HH data.
    """
    from rlhf_lit.data import PreferenceDataModule
    from rlhf_lit.data.loading import load_rows
    from rlhf_lit.models.tokenizer import load_tokenizer

    record = _data_record(export_a)
    data = PreferenceDataModule(**record, tokenizer=load_tokenizer(export_a))
    data.setup("fit")
    if data.format not in ("hh", "auto"):
        raise ValueError(
            f"the held-out experiment reads HH transcripts; RM-A was trained on {data.format!r} data"
        )
    keys = sorted({(e["source"], e["row"]) for e in data.train_dataset.examples})
    rows = {source: load_rows(path) for source, path in enumerate(data._source_specs)}
    held = {hh_prompt(json.loads(line)["chosen"]) for line in open(eval_file)}
    kept = [k for k in keys if hh_prompt(rows[k[0]][k[1]]["chosen"]) not in held]
    dropped = len(keys) - len(kept)
    if max_pairs is not None and len(kept) > max_pairs:
        order = torch.randperm(len(kept), generator=torch.Generator().manual_seed(seed)).tolist()
        kept = [kept[i] for i in sorted(order[:max_pairs])]
    path = os.path.join(out, "pairs_train.jsonl")
    lines = (
        json.dumps({"chosen": rows[s][r]["chosen"], "rejected": rows[s][r]["rejected"]}) for s, r in kept
    )
    replace_file(path, "".join(line + "\n" for line in lines))
    return {"train_pairs": len(keys), "dropped_shared_prompt": dropped, "written": len(kept), "path": path}


def main(argv: list[str] | None = None) -> dict:
    """Run the DPO arm (module docstring); extra arguments after ``--`` go to ``rlhf-lit fit``."""
    parser = argparse.ArgumentParser(
        prog="python -m experiments.heldout_rm.dpo",
        description="DPO on reward model A's training pairs; judge it with python -m experiments.heldout_rm.judge.",
    )
    parser.add_argument(
        "--rm-a", required=True, help="export folder of the reward model whose pairs DPO trains on"
    )
    parser.add_argument(
        "--rm-b", required=True, help="export folder of the held-out reward model (checked only)"
    )
    parser.add_argument("--config", default="configs/dpo/smollm2_heldout_rm.yaml", help="the DPO config")
    parser.add_argument(
        "--out", default="checkpoints/heldout_rm", help="output folder (shared with the PPO arm)"
    )
    parser.add_argument(
        "--eval-prompts", type=int, default=96, help="held-out evaluation prompts (as the PPO arm)"
    )
    parser.add_argument(
        "--pairs", type=int, default=1024, help="at most this many training pairs (seeded sample)"
    )
    parser.add_argument("fit_args", nargs=argparse.REMAINDER, help="-- then overrides for rlhf-lit fit")
    args = parser.parse_args(argv)
    extra = [a for a in args.fit_args if a != "--"]
    t0 = time.perf_counter()
    try:
        check_disjoint(_data_record(args.rm_a), _data_record(args.rm_b))
    except ValueError as err:
        parser.exit(2, f"error: {err}\n")
    _, eval_file, _ = write_prompt_files(args.rm_a, args.out, args.eval_prompts)
    counts = write_pair_file(args.rm_a, eval_file, args.out, args.pairs)
    out = os.path.abspath(args.out)
    cli = arm_cli(args.config, out, "dpo", counts["path"], extra)
    cli.trainer.fit(cli.model, datamodule=cli.datamodule)
    record = {"pairs": counts, "fit_s": time.perf_counter() - t0, "load_average": list(os.getloadavg())}
    replace_file(os.path.join(out, "dpo_run.json"), json.dumps(record, indent=1))
    print(json.dumps(record))
    return record


if __name__ == "__main__":
    main()
