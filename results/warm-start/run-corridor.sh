#!/usr/bin/env bash
# The extractor's warm start on diag-corridor for arm 3 of the co-evolution study
# (results/coevolution/PREDICTION.md, PREDICTION-diag-corridor.md): run.sh's settings (the default 135M
# model, 2,048 teacher examples over 64 practice worlds, batch 16, lr 5e-5, 8 warm-up steps, seed 0, 96
# validation and 96 held-out episodes), graded every 2 steps to step 20. The validation set (unused practice
# worlds) picks the checkpoint; the held-out set (diag-corridor's own contexts) is reported, never used to pick.
# Run from the repository root: bash results/warm-start/run-corridor.sh
# The models of every grading point go to results/runs/warm-start-corridor/step-N (not committed: about
# 0.5 GB each; rerun this script to rebuild them); the record is copied here.
set -euo pipefail
out=results/runs/warm-start-corridor
.venv/bin/crl-bench extractor sft --mix diag-corridor --preset diag --out "$out" --examples 2048 --worlds 64 \
  --steps 20 --batch-size 16 --lr 5e-5 --warmup-steps 8 --heldout 96 --grade-every 2 --save-graded --seed 0 \
  --force
cp "$out/warm_start.json" results/warm-start/corridor.json
