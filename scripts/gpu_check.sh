#!/usr/bin/env bash
# The GPU check (issue 21): on ONE CUDA GPU, from a plain checkout, with no network and NO extra wheels,
# measure for random-initialised Qwen2-shaped models of ~0.5B and ~1.5B parameters (Qwen2.5-0.5B / 1.5B
# dimensions, built in code; the offline byte tokenizer; no weights, nothing downloaded):
#   - sampling tokens/s and peak GPU memory per backend: hf (dynamic cache), static (static cache),
#     static_compiled (static cache + compiled decode; 0.5B only by default), paged (generate_batch);
#   - one PPO and one GRPO iteration end to end (PPOModule + a Lightning Trainer, no CLI), sampling with hf, then
#     (after every size's hf runs, 0.5B only by default) with sampling.backend: static: tokens/s, the phase
#     split generation / experience / update, update MFU (6 x params per token, against 989 TFLOP/s, the H100's and H200's
#     dense bf16 datasheet rate), peak GPU memory;
#   - the same PPO and GRPO iterations sampling with sampling.backend: vllm (colocated: the engine in the
#     trainer's process, 0.5B only by default) when vLLM imports, else "skipped: vllm not installed" (the lent
#     machine has no network and a vLLM wheel is far over the 64 MiB a call carries);
#   - the 4-bit NF4 base (sampling + one GRPO iteration, 0.5B) when bitsandbytes is there, else
#     "skipped: bitsandbytes not installed".
# It writes <out>/gpu_check.json and <out>/gpu_check.md (a README-ready table) and prints the table last.
# scripts/gpu_check.py does the work; its docstring defines every number.
#
# DEVICE TIME BUDGET, measured on one H100 (2026-12-06, docs/scale.md "GPU check"): with --budget-s 330 the
# command took 396 s (+~30 s for the machine to start) and measured all of 0.5B (sampling 155 s of it: the
# compiled decode's warm-up 40 s, paged 55 s) and 1.5B's sampling; 1.5B's iterations and the static iterations
# did not start. A second run, --sizes 1.5b --sampling-backends "" --compile-sizes 1.5b --nf4-sizes 1.5b
# --budget-s 170, took 193 s for 1.5B's PPO, GRPO and NF4 (the NF4 build alone 61 s). Both fit one session's
# 15 device minutes; no measurement starts after --budget-s, so a run ends at most one step past it.
#
# RUN IT on a lent GPU with the `run` tool, from the repository root (nothing under ../shared is read):
#   command:   bash scripts/gpu_check.sh --out "$OUT" 2>&1 | tee "$OUT/gpu_check.log"
#   timeout_s: 540
#   carry:     []            (or [".whl"] with the bitsandbytes wheel, below)
# then copy the table from files_at/gpu_check.md into the README (the JSON holds every reason and raw number).
#
# The GPU machine has torch (2.11.0+cu130 on 2026-12-06), lightning, transformers (5.17.0), peft and torchmetrics, and lacks bitsandbytes, datasets,
# jsonargparse, docstring-parser and gguf; this check imports none of the missing ones (the CPU dry run's
# test, tests/scripts/test_gpu_check.py, blocks them). To ALSO measure the NF4 base, carry the bitsandbytes
# wheel (~43 MB: fits the 64 MiB a call carries, alone) in a git-ignored folder:
#   echo /.whl/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
#     --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 -d .whl bitsandbytes==0.50.2
# and pass carry [".whl"]: this script installs every wheel in .whl/ (WHL_DIR overrides) into .whl/site with
# `pip install --no-index --no-deps --target` and puts it on PYTHONPATH.
#
# A dry run here with .whl/ present installs the wheel into .whl/site (~124 MB): delete .whl/site before a run
# call, or the working tree is over the 64 MiB a call carries.
#
# Usage: bash scripts/gpu_check.sh --out DIR [--sizes 0.5b,1.5b] [--sampling-backends hf,static,...]
#          [--compile-sizes 0.5b] [--nf4-sizes 0.5b] [--budget-s 360] [--dry-run]
#   --dry-run: every step on the CPU with a tiny Qwen2-shaped model (2 layers, hidden 64), about a minute;
#   tests/scripts/test_gpu_check.py runs it.
set -euo pipefail
cd "$(dirname "$0")/.."
WHL="${WHL_DIR:-.whl}"
PY="${PYTHON:-python3}"
command -v "$PY" >/dev/null || PY=python
start=$(date +%s)

export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1

if compgen -G "$WHL/*.whl" >/dev/null; then
  echo "== installing the wheels in $WHL into $WHL/site"
  "$PY" -m pip install --quiet --no-index --no-deps --no-compile --target "$WHL/site" "$WHL"/*.whl
  export PYTHONPATH="$PWD/$WHL/site:$PYTHONPATH"
fi

"$PY" - <<'PYEOF'
import importlib.util

import torch


def installed(name):
    try:
        return importlib.util.find_spec(name) is not None
    except ImportError:  # an import blocker (the dry run's test) counts as absent
        return False


have = {m: installed(m) for m in ("transformers", "lightning", "peft", "bitsandbytes")}
print(f"== torch {torch.__version__}, CUDA {torch.version.cuda}, device: "
      f"{torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'none'}; packages: {have}")
PYEOF

"$PY" scripts/gpu_check.py "$@"
echo "== gpu_check took $(( $(date +%s) - start )) s (budget: 480 s)"
