"""``--vs-trl``: TRL and rlhf_lit alternately on the same machine in one invocation, then the ratios.

For each workload the repetitions alternate TRL, ours, TRL, ours, ... (TRL through the shared harness,
``python ../shared/bench/trl_baseline.py --workload <wl> --repeats 1``, which runs its own fresh child). The
output is one JSON line per system and workload in the TRL harness's format, then one ``comparison`` line
with the ratios (median of ours / median of TRL, and the median of the per-pair ratios), the quality
checks (RM training loss and held-out accuracy, PPO mean score and first-iteration KL), and the RM step's
achieved FLOP/s as a fraction of this machine's fp32 matmul throughput (measured in the same run, in a
fresh process, before and after the runs; the larger is used). A Markdown table goes to stderr.
"""

from __future__ import annotations

import datetime
import json
import statistics
import subprocess
import sys

from bench.common import (
    REPO,
    SHARED_BENCH,
    SYSTEM,
    W,
    cpu_model,
    log,
    log_run,
    ours_line,
    print_line,
    result_line,
    run_child,
    run_result_process,
)

TARGETS = {"ppo_iter_wall_s": ("<=", 0.7), "rm_pairs_per_s": (">=", 1.2),
           "rm_peak_rss_mb": ("<=", 1.0), "ppo_peak_rss_mb": ("<=", 1.0),
           "grpo_iter_wall_s": ("<=", 0.6), "grpo_peak_rss_mb": ("<=", 0.8),
           "grpo_smollm2_iter_wall_s": ("<=", 0.5), "grpo_smollm2_peak_rss_mb": ("<=", 0.7)}


def ensure_trl() -> None:
    """trl 1.16 for the RM run (pip-installed if missing); trl 1.12.0 for PPO (fetched by the harness)."""
    try:
        import trl  # noqa: F401
    except ImportError:
        log("[bench] trl is not installed: pip install trl==1.16.0")
        subprocess.run([sys.executable, "-m", "pip", "install", "trl==1.16.0"], check=True)


def run_trl(workload: str, rep: int, args) -> dict:
    """One TRL repetition through the shared harness; returned as a per-run dict like ours."""
    cmd = [sys.executable, str(SHARED_BENCH / "trl_baseline.py"), "--workload", workload, "--repeats", "1",
           "--threads", str(args.threads), "--ppo-iterations", str(args.ppo_iterations)]
    logfile = W.ARTIFACTS / "logs" / f"vs_trl_trl_{workload}_run{rep}.log"
    line = run_trl_line(cmd, logfile)
    run = dict(wall_s=line["wall_s"], throughput=line["throughput"], unit=line["unit"],
               peak_rss_mb=line["peak_rss_mb"], metrics=dict(line["runs"][0]["metrics"]),
               details=dict(line["details"], per_iteration=line["runs"][0].get("per_iteration")),
               config=line["config"])
    if workload == "ppo":  # quality figures from TRL's own per-iteration logs
        logs = [entry for entry in line["details"].get("trl_logs", []) if "objective/scores" in entry]
        run["metrics"]["score_mean"] = statistics.fmean(e["objective/scores"] for e in logs) if logs else None
        run["metrics"]["kl_ref_iter1"] = logs[0].get("objective/kl") if logs else None
        run["metrics"]["approx_kl"] = statistics.fmean(e["policy/approxkl_avg"] for e in logs) if logs else None
    return run


def run_trl_line(cmd: list[str], logfile) -> dict:
    logfile.parent.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run(cmd, capture_output=True, text=True)
    logfile.write_text(proc.stdout + "\n--- stderr ---\n" + proc.stderr)
    if proc.returncode != 0:
        raise RuntimeError(f"TRL harness failed (rc={proc.returncode}); see {logfile}\n{proc.stderr[-3000:]}")
    return json.loads(next(ln for ln in reversed(proc.stdout.splitlines()) if ln.startswith("{")))


def trl_line(workload: str, runs: list[dict], args) -> dict:
    config = dict(runs[0]["config"], repeats=len(runs))
    line = result_line("trl", workload, runs, config)
    line["config"]["driver"] = "../shared/bench/trl_baseline.py --repeats 1 per repetition, alternated with rlhf_lit"
    return line


