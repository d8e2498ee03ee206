#!/usr/bin/env bash
# GPU check: what this project can only show on an NVIDIA GPU, in one bounded script (under 10 minutes
# on one H100 with the default model). Run from the project root, in the environment install.sh made
# (or any Python with crl-bench and its dependencies): `bash scripts/gpu_check.sh [OUT_DIR]`
# (PYTHON, CRL_BENCH and PYTEST name the interpreter and the commands when they are not on PATH).
#
#   1. the machine: GPU, driver, torch and its CUDA, bf16 support, vLLM's version (or its absence);
#   2. with vLLM: the real-vLLM tests on CUDA (generation, masked/raw log-probs, a weight sync compared
#      with a transformers forward of the synced weights, the out-of-process engine, grpo steps over the
#      weight channel (3 GPUs) and complementary steps whose next rollout samples from the updated weights);
#   3. a paper-shaped smoke: `grpo` with the `paper` preset (multi-turn prompts, free replies, bf16,
#      logprob recomputation) on Sokoban, 2 steps of 4 groups x 8, with vLLM where it is installed;
#   4. 3 steps of `grpo` on the one-action diagnostic (`diag` preset, bf16) that take optimiser steps
#      and sync the engine after each;
#   5. a throughput line: `crl-bench bench rollout` (--engine vllm where vLLM is installed: vLLM against
#      the transformers engine on the same batch, weight sync included);
#   6. the update's memory laws on CUDA (`crl-bench bench memory --device cuda --check`: chunked against
#      full-vocabulary log-probs at Qwen2.5's vocabulary, autocast's weight-cast cache on against off under
#      checkpointing), each asserted and extrapolated to Qwen2.5-7B; the measurements in memory-laws.json;
#   7. a steady-state update of Qwen2.5-7B- and Qwen3-4B-shaped models with 1 and 2 layers (random weights),
#      its peak against what `crl-bench plan` counts, asserted, and extrapolated to all their layers
#      (`crl-bench bench update-peak --check`);
#   8. a data-parallel rank over NCCL placed on GPU 0 as `devices.actor_train` places a run's ranks
#      (`crl-bench bench dp --gpus 0`): its device, its timing against the in-process update, the weights.
#   9. on two GPUs with vLLM: a weight sync from an FSDP rank on GPU 1 into a vLLM engine on GPU 0 over
#      NCCL against one through the driver (`crl-bench bench weight-sync`), the served weights checked.
#  10. a checkpoint's bytes per trainable parameter (12, asserted) and the disk's save and resume rates on 8 GB
#      (`crl-bench bench checkpoint-io --check`; CHECKPOINT_DIR names the disk, default the project's),
#      extrapolated to the paper's 140 GB checkpoints and its run.
# Each part is bounded by `timeout`; a part that fails is reported and the rest still run. The exit
# status is the number of failed parts. Logs and the smoke's metrics go to OUT_DIR (default $OUT, else
# ./gpu-check-out).
set -uo pipefail
out=${1:-${OUT:-gpu-check-out}}
mkdir -p "$out"
out=$(cd "$out" && pwd)
cd "$(dirname "$0")/.."
py=${PYTHON:-python3}
read -r -a crl <<< "${CRL_BENCH:-crl-bench}"
failed=0
part() {   # part NAME SECONDS COMMAND...: run, log to $out/NAME.log, report status and wall time
  local name=$1 limit=$2; shift 2
  local t0; t0=$(date +%s)
  timeout "$limit" "$@" > "$out/$name.log" 2>&1
  local rc=$?
  echo "== $name: exit $rc, $(( $(date +%s) - t0 )) s"
  [ "$rc" = 0 ] || { failed=$((failed + 1)); tail -n 15 "$out/$name.log"; }
}

summarise() {   # one line per training step of a metrics.jsonl
  "$py" - "$1" <<'PY'
import json, sys
for line in open(sys.argv[1]):
    m = json.loads(line)
    if "step" in m and "tokens_per_s" in m:
        print(f"   step {m['step']}: success {m.get('success_rate', 0):.2f}, {m['tokens_per_s']:.0f} tok/s, "
              f"{m.get('time_step_s', 0):.1f} s, optimiser steps {m.get('optimizer_steps', 0):.0f}, "
              f"drift {m.get('behaviour_logprob_abs_diff', float('nan')):.2e}")
PY
}

echo "== machine"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || failed=$((failed + 1))
"$py" - <<'PY'
import torch
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, available {torch.cuda.is_available()}, "
      f"bf16 {torch.cuda.is_available() and torch.cuda.is_bf16_supported()}")
try:
    import vllm
    print(f"vllm {vllm.__version__}")
except Exception as e:  # noqa: BLE001
    print(f"vllm: not importable ({type(e).__name__}: {str(e)[:120]})")
PY
if "$py" -c "import vllm" > /dev/null 2>&1; then engine=vllm; else engine=transformers; fi
echo "== generation engine for the smoke: $engine"

