#!/usr/bin/env bash
# The first 20 steps of results/warm-start/run.sh again (same seed, examples, order and 8 warm-up steps),
# graded at steps 12-18: run.sh graded nothing between step 10 (0.43 correct lessons on the validation set)
# and step 20 (0.81), where the 0.60 the co-evolution study wants a checkpoint at is crossed.
# Run from the repository root, after run.sh: bash results/warm-start/run-mid.sh
set -euo pipefail
out=results/runs/warm-start-vault-mid
.venv/bin/crl-bench extractor sft --mix diag-vault --preset diag --out "$out" --examples 2048 --worlds 64 \
  --steps 20 --batch-size 16 --lr 5e-5 --warmup-steps 8 --heldout 96 --grade-at 12,14,16,18 --save-graded \
  --seed 0 --force
cp "$out/warm_start.json" results/warm-start/vault-mid.json
