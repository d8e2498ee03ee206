#!/usr/bin/env bash
# The diag-vault sweep (docs/diagnostics.md "Results"): each method x seed with the diag preset, its
# final evaluation on `eval` in every mode (free, guided, shuffled, empty), then the same modes on
# `eval_unseen` from the run's final checkpoint and bank, then (TRIALS > 1) every mode on `eval` again
# with eval.trials = TRIALS (Reflexion's protocol: an unsolved task gets another attempt, up to TRIALS;
# a row of its own protocol, checkpoint-eval-trials<N>-split.json); the checkpoint is removed afterwards.
# A run is finished when its line is in wall.tsv; finished runs are skipped, so the script resumes where
# it stopped. Wall seconds per phase go to wall.tsv: run, train (with its evaluations), eval_unseen,
# nproc, bf16 units or not, trials evaluation ("-" without one).
# SET="KEY=VALUE ..." trains every run of this call with those settings (`crl-bench run --set`) and
# SUFFIX names them: the run id is <method><SUFFIX>-s<seed>, e.g. SET=experience.rerank=utility
# SUFFIX=-utility gives casebank-utility-s0.
# Usage: [SEEDS="0 1 2"] [METHODS="..."] [TRIALS=3] [SET="..." SUFFIX=...] run.sh
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
cd "$here/../../.."
bin="${CRL_BENCH:-crl-bench}"
trials_n="${TRIALS:-3}"
sets=()
for kv in ${SET:-}; do sets+=(--set "$kv"); done
if [ ${#sets[@]} -gt 0 ] && [ -z "${SUFFIX:-}" ]; then
  echo "run.sh: SET needs a SUFFIX, so these runs are not taken for the plain method's" >&2; exit 2
fi
bf16=$(grep -qwE 'avx512_bf16|amx_bf16' /proc/cpuinfo && echo bf16 || echo no-bf16)
for seed in ${SEEDS:-0 1 2}; do
  for method in ${METHODS:-grpo static complementary casebank expel reflexion}; do
    id="$method${SUFFIX:-}-s$seed"
    run="$here/runs/$id"
    grep -q "^$id"$'\t' "$here/wall.tsv" 2>/dev/null && continue
    rm -rf "$run"                         # an unfinished run starts over (the preset keeps no checkpoints)
    t0=$(date +%s)
    # relative to the project root, so config.yaml names no folder of this machine
    "$bin" run --method "$method" --preset diag --seed "$seed" --output-dir results/sweeps/diag-vault/runs \
      --run-id "$id" ${sets[@]+"${sets[@]}"} --quiet
    t1=$(date +%s)
    "$bin" eval --run "results/sweeps/diag-vault/runs/$id" --split eval_unseen --episodes all --quiet > /dev/null
    t2=$(date +%s)
    trials=-
    if [ "$trials_n" -gt 1 ]; then
      "$bin" eval --run "results/sweeps/diag-vault/runs/$id" --split eval --episodes all --set "eval.trials=$trials_n" \
        --out "$run/checkpoint-eval-trials$trials_n-split.json" --quiet > /dev/null
      trials=$(($(date +%s) - t2))
    fi
    rm -rf "$run/checkpoint"
    printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$id" "$((t1 - t0))" "$((t2 - t1))" "$(nproc)" "$bf16" "$trials" \
      >> "$here/wall.tsv"
  done
done
"$bin" leaderboard "$here/runs" --out "$here"
