#!/usr/bin/env bash
# The extractor's warm start on minihack-room for arm 4 of the co-evolution study
# (results/coevolution/PREDICTION.md, PREDICTION-cpu-room.md): the default 135M model fine-tuned on the room
# teacher's replies (the stairs' direction from a success, what a failed episode did) to 2,048 episodes of
# `train` rooms, in the `cpu` preset's extractor format, batch 16, lr 5e-5, 8 warm-up steps, 40 steps, seed 0;
# graded every 10 steps on 96 validation and 96 held-out episodes of other `train` rooms (the room teacher has
# no judge of a lesson's correctness, so a grade is the agreement with the teacher and the share of valid
# replies). PREDICTION.md fixed the checkpoint before any run: the model after step 40, written to the --out
# folder itself. Run from the repository root: bash results/warm-start/run-room.sh
# The model is not committed (about 0.5 GB; rerun this script to rebuild it); the record is copied here.
set -euo pipefail
out=results/runs/warm-start-room
.venv/bin/crl-bench extractor sft --mix minihack-room --preset cpu --out "$out" --examples 2048 --steps 40 \
  --batch-size 16 --lr 5e-5 --warmup-steps 8 --heldout 96 --grade-every 10 --seed 0 --force
cp "$out/warm_start.json" results/warm-start/room.json
