"""``--vs-trl --workload dpo``: TRL's ``DPOTrainer`` and rlhf_lit's ``DPOModule`` alternately (per repetition:
each TRL variant, then ours), each run a fresh process (``bench/run.py --_child dpo_trl_<variant>`` /
``--_child dpo``), then the ratios.

Prints one JSON line per system (TRL: one per variant, ``system: "trl"``/``"trl-full"``) in the TRL
harness's format, one ``comparison`` line per TRL variant (ratios of the medians and the median of the
per-pair ratios; targets against TRL with LoRA: median step time <= 0.7, peak RSS <= 0.6; and whether the
first-step losses agree to 1e-5 relative: both must be ln 2 with the adapter's B = 0), and Markdown tables
on stderr.
"""

from __future__ import annotations

import datetime
import math
import sys

from bench.common import SYSTEM, cpu_model, log, log_run, print_line, result_line, run_child, workload_config
from bench.compare import ensure_trl, markdown, ratio_entry

TARGETS = {"lora": {"dpo_median_step_s": 0.7, "dpo_peak_rss_mb": 0.6}}
TRAINER = {
    SYSTEM: "rlhf_lit.modules.DPOModule (LoRA, reference = adapter off) under lightning.Trainer.fit",
    "lora": "trl.DPOTrainer.train() (trl 1.16, peft LoRA: reference = adapter disabled)",
    "full": "trl.DPOTrainer.train() (trl 1.16, no peft: full fine-tuning, reference = a second model copy)",
}


def comparison(variant: str, o: dict, t: dict, orun: list, trun: list, args, fingerprint: dict) -> dict:
    ratios = {}
    for name, key in (("dpo_median_step_s", "median_step_s"), ("dpo_train_wall_s", "wall_s"),
                      ("dpo_peak_rss_mb", "peak_rss_mb")):
        entry = ratio_entry("x", o, t, orun, trun, key)
        bound = TARGETS.get(variant, {}).get(name)
        if bound is not None:
            entry["target"] = f"<= {bound}"
            entry["met"] = entry["ratio"] is not None and entry["ratio"] <= bound
        ratios[name] = entry
    losses_o = [r["metrics"]["first_step_loss"] for r in orun]
    losses_t = [r["metrics"]["first_step_loss"] for r in trun]
    agree = all(math.isclose(a, b, rel_tol=1e-5) for a in losses_o for b in losses_t)
    side = dict(
        dpo_first_step_loss=dict(ours=losses_o[0], trl=losses_t[0],
                                 note=f"ln 2 = {math.log(2):.7f}; agree to 1e-5 relative: {agree}"),
        dpo_final_step_loss=dict(ours=_median(o, "final_step_loss"), trl=_median(t, "final_step_loss")),
        dpo_first_step_s=dict(ours=_median(o, "first_step_s"), trl=_median(t, "first_step_s")),
        dpo_rss_before_train_mb=dict(ours=_median(o, "rss_before_train_mb"), trl=_median(t, "rss_before_train_mb")),
        dpo_setup_s=dict(ours=_median(o, "setup_s"), trl=_median(t, "setup_s")),
    )
    return dict(
        system=f"{SYSTEM}/trl-{variant}",
        workload="comparison",
        ratios=ratios,
        side_by_side=side,
        first_step_losses=dict(ours=losses_o, trl=losses_t, agree_rel_1e5=agree, ln2=math.log(2)),
        artifact_sha256_16=fingerprint,
        config=dict(
            repeats=args.repeats,
            threads=args.threads,
            trl_variant=variant,
            trl_trainer=TRAINER[variant],
            order="alternating per repetition: " + ", ".join(f"TRL-{v}" for v in _variants(args)) + ", rlhf_lit",
            command=" ".join(["python", "bench/run.py", *sys.argv[1:]]),
            machine=dict(cpu=cpu_model()),
            date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        ),
    )


def _median(line: dict, key: str):
    entry = line["metrics"].get(key)
    return entry["median"] if entry else None


def _variants(args) -> list[str]:
    variants = [v for v in args.dpo_trl_variants.split(",") if v]
    unknown = set(variants) - {"lora", "full"}
    if unknown:
        raise SystemExit(f"[bench] error: unknown --dpo-trl-variants {sorted(unknown)} (lora, full)")
    return variants


def main(args, fingerprint: dict) -> None:
    ensure_trl()
    variants = _variants(args)
    runs: dict = {SYSTEM: [], **{v: [] for v in variants}}
    for rep in range(args.repeats):
        for system, child in [(v, f"dpo_trl_{v}") for v in variants] + [(SYSTEM, "dpo")]:
            log(f"[bench] {system} dpo run {rep + 1}/{args.repeats} ...")
            runs[system].append(run_child(child, rep, args))
            log_run(system, runs[system][-1])
            log(f"[bench]   median_step_s={runs[system][-1]['metrics']['median_step_s']:.3f} "
                f"first_step_loss={runs[system][-1]['metrics']['first_step_loss']:.7f}")
    lines = {}
    for system in runs:
        name = SYSTEM if system == SYSTEM else ("trl" if system == "lora" else f"trl-{system}")
        config = workload_config("dpo", fingerprint, args, runs[system][0]["details"], TRAINER[system])
        lines[system] = result_line(name, "dpo", runs[system], config)
        print_line(lines[system], args.out)
    for v in variants:
        cmp = comparison(v, lines[SYSTEM], lines[v], runs[SYSTEM], runs[v], args, fingerprint)
        print_line(cmp, args.out)
        log(f"\n### rlhf_lit vs TRL ({v})\n" + markdown(cmp))
