#!/usr/bin/env bash
# The cpu preset's layout comparison (README.md of this folder): GRPO with `multiturn` prompts and one
# training sequence per episode against `window` prompts trained per turn, seeds 0 and 1, cells
# interleaved so each seed's pair finishes together. `crl-bench sweep` skips finished cells and resumes
# an interrupted one from its last checkpoint (the cpu preset checkpoints every 2 steps), so the script
# resumes where it stopped. The multiturn cells' prefix store holds the 200 live evaluation episodes'
# caches (PREDICTION.md, "Addendum").
# Usage: results/sweeps/cpu-layout/run.sh   (from anywhere; runs from the project root)
set -euo pipefail
cd "$(cd "$(dirname "$0")" && pwd)/../../.."
bin="${CRL_BENCH:-crl-bench}"
common=(sweep --methods grpo --preset cpu --mix minihack-room --output-dir results/sweeps/cpu-layout)
for seeds in 0 0,1; do
  "$bin" "${common[@]}" --seeds "$seeds" --name multiturn --set rollout.prompt=multiturn \
    --set train.sequences=episode --set generation.cache_mb=8192
  "$bin" "${common[@]}" --seeds "$seeds" --name window --set train.sequences=turn
done
