#!/usr/bin/env bash
# The diag-vault sweep (docs/diagnostics.md "Results"): each method x seed with the diag preset, its
# final evaluation on `eval` in every mode (free, guided, shuffled, empty), then the same modes on
# `eval_unseen` from the run's final checkpoint and bank; the checkpoint is removed afterwards.
# Finished runs are skipped, so the script resumes where it stopped. Wall seconds per phase go to
# wall.tsv (with the CPU's flags: bf16 units or not). Usage: [SEEDS="0 1 2"] [METHODS="..."] run.sh
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
cd "$here/../../.."
bin="${CRL_BENCH:-crl-bench}"
bf16=$(grep -qwE 'avx512_bf16|amx_bf16' /proc/cpuinfo && echo bf16 || echo no-bf16)
for seed in ${SEEDS:-0 1 2}; do
  for method in ${METHODS:-grpo static complementary}; do
    id="$method-s$seed"
    run="$here/runs/$id"
    [ -f "$run/checkpoint-eval_unseen-split.json" ] && continue
    rm -rf "$run"                         # an unfinished run starts over (the preset keeps no checkpoints)
    t0=$(date +%s)
    # relative to the project root, so config.yaml names no folder of this machine
    "$bin" run --method "$method" --preset diag --seed "$seed" --output-dir results/sweeps/diag-vault/runs \
      --run-id "$id" --quiet
    t1=$(date +%s)
    "$bin" eval --run "results/sweeps/diag-vault/runs/$id" --split eval_unseen --episodes all --quiet > /dev/null
    t2=$(date +%s)
    rm -rf "$run/checkpoint"
    printf '%s\t%s\t%s\t%s\t%s\n' "$id" "$((t1 - t0))" "$((t2 - t1))" "$(nproc)" "$bf16" >> "$here/wall.tsv"
  done
done
"$bin" leaderboard "$here/runs" --out "$here"
