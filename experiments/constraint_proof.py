#!/usr/bin/env python
"""Proof on real prompts: GRPO and PPO (GAE) from the same start, trained on a verifiable instruction
constraint, evaluated on held-out prompts before and after; or GRPO vs DAPO vs GSPO over several seeds.

    python experiments/constraint_proof.py                     # both runs + evaluation, report in checkpoints/constraint_proof
    python experiments/constraint_proof.py --runs grpo         # one run
    python experiments/constraint_proof.py --threads 1 --out /tmp/proof
    python experiments/constraint_proof.py --runs grpo,dapo,gspo --seeds 0,1 --out checkpoints/constraint_pg

What it does (every step writes under ``--out``):

1. Prompts: the real user prompts of ``--prompts`` (default ``../shared/data/prompts/oasst_prompt_lottery_en_250.jsonl``,
   read in place), each given a word limit N from ``--limits`` (10 / 15 / 20, by position) as an instruction
   appended to the prompt ("Answer in at most N words.") and as the row's ``constraints`` field
   (``{"max_words": N}``), which ``rlhf_lit.rewards:instruction_constraints`` reads. A seeded shuffle puts
   ``--heldout`` prompts into ``prompts/heldout.jsonl`` and the rest into ``prompts/train.jsonl``.
2. Training: ``rlhf-lit fit`` on ``configs/ppo/smollm2_constraint_grpo.yaml`` and
   ``configs/ppo/smollm2_constraint_gae.yaml`` (SmolLM2-135M-Instruct, LoRA; the same start, data, sizes and
   reward), with ``train_files`` pointed at ``prompts/train.jsonl``, outputs under ``<out>/<run>/`` and a CSV
   logger (the effective config is ``<out>/<run>/config.yaml``). One run at a time, ``OMP_NUM_THREADS=--threads``.
3. Evaluation (``experiments/constraint_eval.py``): on the held-out prompts, ``--samples`` responses per prompt
   at the training temperature; a response passes when it ends with EOS (not cut at ``max_new_tokens``) and has
   at most N words. Pass rate +- its standard error, before (the start policy) and after each run, and the KL
   to the reference (the start policy, adapters off): the k1 sum over response tokens of samples of the
   trained policy, nats per response, at the sampling temperature (as ``rollout/kl_ref``), against the
   config's ``kl.target_kl`` budget.
4. Report: ``report.json``, ``report.md`` and ``curves.png`` (training score and KL per iteration; held-out
   pass rates with 1-SE bars).

With ``--seeds 0,1`` every run is trained once per seed (the config's ``seed_everything`` and ``ppo.seed`` set to
it, after any ``--set``), all from the same start and on the same prompt split, evaluated with the same
``--seed``; seed 0's runs come first. Outputs go under ``<out>/<run>/seed<s>/`` and the report's ``runs`` are
``<run>/seed<s>``; ``report["methods"]`` adds, per run, the mean over its seeds (``constraint_eval.method_summary``)
and the difference of its held-out pass rate to the first run's. Without ``--seeds`` each run is trained once
with its config's seeds, as before.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))

import constraint_eval as E  # noqa: E402  (experiments/constraint_eval.py)

DEFAULT_PROMPTS = REPO.parent / "shared" / "data" / "prompts" / "oasst_prompt_lottery_en_250.jsonl"
CONFIGS = {
    "grpo": REPO / "configs" / "ppo" / "smollm2_constraint_grpo.yaml",
    "gae": REPO / "configs" / "ppo" / "smollm2_constraint_gae.yaml",
    "dapo": REPO / "configs" / "ppo" / "smollm2_constraint_dapo.yaml",
    "gspo": REPO / "configs" / "ppo" / "smollm2_constraint_gspo.yaml",
}
SEED_KEYS = ("seed_everything", "model.init_args.ppo.seed")  # what --seeds sets in each run's config


def load_prompts(path: Path) -> list[str]:
    """The prompts of a JSON-lines file: bare JSON strings, or objects with a ``prompt`` field."""
    out = []
    with open(path) as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            row = json.loads(line)
            text = row if isinstance(row, str) else row.get("prompt") if isinstance(row, dict) else None
            if not isinstance(text, str) or not text.strip():
                raise ValueError(
                    f"{path}:{line_no}: expected a JSON string or an object with a 'prompt' string"
                )
            out.append(text.strip())
    return out


def constraint_rows(prompts: list[str], limits: list[int]) -> list[dict]:
    """One row per prompt: the instruction appended, the word limit as the row's ``constraints`` field."""
    rows = []
    for i, text in enumerate(prompts):
        n = limits[i % len(limits)]
        rows.append(
            {
                "prompt": f"{text}\n\nAnswer in at most {n} words.",
                "constraints": {"max_words": n},
                "source_row": i,
            }
        )
    return rows


