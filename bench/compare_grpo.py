"""``--vs-trl --workload grpo``: TRL's ``GRPOTrainer`` and rlhf_lit's GRPO alternately (TRL, ours, TRL, ours,
...), each repetition a fresh process (``bench/run.py --_child grpo_trl`` / ``--_child grpo``), then the ratios.

Prints one JSON line per system in the TRL harness's format, one ``comparison`` line (ratios of the medians
and the median of the per-pair ratios; targets: iteration wall time <= 0.6, peak RSS <= 0.8; side by side the
phase times, the RSS before training, the mean reward, the first minibatch's max |ratio - 1| (must be 0 on
both sides) and the first iteration's KL to the reference), and a Markdown table on stderr.
"""

from __future__ import annotations

import datetime
import sys

from bench.common import (
    SYSTEM,
    TRAINERS,
    cpu_model,
    log,
    log_run,
    ours_line,
    print_line,
    result_line,
    run_child,
    workload_config,
)
from bench.compare import ensure_trl, markdown, ratio_entry

SIDE_BY_SIDE = (
    "gen_s_per_iter",
    "experience_s_per_iter",
    "update_s_per_iter",
    "rss_before_train_mb",
    "setup_s",
    "reward_mean",
    "first_step_ratio_max_dev",
    "kl_ref_iter1",
)


def comparison(lines: dict, runs: dict, args, fingerprint: dict) -> dict:
    o, t, orun, trun = lines[SYSTEM], lines["trl"], runs[SYSTEM], runs["trl"]
    ratios = dict(
        grpo_iter_wall_s=ratio_entry("grpo_iter_wall_s", o, t, orun, trun, "iter_wall_s"),
        grpo_iter2_wall_s=ratio_entry("x", o, t, orun, trun, "iter2_wall_s"),
        grpo_train_wall_s=ratio_entry("x", o, t, orun, trun, "wall_s"),
        grpo_peak_rss_mb=ratio_entry("grpo_peak_rss_mb", o, t, orun, trun, "peak_rss_mb"),
    )
    side = {f"grpo_{key}": dict(ours=_median(o, key), trl=_median(t, key)) for key in SIDE_BY_SIDE}
    side["grpo_peak_minus_before_train_mb"] = dict(
        ours=o["peak_rss_mb"] - _median(o, "rss_before_train_mb"),
        trl=t["peak_rss_mb"] - _median(t, "rss_before_train_mb"),
        note="what training adds to the process after imports and model loading",
    )
    return dict(
        system=f"{SYSTEM}/trl",
        workload="comparison",
        ratios=ratios,
        side_by_side=side,
        artifact_sha256_16=fingerprint,
        config=dict(
            repeats=args.repeats,
            threads=args.threads,
            iterations=args.ppo_iterations,
            order="alternating: TRL, rlhf_lit, TRL, rlhf_lit, ...",
            command=" ".join(["python", "bench/run.py", *sys.argv[1:]]),
            machine=dict(cpu=cpu_model()),
            date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        ),
    )


def _median(line: dict, key: str):
    entry = line["metrics"].get(key)
    return entry["median"] if entry else None


def main(args, fingerprint: dict) -> None:
    ensure_trl()
    runs: dict = {SYSTEM: [], "trl": []}
    for rep in range(args.repeats):
        for system, child in (("trl", "grpo_trl"), (SYSTEM, "grpo")):
            log(f"[bench] {system} grpo run {rep + 1}/{args.repeats} ...")
            runs[system].append(run_child(child, rep, args))
            log_run(system, runs[system][-1])
    trl_config = workload_config("grpo", fingerprint, args, runs["trl"][0]["details"], TRAINERS["grpo_trl"])
    lines = {
        "trl": result_line("trl", "grpo", runs["trl"], trl_config),
        SYSTEM: ours_line("grpo", runs[SYSTEM], args, fingerprint),
    }
    print_line(lines["trl"], args.out)
    print_line(lines[SYSTEM], args.out)
    cmp = comparison(lines, runs, args, fingerprint)
    print_line(cmp, args.out)
    log("\n" + markdown(cmp))
