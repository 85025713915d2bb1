#!/usr/bin/env bash
# #19's served goal: configs/default.yaml (EAGLE-3, float32) against HF transformers' own server,
# `transformers serve --continuous-batching` (paged attention, no speculation, float32), the same
# SmolLM2-135M-Instruct weights on the same machine, both up at once, `rayspec bench serve` taking
# turns between them at every concurrency level (greedy, 128 tokens, MT-bench prompts).
# Usage (inside .venv): benchmarks/run_vs_transformers_serve.sh [output-dir] [concurrency] [rounds]
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-benchmarks/results/vs_transformers_serve}
LEVELS=${2:-1,4,8,16}
ROUNDS=${3:-2}
PORT_RS=${PORT_RS:-8000}
PORT_HF=${PORT_HF:-8001}
mkdir -p "$OUT"
MODEL_DIR=$(python -c "from rayspec.model.loader import resolve_model_dir; print(resolve_model_dir('smollm2-135m-instruct'))")
serve shutdown -y > /dev/null 2>&1 || true
sed "s/port: 8000/port: $PORT_RS/" configs/default.yaml > "${TMPDIR:-/tmp}/rayspec_default_$PORT_RS.yaml"
serve run "${TMPDIR:-/tmp}/rayspec_default_$PORT_RS.yaml" > "${TMPDIR:-/tmp}/rayspec_serve_run.log" 2>&1 &
SERVE_PID=$!
cleanup() { kill "${HF_PID:-}" 2>/dev/null || true; serve shutdown -y >/dev/null 2>&1 || true; kill "$SERVE_PID" 2>/dev/null || true; }
trap cleanup EXIT
transformers serve "$MODEL_DIR" --continuous-batching --device cpu --dtype float32 --host 127.0.0.1 \
  --port "$PORT_HF" --log-level warning > "$OUT/transformers_serve.log" 2>&1 &
HF_PID=$!
for url in "http://127.0.0.1:$PORT_RS/v1/models" "http://127.0.0.1:$PORT_HF/v1/models"; do
  for _ in $(seq 300); do curl -sf "$url" >/dev/null && break; sleep 2; done
  curl -sf "$url" >/dev/null || { echo "no server at $url" >&2; exit 1; }
done
rayspec bench serve --endpoint "http://127.0.0.1:$PORT_RS" --label rayspec-default \
  --endpoint "http://127.0.0.1:$PORT_HF" --label transformers-serve-cb \
  --model smollm2-135m-instruct --model "$MODEL_DIR" --prompts mt_bench --num-prompts 8 --max-tokens 128 \
  --temperature 0 --concurrency "$LEVELS" --rounds "$ROUNDS" --waves 2 --warmup 2 --timeout 600 \
  --output-json "$OUT/vs_transformers_serve.json"