if [ "$engine" = vllm ]; then
  part vllm-tests 300 env CRL_BENCH_REQUIRE_VLLM=1 "${PYTEST:-pytest}" -q -p no:cacheprovider tests/llm/test_vllm_real.py
fi

run_dir=$(mktemp -d)
# the paper preset places its roles on 8 GPUs (devices); on this one GPU everything goes back to the driver
one_gpu=(--set devices.driver=cuda --set "devices.actor_engine=[]" --set "devices.extractor_engine=[]"
         --set "devices.actor_train=[]" --set "devices.extractor_train=[]" --set train.workers=1
         --set generation.vllm_gpu_memory_utilization=0.5)
part paper-smoke 300 "${crl[@]}" run --method grpo --preset paper --mix sokoban --quiet "${one_gpu[@]}" \
  --output-dir "$run_dir" --run-id gpu-check \
  --set train.steps=2 --set train.groups_per_step=4 --set train.group_size=8 \
  --set train.save_checkpoint=false --set train.checkpoint_every=0 --set rollout.max_steps=8 \
  --set generation.max_new_tokens=128 --set eval.episodes=4 --set generation.engine=$engine
if [ -f "$run_dir/gpu-check/metrics.jsonl" ]; then
  cp "$run_dir/gpu-check/metrics.jsonl" "$out/paper-smoke-metrics.jsonl"
  summarise "$run_dir/gpu-check/metrics.jsonl"
fi
rm -rf "$run_dir"

# the paper preset's free replies (and Sokoban's smoke runs) rarely give a 135M actor a learning
# signal; the one-action diagnostic does (chance 1/8, groups of 8): its updates and weight syncs
run_dir=$(mktemp -d)
part update-smoke 240 "${crl[@]}" run --method grpo --preset diag --mix diag-vault --quiet \
  --output-dir "$run_dir" --run-id gpu-update --steps 3 \
  --set model.dtype=bfloat16 --set train.save_checkpoint=false --set train.checkpoint_every=0 \
  --set eval.episodes=8 --set eval.at_start=false --set generation.engine=$engine
if [ -f "$run_dir/gpu-update/metrics.jsonl" ]; then
  cp "$run_dir/gpu-update/metrics.jsonl" "$out/update-smoke-metrics.jsonl"
  summarise "$run_dir/gpu-update/metrics.jsonl"
fi
rm -rf "$run_dir"

if [ "$engine" = vllm ]; then
  part throughput 240 "${crl[@]}" bench rollout --engine vllm --env sokoban --envs 64 --max-steps 4 --dtype bfloat16
else
  part throughput 240 "${crl[@]}" bench rollout --env sokoban --envs 64 --max-steps 4
fi
grep -E "tok/s|ratio|^(transformers|vllm|batched|sequential)" "$out/throughput.log" || true
part memory-laws 180 "${crl[@]}" bench memory --device cuda --check --json "$out/memory-laws.json"
cat "$out/memory-laws.log"
# a steady-state update of 7B- and 4B-shaped models (1 and 2 layers, random weights) against the plan's count,
# extrapolated to all their layers
part update-peak 300 "${crl[@]}" bench update-peak --device cuda --check --json "$out/update-peak-7b.json"
part update-peak-4b 300 "${crl[@]}" bench update-peak --shape qwen3-4b --device cuda --check \
  --json "$out/update-peak-4b.json"
cat "$out/update-peak.log" "$out/update-peak-4b.log"
# a data-parallel rank over NCCL on a listed GPU: placed in a Ray placement group with Ray kept off its
# visible devices (devices.actor_train; trainer/rank_placement.py), one update against the in-process one
part dp-placed 240 "${crl[@]}" bench dp --workers 1 --gpus 0 --repeats 2 --sequential
grep -E "ranks on|workers:|weight difference" "$out/dp-placed.log" || true
# weights from FSDP ranks straight into a vLLM engine over NCCL (devices.weight_sync: direct) against through the
# driver; NCCL connects no two processes on one GPU, so the engine and rank 0 need a GPU each
gpus=$("$py" -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
if [ "$engine" = vllm ] && [ "${gpus:-0}" -ge 2 ]; then
  part weight-sync 300 "${crl[@]}" bench weight-sync --workers 1 --gpus 1 --engine-gpus 0 --dtype bfloat16
  cat "$out/weight-sync.log"
else
  echo "== weight-sync: skipped (needs vLLM and 2 GPUs; this machine has ${gpus:-0})"
fi
# a checkpoint's bytes per parameter (asserted) and this machine's disk, extrapolated to the paper's 140 GB
part checkpoint-io 180 "${crl[@]}" bench checkpoint-io --gib 8 --dir "${CHECKPOINT_DIR:-.}" --check
cat "$out/checkpoint-io.log"
echo "== failed parts: $failed"
exit "$failed"