def split_rows(rows: list[dict], heldout: int, seed: int) -> tuple[list[dict], list[dict]]:
    """``(train, heldout)``: a seeded shuffle, the first ``heldout`` rows held out."""
    if not 0 < heldout < len(rows):
        raise ValueError(f"--heldout must be between 1 and {len(rows) - 1}, got {heldout}")
    order = list(range(len(rows)))
    random.Random(seed).shuffle(order)
    return [rows[i] for i in order[heldout:]], [rows[i] for i in order[:heldout]]


def write_jsonl(rows: list[dict], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def parse_seeds(text: str | None) -> list[int] | None:
    """``--seeds``: distinct integers, comma-separated; None (no option) keeps the configs' seeds.

    Raises:
        ValueError: an entry that is not an integer, a repeated seed, or no seed at all.
    """
    if text is None:
        return None
    try:
        seeds = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--seeds {text!r}: expected comma-separated integers, e.g. 0,1") from None
    if not seeds or len(set(seeds)) != len(seeds):
        raise ValueError(f"--seeds {text!r}: expected distinct comma-separated integers, e.g. 0,1")
    return seeds


def run_plan(runs: list[str], seeds: list[int] | None) -> list[tuple[str, str, int | None]]:
    """``(key, run, seed)`` in training order: each run once (key = run, seed None) without seeds, else every
    run for the first seed, then every run for the next (``<run>/seed<s>``), so a stopped proof has whole
    seeds."""
    if seeds is None:
        return [(name, name, None) for name in runs]
    return [(f"{name}/seed{seed}", name, seed) for seed in seeds for name in runs]


def set_key(config: dict, dotted: str, value) -> None:
    node = config
    *parents, last = dotted.split(".")
    for key in parents:
        node = node.setdefault(key, {})
    node[last] = value


def effective_config(name: str, base: Path, run_dir: Path, train_file: Path, overrides: list[str]) -> Path:
    """The run's config: ``base`` with its data and outputs moved under ``run_dir``, then ``overrides``
    (``key.path=<yaml value>``), written to ``run_dir/config.yaml``."""
    config = yaml.safe_load(base.read_text())
    set_key(config, "data.init_args.train_files", [str(train_file)])
    set_key(config, "trainer.default_root_dir", str(run_dir))
    set_key(
        config,
        "trainer.logger",
        {
            "class_path": "lightning.pytorch.loggers.CSVLogger",
            "init_args": {"save_dir": str(run_dir), "name": "csv"},
        },
    )
    set_key(config, "model.init_args.export_dir", str(run_dir / "hf"))
    set_key(config, "model.init_args.export_mode", "adapter")
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--set {item!r}: expected key.path=value")
        set_key(config, key, yaml.safe_load(value))
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / "config.yaml"
    path.write_text(
        f"# {name}: generated by experiments/constraint_proof.py from {base.name}\n" + yaml.safe_dump(config)
    )
    return path


def run_fit(config: Path, threads: int, log_file: Path) -> float:
    """``python -m rlhf_lit fit --config config`` in a child process; its wall time in seconds."""
    env = dict(
        os.environ,
        OMP_NUM_THREADS=str(threads),
        MKL_NUM_THREADS=str(threads),
        TOKENIZERS_PARALLELISM="false",
        HF_HUB_OFFLINE="1",
    )
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    t = time.perf_counter()
    with open(log_file, "w") as log:
        proc = subprocess.run(
            [sys.executable, "-m", "rlhf_lit", "fit", "--config", str(config)],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            cwd=REPO,
        )
    if proc.returncode != 0:
        tail = log_file.read_text()[-2000:]
        raise SystemExit(f"constraint_proof: fit failed (exit {proc.returncode}); see {log_file}\n{tail}")
    return time.perf_counter() - t


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, default=REPO / "checkpoints" / "constraint_proof")
    p.add_argument("--prompts", type=Path, default=DEFAULT_PROMPTS)
    p.add_argument("--runs", default="grpo,gae", help="comma-separated: grpo, gae, dapo, gspo")
    p.add_argument("--limits", default="10,15,20", help="word limits, given to the prompts in turn")
    p.add_argument("--heldout", type=int, default=60, help="held-out prompts (a multiple of --eval-batch)")
    p.add_argument("--samples", type=int, default=3, help="responses per held-out prompt")
    p.add_argument("--eval-batch", type=int, default=20)
    p.add_argument("--seed", type=int, default=0, help="seed of the prompt split and the evaluation")
    p.add_argument(
        "--seeds",
        default=None,
        help="comma-separated training seeds, e.g. 0,1: every run once per seed (sets seed_everything and "
        "model.init_args.ppo.seed, over --set); default: once, with the configs' seeds",
    )
    p.add_argument("--threads", type=int, default=1, help="OMP threads of the runs and the evaluation")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config value in every run, e.g. model.init_args.ppo.total_iterations=2",
    )
    p.add_argument(
        "--merge",
        default=None,
        metavar="DIR,DIR,...",
        help="instead of training: merge the reports of proofs run apart (e.g. one --seeds value per process, "
        "each with its own --out) into one report in --out",
    )
    p.add_argument(
        "--config",
        action="append",
        default=[],
        metavar="RUN=PATH",
        help="use another config for a run, e.g. grpo=configs/ppo/tiny_grpo.yaml",
    )
    return p.parse_args(argv)


