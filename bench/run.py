#!/usr/bin/env python
"""rlhf_lit on the shared benchmark workload (../shared/bench), and side by side with TRL.

Run from the repository root (``../shared`` beside it); see bench/README.md:

    python bench/run.py                              # rm + ppo, 3 fresh processes each, JSON lines
    python bench/run.py --workload rm --repeats 1
    python bench/run.py --vs-trl                     # TRL, ours, TRL, ours, ... then the ratios
    python bench/run.py --workload memory            # SmolLM2-135M PPO peak RSS: ours vs TRL + peft
    python bench/run.py --vs-trl --workload grpo     # GRPO: TRL's GRPOTrainer, ours, TRL, ours, ...
    python bench/run.py --vs-trl --workload grpo --grpo-model smollm2 --grpo-backends hf,static --threads 1
    python bench/run.py --vs-trl --workload dpo      # DPO: TRL's DPOTrainer (LoRA, full), ours, ...
    python bench/run.py --vs-trl --workload grpo_loss  # GRPO first-step loss: TRL's _compute_loss vs ours

Progress goes to stderr, one JSON line per workload (the TRL harness's format, ``system: "rlhf_lit"``) to
stdout; ``--out FILE`` appends them to FILE too. Each repetition is a fresh process (``--_child``).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

# Run as a script, Python puts bench/ first on sys.path, where our module names could shadow others;
# the repository root takes its place, so the modules are imported as bench.<name>.
if sys.path and Path(sys.path[0]).resolve() == Path(__file__).resolve().parent:
    sys.path.pop(0)
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import (  # noqa: E402
    SYSTEM,
    W,
    emit_child_result,
    log,
    log_run,
    ours_line,
    print_line,
    run_child,
)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workload", choices=["rm", "ppo", "all", "memory", "grpo", "dpo", "grpo_loss"], default="all")
    p.add_argument("--repeats", type=int, default=3, help="fresh processes per workload and system")
    p.add_argument("--ppo-iterations", type=int, default=W.PPO["iterations"], choices=[1, 2, 3, 4],
                   help="PPO and GRPO iterations per run")
    p.add_argument("--dpo-trl-variants", default="lora,full",
                   help="dpo --vs-trl: TRL variants (lora = peft, reference = adapter off; full = no peft, "
                        "a second model copy as the reference)")
    p.add_argument("--grpo-model", choices=["tiny", "smollm2"], default="tiny",
                   help="grpo: the base both sides load (tiny = the shared gpt2-tiny-base; smollm2 = "
                        "SmolLM2-135M-Instruct in fp32, de-quantized from the PyPI GGUF wheel)")
    p.add_argument("--grpo-backends", default="hf",
                   help="grpo --vs-trl: our sampling.backend variants, comma-separated (hf = the default; "
                        "static = transformers' static KV cache; bf16copy = hf on a bf16 copy of the policy)")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch.set_num_threads in each run")
    p.add_argument("--vs-trl", action="store_true",
                   help="alternate TRL and rlhf_lit runs (TRL, ours, TRL, ours, ...) and print the ratios")
    p.add_argument("--memory-variants", default="same,micro1,ckpt",
                   help="memory workload: our variants to run besides TRL (same = TRL's micro-batch; micro1 = "
                        "ppo.micro_batch_size 1; ckpt = gradient checkpointing)")
    p.add_argument("--out", type=Path, default=None, help="also append the JSON lines to this file")
    p.add_argument("--_child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if not args._child:
        from bench.compare_grpo import our_systems

        try:
            our_systems(args.grpo_backends)
        except ValueError as e:
            print(f"rlhf-lit: error: {e}", file=sys.stderr)
            raise SystemExit(2) from None
    return args


def run_in_child(args) -> None:
    """Entry point of a measured process: run one repetition, print its BENCH_RESULT line."""
    kind = args._child
    if kind == "rm":
        from bench.rm import child_rm

        emit_child_result(child_rm(args.threads))
    elif kind == "ppo":
        from bench.ppo import child_ppo

        emit_child_result(child_ppo(args.threads, args.ppo_iterations))
    elif kind == "grpo_trl":
        from bench.grpo_trl import child_grpo_trl

        emit_child_result(child_grpo_trl(args.threads, args.ppo_iterations, args.grpo_model))
    elif kind == "grpo" or kind.startswith("grpo-"):  # grpo-<backend>: another sampling.backend
        from bench.grpo import child_grpo

        backend = kind.removeprefix("grpo").lstrip("-") or "hf"
        emit_child_result(child_grpo(args.threads, args.ppo_iterations, args.grpo_model, backend))
    elif kind == "grpo_loss":
        from bench.grpo_first_step import child_grpo_loss

        emit_child_result(child_grpo_loss(args.threads, args.grpo_model))
    elif kind == "dpo":
        from bench.dpo import child_dpo

        emit_child_result(child_dpo(args.threads))
    elif kind.startswith("dpo_trl_"):
        from bench.dpo_trl import child_dpo_trl

        emit_child_result(child_dpo_trl(args.threads, kind.removeprefix("dpo_trl_")))
    elif kind == "matmul":
        from bench.flops import matmul_throughput

        emit_child_result(matmul_throughput(args.threads))
    elif kind.startswith("memory"):
        from bench import memory

        emit_child_result(memory.run_child(kind, args.threads))
    else:
        raise SystemExit(f"unknown child {kind!r}")


def run_ours(workloads: list[str], args, fingerprint: dict) -> dict[str, dict]:
    lines = {}
    for wl in workloads:
        runs = []
        for rep in range(args.repeats):
            log(f"[bench] {SYSTEM} {wl} run {rep + 1}/{args.repeats} ...")
            runs.append(run_child(wl, rep, args))
            log_run(SYSTEM, runs[-1])
        lines[wl] = ours_line(wl, runs, args, fingerprint)
        print_line(lines[wl], args.out)
    return lines


def main(argv=None) -> None:
    args = parse_args(argv)
    if args._child:
        run_in_child(args)
        return
    t_all = time.perf_counter()
    log(f"[bench] data: {W.HH_FILE}")
    log(f"[bench] artefacts: {W.ARTIFACTS}")
    try:
        fingerprint = W.ensure_artifacts(log)
    except FileNotFoundError as e:
        sys.exit(f"[bench] error: {e}")
    if args.workload == "grpo" and args.grpo_model == "smollm2":
        from bench.grpo_workload import prepare_model

        prepare_model(args.grpo_model)
    if args.workload == "grpo_loss":  # with or without --vs-trl: it is a comparison with TRL either way
        from bench import grpo_first_step

        grpo_first_step.main(args, fingerprint)
    elif args.workload == "memory":
        from bench import memory

        memory.main(args)
    elif args.vs_trl and args.workload == "grpo":
        from bench import compare_grpo

        compare_grpo.main(args, fingerprint)
    elif args.vs_trl and args.workload == "dpo":
        from bench import compare_dpo

        compare_dpo.main(args, fingerprint)
    elif args.vs_trl:
        from bench import compare

        compare.main(args, fingerprint)
    else:
        run_ours(["rm", "ppo"] if args.workload == "all" else [args.workload], args, fingerprint)
    log(f"[bench] total time {time.perf_counter() - t_all:.1f}s")


if __name__ == "__main__":
    main()
