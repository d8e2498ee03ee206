#!/usr/bin/env bash
# The co-evolution study (PREDICTION.md, README.md): `static` against `complementary` from one warm-started
# extractor, same actor and settings. Each cell: `crl-bench run` with the arm's preset and warm start, its
# final evaluation on `eval` in every mode (free, guided, shuffled, empty and the memory forms raw, both),
# then, on the diagnostics, the same modes on `eval_unseen` from the run's final checkpoint and bank; the
# checkpoint is removed afterwards (the bank stays, not committed). A cell is finished when its line is in
# ARM/wall.tsv; finished cells are skipped. A diagnostic's unfinished cell starts over (a cell is minutes);
# the `cpu-room` arm's cells (hours) run through `crl-bench sweep`, which resumes an interrupted cell from
# its last checkpoint. So the script resumes where it stopped.
# wall.tsv: cell, run seconds (training with its evaluations), eval_unseen seconds (- without that split),
# nproc, bf16 or not; for a `cpu-room` cell also `whole` or `resumed` (a resumed cell's seconds are only
# those of the invocation that finished it; its steps' own times are in its metrics.jsonl).
# Usage (from the repository root): ARM=vault-step10 [SEEDS="0 1 2 3 4"] [METHODS="static complementary"] \
#   bash results/coevolution/run.sh
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
cd "$here/../.."
bin="${CRL_BENCH:-.venv/bin/crl-bench}"
arm="${ARM:?set ARM: vault-step10, vault-step12, diag-corridor or cpu-room}"
unseen=yes
case "$arm" in
  vault-step10) preset=diag; mix=diag-vault; ckpt=results/runs/warm-start-vault-early/step-10
                build=results/warm-start/run-early.sh; seeds="0 1 2 3 4" ;;
  vault-step12) preset=diag; mix=diag-vault; ckpt=results/runs/warm-start-vault-mid/step-12
                build=results/warm-start/run-mid.sh; seeds="0 1 2 3 4" ;;
  diag-corridor) preset=diag; mix=diag-corridor; ckpt=results/runs/warm-start-corridor/step-14
                 build=results/warm-start/run-corridor.sh; seeds="0 1 2" ;;
  cpu-room) preset=cpu; mix=minihack-room; ckpt=results/runs/warm-start-room
            build=results/warm-start/run-room.sh; seeds="0 1"; unseen=no ;;
  *) echo "run.sh: unknown ARM $arm (vault-step10, vault-step12, diag-corridor, cpu-room)" >&2; exit 2 ;;
esac
if [ ! -f "$ckpt/config.json" ]; then
  echo "run.sh: the warm start $ckpt is missing; build it first: bash $build" >&2; exit 2
fi
out="results/coevolution/$arm"
mkdir -p "$out/runs"
controls=eval.controls=shuffled,empty,raw,both
bf16=$(grep -qwE 'avx512_bf16|amx_bf16' /proc/cpuinfo && echo bf16 || echo no-bf16)
for seed in ${SEEDS:-$seeds}; do
  for method in ${METHODS:-static complementary}; do
    id="$method-s$seed"
    run="$out/runs/$id"
    grep -q "^$id"$'\t' "$out/wall.tsv" 2>/dev/null && continue
    t0=$(date +%s)
    if [ "$unseen" = yes ]; then
      rm -rf "$run"
      "$bin" run --method "$method" --preset "$preset" --mix "$mix" --seed "$seed" --extractor-model "$ckpt" \
        --set "$controls" --output-dir "$out/runs" --run-id "$id" --quiet
      t1=$(date +%s)
      "$bin" eval --run "$run" --split eval_unseen --episodes all --quiet > /dev/null
      t2=$(date +%s)
      unseen_s=$((t2 - t1))
    else
      [ -d "$run" ] && part=resumed || part=whole
      "$bin" sweep --methods "$method" --seeds "$seed" --preset "$preset" --mix "$mix" --extractor-model "$ckpt" \
        --set "$controls" --output-dir results/coevolution --name "$arm"
      t1=$(date +%s)
      unseen_s=-
    fi
    rm -rf "$run/checkpoint" "$run/checkpoints"
    printf '%s\t%s\t%s\t%s\t%s%s\n' "$id" "$((t1 - t0))" "$unseen_s" "$(nproc)" "$bf16" \
      "$([ "$unseen" = yes ] || printf '\t%s' "$part")" >> "$out/wall.tsv"
  done
done
"$bin" leaderboard "$out/runs" --out "$out"