# what must agree for runs of several proofs to share one start and one held-out evaluation
_SHARED_KEYS = ("prompts", "limits", "n_train", "n_heldout", "samples_per_prompt", "seed", "threads")


def merge_reports(reports: list[dict]) -> dict:
    """One report of several proofs run apart (e.g. one training seed per process): their runs in the order
    given, then the per-method means over every seed (``constraint_eval.method_summaries``).

    Raises:
        ValueError: the reports differ in what the start's evaluation depends on (``_SHARED_KEYS``), their start
            evaluations differ (per held-out prompt), a run key (``<run>/seed<s>``) appears twice, or there is
            no report.
    """
    if not reports:
        raise ValueError("no report to merge")
    first = reports[0]
    runs: dict = {}
    for i, r in enumerate(reports):
        differ = [k for k in _SHARED_KEYS if r.get(k) != first.get(k)]
        if differ:
            raise ValueError(f"report {i} differs from report 0 in {differ}: not one held-out evaluation")
        if r["before"]["per_prompt_pass"] != first["before"]["per_prompt_pass"]:
            raise ValueError(f"report {i} evaluated the start policy differently from report 0")
        for key, run in r["runs"].items():
            if key in runs:
                raise ValueError(f"run {key} is in more than one report")
            runs[key] = run
    merged = dict(first, runs=runs, command=" and ".join(r["command"] for r in reports))
    seeds = sorted({s for r in reports for s in r.get("seeds") or []})
    if seeds:
        merged["seeds"] = seeds
        merged["methods"] = E.method_summaries(merged)
    return merged


