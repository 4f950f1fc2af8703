#!/usr/bin/env bash
# The hyper-parameter search behind configs/reward/minilm_hh.yaml (docs/experiments/minilm_reward.md), one full run per
# variant on the recipe's data (6,168 training pairs, the fixed 1,200 validation pairs), one after another
# (never two at once on the 2-core machine). Each run writes checkpoints/search/<name>/{hf/eval_results.json,
# run.json (wall time, load average before and after), log.txt}; experiments/search_table.py prints the table.
#   bash experiments/minilm_search.sh            # every variant not run yet
#   bash experiments/minilm_search.sh lr2e-4     # just these
# Overrides are relative to the recipe config (which holds the chosen values).
set -u
cd "$(dirname "$0")/.."
CONFIG=configs/reward/minilm_hh.yaml
declare -A VARIANTS=(
  [lr5e-5]="--model.init_args.optimizer.lr=5e-5"
  [lr5e-5_ep2]="--model.init_args.optimizer.lr=5e-5 --trainer.max_epochs=2"
  [lr1e-4]="--model.init_args.optimizer.lr=1e-4"
  [lr2e-4]="--model.init_args.optimizer.lr=2e-4"
  [lr1e-4_p64]="--model.init_args.optimizer.lr=1e-4 --data.init_args.max_prompt_length=64"
  [lr1e-4_ls]="--model.init_args.optimizer.lr=1e-4 --model.init_args.label_smoothing=0.1"
  [lr1e-4_first]="--model.init_args.optimizer.lr=1e-4 --model.init_args.pooling=first"
)
ORDER=(lr5e-5 lr1e-4 lr5e-5_ep2 lr1e-4_p64 lr2e-4 lr1e-4_ls lr1e-4_first)
names=("$@")
[ ${#names[@]} -eq 0 ] && names=("${ORDER[@]}")
for name in "${names[@]}"; do
  out=checkpoints/search/$name
  [ -f "$out/run.json" ] && continue
  mkdir -p "$out"
  start=$(date +%s); load0=$(cut -d' ' -f1-3 /proc/loadavg)
  rm -f "$out/load.txt"
  ( while true; do cut -d' ' -f1 /proc/loadavg >> "$out/load.txt"; sleep 30; done ) &  # the load DURING the run
  sampler=$!
  # shellcheck disable=SC2086
  rlhf-lit fit --config $CONFIG ${VARIANTS[$name]} --trainer.default_root_dir="$out" \
    --trainer.logger.init_args.save_dir="$out" --model.init_args.export_dir="$out/hf" > "$out/log.txt" 2>&1
  rc=$?
  kill "$sampler"
  end=$(date +%s); load1=$(cut -d' ' -f1-3 /proc/loadavg)
  mean_max=$(awk '{s += $1; if ($1 > m) m = $1} END {printf "%.2f %.2f", s / NR, m}' "$out/load.txt")
  printf '{"name": "%s", "rc": %d, "wall_s": %d, "load_start": "%s", "load_end": "%s", "load_mean_max": "%s", "args": "%s"}\n' \
    "$name" "$rc" $((end - start)) "$load0" "$load1" "$mean_max" "${VARIANTS[$name]}" | tee "$out/run.json"
done