def matmul(args, tag: str) -> dict:
    cmd = [sys.executable, str(REPO / "bench" / "run.py"), "--_child", "matmul", "--threads", str(args.threads)]
    return run_result_process(cmd, W.ARTIFACTS / "logs" / f"matmul_{tag}.log", "matmul microbenchmark")


def _median(line: dict, key: str):
    if key in ("wall_s", "throughput", "peak_rss_mb"):
        return line[key]
    entry = line["metrics"].get(key)
    return entry["median"] if entry else None


def _pairwise(ours: list[dict], trl: list[dict], key: str) -> float | None:
    def value(run):
        return run[key] if key in run else run["metrics"].get(key)

    ratios = [value(o) / value(t) for o, t in zip(ours, trl) if value(o) and value(t)]
    return statistics.median(ratios) if ratios else None


def ratio_entry(name: str, ours_line: dict, trl_line_: dict, ours_runs, trl_runs, key: str) -> dict:
    o, t = _median(ours_line, key), _median(trl_line_, key)
    entry = dict(ours=o, trl=t, ratio=(o / t) if o and t else None, pairwise_median=_pairwise(ours_runs, trl_runs, key))
    if name in TARGETS:
        op, bound = TARGETS[name]
        entry["target"] = f"{op} {bound}"
        entry["met"] = entry["ratio"] is not None and (entry["ratio"] <= bound if op == "<=" else entry["ratio"] >= bound)
    return entry


