#!/usr/bin/env bash
# The first 10 steps of results/warm-start/run.sh again (same seed, examples, order and 8 warm-up steps),
# graded every 2 steps: run.sh's first grading after step 0 (step 10) already found 0.43 correct lessons on
# the validation set, past the 0.25 the co-evolution study wants a checkpoint at, so this run finds where
# the 0.25 is crossed.
# Run from the repository root, after run.sh: bash results/warm-start/run-early.sh
set -euo pipefail
out=results/runs/warm-start-vault-early
.venv/bin/crl-bench extractor sft --mix diag-vault --preset diag --out "$out" --examples 2048 --worlds 64 \
  --steps 10 --batch-size 16 --lr 5e-5 --warmup-steps 8 --heldout 96 --grade-at 2,4,6,8 --save-graded --seed 0 --force
cp "$out/warm_start.json" results/warm-start/vault-early.json
