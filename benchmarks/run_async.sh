#!/usr/bin/env bash
# Issue 20: asynchronous drafting against its synchronous twin, served, c=1 (CONC), greedy,
# MAX_TOKENS tokens, on MT-bench, HumanEval and GSM8K (N prompts each), the apps taking turns
# (benchmarks/async_bench.yaml; ENDPOINTS picks which). Prints /v1/stats of each app afterwards
# (step times, acceptance, speculation-cache hits and misses).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/results}; TAG=${TAG:-async}; N=${N:-1}; CONC=${CONC:-1}; MAX_TOKENS=${MAX_TOKENS:-128}
ENDPOINTS=${ENDPOINTS:-sync async}
mkdir -p "$OUT"
ray start --head --num-cpus 8 --include-dashboard false > /dev/null
serve run --address auto benchmarks/async_bench.yaml > "${TMPDIR:-/tmp}/rayspec_async_serve.log" 2>&1 &
SERVE_PID=$!
trap 'kill $SERVE_PID 2> /dev/null || true; ray stop > /dev/null 2>&1 || true' EXIT
args=()
for app in $ENDPOINTS; do
  until curl -sf "http://127.0.0.1:8000/$app/v1/models" > /dev/null; do sleep 2; done
  args+=(--endpoint "http://127.0.0.1:8000/$app" --label "$app")
done
for set in mt_bench humaneval gsm8k; do
  rayspec bench serve "${args[@]}" --prompts "$set" --num-prompts "$N" --max-tokens "$MAX_TOKENS" \
    --concurrency "$CONC" --rounds 1 --waves 1 --output-json "$OUT/${TAG}_$set.json" | tail -n 8
done
for app in $ENDPOINTS; do echo "$app: $(curl -s "http://127.0.0.1:8000/$app/v1/stats")"; done
