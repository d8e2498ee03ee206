#!/usr/bin/env bash
# The default model on ALFWorld under the verl-agent profile (GiGPO Table 1's protocol: valid_seen's 140
# games, T 0.4 sampled, 50 actions, history 2): each game 4 times, the each-task-once success rate over
# all samples, and 20 sampled-worker draws of 128 episodes (verl-agent's estimator) beside it.
# Run from the repository root: bash results/alfworld-draws/run.sh  (resumable: an interrupted evaluation
# resumes episode by episode from eval.json.episodes.jsonl; a finished one is not run again)
set -euo pipefail
export CRL_BENCH_DATA="${CRL_BENCH_DATA:-$(cd .. && pwd)/shared/data}"
out=results/alfworld-draws
if [ ! -f "$out/smollm2/eval.json" ]; then
  rm -rf "$out/smollm2"
  # 4 samples per game, not --draws' 8: a draw of 128 from 140 games picks a game 5 or more times about
  # once in three draws (those picks reuse an episode and are counted), and 560 episodes of 50 actions fit
  # two sessions of this 2-core machine where 1,120 would need four. 32 live episodes, not the cpu preset's
  # 64: ALFWorld's prompts are long, and 64 live episodes' caches took the process to 15 GB of the 24
  .venv/bin/crl-bench eval --preset cpu --mix alfworld --profile verl-agent --draws 128 --set eval.samples=4 \
    --set rollout.max_concurrent=32 --set generation.batch_size=32 \
    --out "$out/eval.json" --save-run "$out/smollm2" --quiet
fi
.venv/bin/crl-bench leaderboard "$out" --out "$out"