def comparison(lines: dict, runs: dict, peak: dict, args) -> dict:
    ours, trl = lines[SYSTEM], lines["trl"]
    out: dict = dict(system=f"{SYSTEM}/trl", workload="comparison", ratios={}, side_by_side={})
    R, S = out["ratios"], out["side_by_side"]
    if "rm" in ours:
        o, t, orun, trun = ours["rm"], trl["rm"], runs[SYSTEM]["rm"], runs["trl"]["rm"]
        R["rm_pairs_per_s"] = ratio_entry("rm_pairs_per_s", o, t, orun, trun, "throughput")
        R["rm_median_step_pairs_per_s"] = ratio_entry("x", o, t, orun, trun, "median_step_pairs_per_s")
        R["rm_peak_rss_mb"] = ratio_entry("rm_peak_rss_mb", o, t, orun, trun, "peak_rss_mb")
        S["rm_train_loss"] = dict(ours=_median(o, "train_loss"), trl=_median(t, "train_loss"))
        S["rm_heldout_accuracy"] = dict(ours=_median(o, "val_accuracy"), trl=None,
                                        note="TRL's harness trains without evaluation; 128 held-out pairs")
        flops = orun[0]["details"]["train_flops"]  # what rlhf_lit computes (length groups)
        flops_trl = orun[0]["details"].get("train_flops_padded", flops)  # one padded forward per step
        out["rm_flops"] = dict(
            train_flops_per_run=flops, train_flops_per_run_trl=flops_trl,
            formula=orun[0]["details"]["flops_formula"],
            matmul_peak_flops=peak["peak_flops"], matmul_model_shaped_flops=peak["model_shaped_flops"],
            ours_achieved_flops=flops / o["wall_s"], trl_achieved_flops=flops_trl / t["wall_s"],
            ours_fraction_of_peak=flops / o["wall_s"] / peak["peak_flops"],
            trl_fraction_of_peak=flops_trl / t["wall_s"] / peak["peak_flops"],
            matmul_runs=peak["runs"],
        )
    if "ppo" in ours:
        o, t, orun, trun = ours["ppo"], trl["ppo"], runs[SYSTEM]["ppo"], runs["trl"]["ppo"]
        R["ppo_iter_wall_s"] = ratio_entry("ppo_iter_wall_s", o, t, orun, trun, "iter_wall_s")
        R["ppo_iter2_wall_s"] = ratio_entry("x", o, t, orun, trun, "iter2_wall_s")
        R["ppo_train_wall_s"] = ratio_entry("x", o, t, orun, trun, "wall_s")
        R["ppo_peak_rss_mb"] = ratio_entry("ppo_peak_rss_mb", o, t, orun, trun, "peak_rss_mb")
        for key in ("gen_tokens_per_s", "gen_s_per_iter", "experience_s_per_iter", "update_s_per_iter",
                    "update_samples_per_s", "score_mean", "kl_ref_iter1", "approx_kl"):
            S[f"ppo_{key}"] = dict(ours=_median(o, key), trl=_median(t, key))
        S["ppo_old_logprobs_values_s_per_iter"] = dict(ours=_median(o, "old_logprobs_values_s_per_iter"), trl=0.0,
                                                       note="extra actor(+critic) pass TRL does not run")
    out["config"] = dict(repeats=args.repeats, threads=args.threads, ppo_iterations=args.ppo_iterations,
                         order="alternating per workload: TRL, rlhf_lit, TRL, rlhf_lit, ...",
                         command=" ".join(["python", "bench/run.py", *sys.argv[1:]]),
                         machine=dict(cpu=cpu_model(), nproc=_nproc()),
                         date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"))
    return out


def _nproc() -> int:
    import os

    return os.cpu_count() or 0


def markdown(cmp: dict) -> str:
    def fmt(x):
        if x is None:
            return "–"
        if isinstance(x, bool):
            return "yes" if x else "NO"
        return f"{x:,.4g}" if isinstance(x, float) else str(x)

    rows = ["| figure | rlhf_lit | TRL | ours/TRL (pairwise median) | target |", "|---|---|---|---|---|"]
    for name, e in cmp["ratios"].items():
        target = f"{e['target']} ({'met' if e['met'] else 'NOT met'})" if "target" in e else ""
        rows.append(f"| {name} | {fmt(e['ours'])} | {fmt(e['trl'])} | {fmt(e['ratio'])} ({fmt(e['pairwise_median'])}) "
                    f"| {target} |")
    for name, e in cmp["side_by_side"].items():
        rows.append(f"| {name} | {fmt(e['ours'])} | {fmt(e['trl'])} | | {e.get('note', '')} |")
    if "rm_flops" in cmp:
        f = cmp["rm_flops"]
        rows.append(f"| rm achieved GFLOP/s (fraction of {f['matmul_peak_flops'] / 1e9:.1f} GFLOP/s matmul peak) "
                    f"| {f['ours_achieved_flops'] / 1e9:.2f} ({f['ours_fraction_of_peak']:.1%}) "
                    f"| {f['trl_achieved_flops'] / 1e9:.2f} ({f['trl_fraction_of_peak']:.1%}) | | |")
    return "\n".join(rows)


def main(args, fingerprint: dict) -> None:
    ensure_trl()
    workloads = ["rm", "ppo"] if args.workload == "all" else [args.workload]
    if "ppo" in workloads:
        from bench.common import trl_baseline

        trl_baseline().ensure_ppo_trl()
    peaks = [matmul(args, "before")]
    runs: dict = {SYSTEM: {}, "trl": {}}
    lines: dict = {SYSTEM: {}, "trl": {}}
    for wl in workloads:
        runs[SYSTEM][wl], runs["trl"][wl] = [], []
        for rep in range(args.repeats):
            log(f"[bench] trl {wl} run {rep + 1}/{args.repeats} ...")
            runs["trl"][wl].append(run_trl(wl, rep, args))
            log_run("trl", runs["trl"][wl][-1])
            log(f"[bench] {SYSTEM} {wl} run {rep + 1}/{args.repeats} ...")
            runs[SYSTEM][wl].append(run_child(wl, rep, args))
            log_run(SYSTEM, runs[SYSTEM][wl][-1])
        lines["trl"][wl] = trl_line(wl, runs["trl"][wl], args)
        lines[SYSTEM][wl] = ours_line(wl, runs[SYSTEM][wl], args, fingerprint)
        print_line(lines["trl"][wl], args.out)
        print_line(lines[SYSTEM][wl], args.out)
    peaks.append(matmul(args, "after"))
    best = max(peaks, key=lambda p: p["peak_flops"])
    peak = dict(peak_flops=best["peak_flops"], model_shaped_flops=max(p["model_shaped_flops"] for p in peaks),
                runs=[{k: v for k, v in p.items() if k != "process_s"} for p in peaks])
    cmp = comparison(lines, runs, peak, args)
    cmp["artifact_sha256_16"] = fingerprint
    print_line(cmp, args.out)
    log("\n" + markdown(cmp))
