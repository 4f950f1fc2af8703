"""``--vs-trl --workload grpo``: TRL's ``GRPOTrainer`` and rlhf_lit's GRPO alternately (TRL, ours, TRL, ours,
...), each repetition a fresh process (``bench/run.py --_child grpo_trl`` / ``--_child grpo``), then the ratios.

Prints one JSON line per system in the TRL harness's format, one ``comparison`` line (ratios of the medians
and the median of the per-pair ratios; targets: iteration wall time <= 0.6, peak RSS <= 0.8; side by side the
phase times, the RSS before training, the mean reward, the first minibatch's max |ratio - 1| (must be 0 on
both sides) and the first iteration's KL to the reference), and a Markdown table on stderr.

``--grpo-model smollm2`` runs the same workload on SmolLM2-135M-Instruct (ratio names ``grpo_smollm2_*``; targets:
iteration wall time <= 0.5, peak RSS <= 0.7). ``--grpo-backends hf,static`` adds our run with
``sampling.backend: static`` after ours with the default ``hf`` in every repetition (TRL, ours, ours[static],
...), and ``bf16copy`` one sampling from a bf16 copy of the policy (``sampling.copy_dtype: bfloat16``); the
``sampling`` entry compares the sampling tokens/s of the backends (target: best >= 1.5x hf).
"""

from __future__ import annotations

import datetime
import hashlib
import os
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
    "gen_tokens_per_s",
    "gen_tokens_per_iter",
    "response_len_mean",
    "experience_s_per_iter",
    "update_s_per_iter",
    "rss_before_train_mb",
    "setup_s",
    "reward_mean",
    "first_step_ratio_max_dev",
    "kl_ref_iter1",
)
# bf16copy: hf on a bf16 copy (sampling.copy_dtype); vllm: the engine behind rlhf-lit vllm-serve, which the run
# starts in $RLHF_LIT_VLLM_PYTHON (its processes' peaks count in the run's peak RSS); colocated: the engine in the
# training process (sampling.vllm.mode: colocated), the whole run in $RLHF_LIT_VLLM_PYTHON (the project installed
# there, with vLLM's transformers)
BACKENDS = ("hf", "static", "bf16copy", "vllm", "colocated")
SAMPLING_TARGET = 1.5  # sampling tokens/s of the best backend / hf's


def our_systems(backends_arg: str) -> list[tuple[str, str]]:
    """``(system, child kind)`` per ``--grpo-backends`` entry, once each, in the order given: ``hf`` is
    ``rlhf_lit`` (child ``grpo``), another backend ``rlhf_lit[<backend>]`` (child ``grpo-<backend>``).

    Raises:
        ValueError: naming the argument, if a backend is unknown or ``hf`` (the headline, the module's default)
            is missing."""
    backends = [b.strip() for b in backends_arg.split(",") if b.strip()]
    if "hf" not in backends or set(backends) - set(BACKENDS):
        raise ValueError(f"--grpo-backends {backends_arg!r}: comma-separated, from {list(BACKENDS)}, including hf")
    return [(SYSTEM, "grpo") if b == "hf" else (f"{SYSTEM}[{b}]", f"grpo-{b}") for b in dict.fromkeys(backends)]


def sampling_entry(lines: dict, systems: list[str]) -> dict:
    """Sampling tokens/s (rows x decoding steps / sampling seconds, medians) of each system, and the best of
    our backends over ``hf``'s."""
    tps = {s: _median(lines[s], "gen_tokens_per_s") for s in ["trl", *systems]}
    ours = {s: v for s, v in tps.items() if s != "trl" and v}
    best = max(ours, key=ours.get) if ours else None
    ratio = ours[best] / ours[SYSTEM] if best and ours.get(SYSTEM) else None
    return dict(
        tokens_per_s=tps,
        best=best,
        best_vs_hf=ratio,
        target=f">= {SAMPLING_TARGET}",
        met=ratio is not None and ratio >= SAMPLING_TARGET,
    )


