#!/usr/bin/env bash
# The cpu-methods sweep (PREDICTION.md beside this file): casebank, reflexion and expel on the `cpu`
# preset, each cell's final evaluation in every mode (free, guided, shuffled, empty), then a second
# evaluation of each finished cell on the same eval tasks (the preset's 200) with eval.trials = TRIALS
# (Reflexion's protocol: an unsolved task gets another attempt, up to TRIALS; rows of their own
# protocol, checkpoint-eval-trials<N>-split.json). The trials evaluation runs every mode for
# `reflexion` (its memory between attempts needs the controls) and `free` and `guided` for the
# others, whose attempts share no memory (each costs about three one-attempt evaluations on 2 cores).
# Cells run one at a time, seeds outer and methods inner, and each finished cell gets its trials
# evaluation before the next cell starts, so a session's stop leaves whole cells. `crl-bench sweep`
# skips finished cells and resumes an interrupted one from its last checkpoint; a cell with its
# trials file is skipped, and an interrupted trials evaluation goes on from its first unfinished mode
# (`crl-bench eval` keeps finished modes in <file>.partial), so the script resumes where it stopped.
# A finished cell without its final checkpoint/ (it stays on the machine that trained it; results/
# never holds it) cannot get its trials evaluation: the script says so and goes on. Wall seconds of
# each trials evaluation go to the sweep's wall.tsv (cell, seconds, modes, nproc, bf16 units or not).
# SET="KEY=VALUE ..." trains every cell of this call with those settings (`crl-bench sweep --set`) in
# the sweep folder NAME, which must then differ from cpu-methods, e.g. SET=experience.rerank=utility
# NAME=cpu-methods-utility.
# Usage: [SEEDS=0,1] [METHODS=casebank,reflexion,expel] [TRIALS=3] [SET="..." NAME=...] run.sh
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
cd "$here/../../.."
bin="${CRL_BENCH:-crl-bench}"
trials_n="${TRIALS:-3}"
name="${NAME:-cpu-methods}"
sweep="results/sweeps/$name"    # relative to the project root, so the results name no folder of this machine
sets=()
for kv in ${SET:-}; do sets+=(--set "$kv"); done
if [ ${#sets[@]} -gt 0 ] && [ "$name" = cpu-methods ]; then
  echo "run.sh: SET needs NAME (another sweep folder), so these cells are not taken for the plain ones" >&2; exit 2
fi
bf16=$(grep -qwE 'avx512_bf16|amx_bf16' /proc/cpuinfo && echo bf16 || echo no-bf16)
trials() {  # the cell's evaluation with eval.trials, unless it is unfinished or already has one
  local id="$1" run="$sweep/runs/$1" modes t0
  local out="$run/checkpoint-eval-trials$trials_n-split.json"
  [ -f "$run/summary.json" ] && [ ! -f "$out" ] || return 0
  if [ ! -d "$run/checkpoint" ]; then
    echo "run.sh: $id has no checkpoint here, so no evaluation with eval.trials=$trials_n" >&2
    return 0
  fi
  case "$id" in
    reflexion-*) modes=free,guided,shuffled,empty ;;
    *) modes=free,guided ;;
  esac
  t0=$(date +%s)
  "$bin" eval --run "$run" --split eval --set "eval.trials=$trials_n" --modes "$modes" \
    --out "$out" --quiet > /dev/null
  printf '%s\t%s\t%s\t%s\t%s\n' "$id" "$(($(date +%s) - t0))" "$modes" "$(nproc)" "$bf16" >> "$sweep/wall.tsv"
}
IFS=, read -ra seeds <<< "${SEEDS:-0,1}"
IFS=, read -ra methods <<< "${METHODS:-casebank,reflexion,expel}"
for seed in "${seeds[@]}"; do
  for method in "${methods[@]}"; do
    "$bin" sweep --methods "$method" --seeds "$seed" --preset cpu --mix minihack-room --name "$name" \
      ${sets[@]+"${sets[@]}"}
    trials "$method-s$seed"
  done
done
"$bin" leaderboard "$sweep/runs" --out "$sweep"
