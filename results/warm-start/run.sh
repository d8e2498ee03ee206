#!/usr/bin/env bash
# The extractor's warm start on diag-vault, graded as it trains (issue 60, item 2): the default 135M model
# fine-tuned on a scripted teacher's replies to episodes of 64 practice worlds (invented contexts), graded
# every 10 steps on 96 episodes of 16 unused practice worlds (validation: what picks a checkpoint) and on
# 96 episodes of diag-vault's own contexts (held-out: reported, never used to pick).
# Run from the repository root: bash results/warm-start/run.sh
# The models of every grading point go to results/runs/warm-start-vault/step-N (not committed: about 0.5 GB
# each; rerun this script to rebuild them: same seed, same examples); the record is copied here.
set -euo pipefail
out=results/runs/warm-start-vault
.venv/bin/crl-bench extractor sft --mix diag-vault --preset diag --out "$out" --examples 2048 --worlds 64 \
  --steps 80 --batch-size 16 --lr 5e-5 --heldout 96 --grade-every 10 --save-graded --seed 0 --force
cp "$out/warm_start.json" results/warm-start/vault.json