def comparison(lines: dict, runs: dict, args, fingerprint: dict, systems: list[str] = (SYSTEM,)) -> dict:
    p = "grpo" if args.grpo_model == "tiny" else f"grpo_{args.grpo_model}"
    t, trun = lines["trl"], runs["trl"]
    ratios = {}
    for system in systems:
        o, orun = lines[system], runs[system]
        tag = system.removeprefix(SYSTEM)  # "" for the headline, "[static]" for a variant
        targeted = not tag  # the targets are the headline's (compare.TARGETS); "x" names no target
        wall_name, rss_name = (f"{p}_iter_wall_s", f"{p}_peak_rss_mb") if targeted else ("x", "x")
        ratios[f"{p}_iter_wall_s{tag}"] = ratio_entry(wall_name, o, t, orun, trun, "iter_wall_s")
        ratios[f"{p}_iter2_wall_s{tag}"] = ratio_entry("x", o, t, orun, trun, "iter2_wall_s")
        ratios[f"{p}_train_wall_s{tag}"] = ratio_entry("x", o, t, orun, trun, "wall_s")
        ratios[f"{p}_peak_rss_mb{tag}"] = ratio_entry(rss_name, o, t, orun, trun, "peak_rss_mb")
    o = lines[SYSTEM]
    side = {}
    for key in SIDE_BY_SIDE:
        side[f"{p}_{key}"] = dict(ours=_median(o, key), trl=_median(t, key))
        for system in systems[1:]:
            side[f"{p}_{key}{system.removeprefix(SYSTEM)}"] = dict(ours=_median(lines[system], key), trl=None)
    side[f"{p}_peak_minus_before_train_mb"] = dict(
        ours=o["peak_rss_mb"] - _median(o, "rss_before_train_mb"),
        trl=t["peak_rss_mb"] - _median(t, "rss_before_train_mb"),
        note="what training adds to the process after imports and model loading",
    )
    return dict(
        system=f"{SYSTEM}/trl",
        workload="comparison",
        ratios=ratios,
        side_by_side=side,
        sampling=sampling_entry(lines, list(systems)),
        artifact_sha256_16=fingerprint,
        config=dict(
            model=args.grpo_model,
            repeats=args.repeats,
            threads=args.threads,
            iterations=args.ppo_iterations,
            order="alternating: TRL, rlhf_lit, " + "".join(f"{s}, " for s in systems[1:]) + "TRL, ...",
            command=" ".join(["python", "bench/run.py", *sys.argv[1:]]),
            machine=dict(cpu=cpu_model()),
            date=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        ),
    )


def _median(line: dict, key: str):
    entry = line["metrics"].get(key)
    return entry["median"] if entry else None


def model_config(model: str) -> dict | None:
    """``config.model`` / ``config.tokenizer`` of the result lines for a model other than the shared tiny one
    (whose fields ``workload_config`` already writes): the folder, its weights' SHA-256 (first 16 hex digits)."""
    if model == "tiny":
        return None
    from bench.common import show_path
    from bench.grpo_workload import MODELS, model_dir

    digest = hashlib.sha256()
    with open(model_dir(model) / "model.safetensors", "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            digest.update(block)
    return dict(
        model=dict(name=model, description=MODELS[model]["description"], base_path=show_path(model_dir(model)),
                   safetensors_sha256_16=digest.hexdigest()[:16]),
        tokenizer=dict(path=show_path(model_dir(model)), chat_template_applied=False),
    )


def main(args, fingerprint: dict) -> None:
    ours = our_systems(args.grpo_backends)
    ensure_trl()
    extra = model_config(args.grpo_model)
    runs: dict = {system: [] for system in ["trl", *(s for s, _ in ours)]}
    for rep in range(args.repeats):
        for system, child in [("trl", "grpo_trl"), *ours]:
            log(f"[bench] {system} grpo[{args.grpo_model}] run {rep + 1}/{args.repeats} ...")
            python = os.environ.get("RLHF_LIT_VLLM_PYTHON") if child == "grpo-colocated" else None
            if child == "grpo-colocated" and not python:
                raise SystemExit("--grpo-backends ...,colocated needs RLHF_LIT_VLLM_PYTHON (the vLLM environment's "
                                 "python, with this project installed there)")
            runs[system].append(run_child(child, rep, args, python=python))
            log_run(system, runs[system][-1])
            log(f"[bench]   {system}: iter_wall={runs[system][-1]['metrics']['iter_wall_s']:.2f}s "
                f"gen_tokens_per_s={runs[system][-1]['metrics']['gen_tokens_per_s']:.1f}")
    trl_config = workload_config("grpo", fingerprint, args, runs["trl"][0]["details"], TRAINERS["grpo_trl"])
    lines = {"trl": result_line("trl", "grpo", runs["trl"], trl_config)}
    for system, _ in ours:
        lines[system] = ours_line("grpo", runs[system], args, fingerprint)
        lines[system]["variant"] = system
    for line in lines.values():
        line["config"].update(extra or {})
        print_line(line, args.out)
    cmp = comparison(lines, runs, args, fingerprint, [s for s, _ in ours])
    cmp["config"].update(extra or {})
    print_line(cmp, args.out)
    log("\n" + markdown(cmp) + "\n" + sampling_markdown(cmp["sampling"]))


def sampling_markdown(entry: dict) -> str:
    rows = ", ".join(f"{s} {v:,.1f}" if v else f"{s} –" for s, v in entry["tokens_per_s"].items())
    ratio = entry["best_vs_hf"]
    return (f"sampling tokens/s: {rows}; best of ours ({entry['best']}) / hf = "
            f"{ratio:.3f} (target {entry['target']}: {'met' if entry['met'] else 'NOT met'})" if ratio else
            f"sampling tokens/s: {rows}")