def main(argv=None, *, fit=run_fit, evaluate=None) -> dict:
    """Run the proof of the command line ``argv``; the report (as ``report.json``).

    Args:
        fit: ``(config_path, threads, log_file) -> wall seconds``, training one run (``run_fit``).
        evaluate: ``constraint_eval.evaluate``'s signature and result (default it).
    """
    evaluate = evaluate or E.evaluate
    args = parse_args(argv)
    if args.merge:
        dirs = [Path(d) for d in args.merge.split(",") if d]
        try:
            report = merge_reports([json.loads((d / "report.json").read_text()) for d in dirs])
        except (OSError, ValueError) as e:
            raise SystemExit(f"constraint_proof: cannot merge {args.merge}: {e}") from None
        merge_command = " ".join(["python", "experiments/constraint_proof.py", *(argv or sys.argv[1:])])
        report["command"] += f" (apart), then {merge_command}"
        E.write_report(report, args.out.resolve())
        E.log(f"[proof] merged report: {args.out.resolve() / 'report.md'}")
        return report
    configs = dict(CONFIGS, **dict(item.split("=", 1) for item in args.config))
    runs = [r for r in args.runs.split(",") if r]
    unknown = [r for r in runs if r not in configs]
    if unknown:
        raise SystemExit(f"constraint_proof: unknown run(s) {unknown}; known: {sorted(configs)}")
    try:
        seeds = parse_seeds(args.seeds)
    except ValueError as e:
        raise SystemExit(f"constraint_proof: {e}") from None
    limits = [int(x) for x in args.limits.split(",")]
    rows = constraint_rows(load_prompts(args.prompts), limits)
    train, heldout = split_rows(rows, args.heldout, args.seed)
    out = args.out.resolve()
    train_file = write_jsonl(train, out / "prompts" / "train.jsonl")
    heldout_file = write_jsonl(heldout, out / "prompts" / "heldout.jsonl")
    report: dict = dict(
        prompts=str(args.prompts),
        limits=limits,
        n_train=len(train),
        n_heldout=len(heldout),
        samples_per_prompt=args.samples,
        seed=args.seed,
        threads=args.threads,
        runs={},
        command=" ".join(["python", "experiments/constraint_proof.py", *(argv or sys.argv[1:])]),
    )
    eval_args = dict(
        heldout_file=heldout_file,
        samples=args.samples,
        batch_size=args.eval_batch,
        seed=args.seed,
        threads=args.threads,
    )
    if seeds is not None:
        report["seeds"] = seeds
    for key, name, seed in run_plan(runs, seeds):
        run_dir = out / key
        overrides = args.set if seed is None else [*args.set, *(f"{k}={seed}" for k in SEED_KEYS)]
        config_path = effective_config(key, Path(configs[name]), run_dir, train_file, overrides)
        config = yaml.safe_load(config_path.read_text())
        if "before" not in report:  # every run starts from the same policy; evaluated once
            E.log("[proof] evaluating the start policy on the held-out prompts ...")
            report["before"] = evaluate(config, None, **eval_args)
        E.log(f"[proof] training {key} ({config_path}) ...")
        wall = fit(config_path, args.threads, run_dir / "fit.log")
        E.log(f"[proof] {key}: fit took {wall / 60:.1f} min; evaluating ...")
        after = evaluate(config, run_dir / "hf", **eval_args)
        report["runs"][key] = E.run_summary(config, run_dir, wall, report["before"], after)
        if seed is not None:
            report["runs"][key]["seed"] = seed
            report["methods"] = E.method_summaries(report)
        E.write_report(report, out)  # after every run, so a finished run is never lost
    E.log(f"[proof] report: {out / 'report.md'}")
    return report


if __name__ == "__main__":
    main()
