#!/usr/bin/env bash
# Issue-3 serving benchmark, bracketed by offline runs so served/offline ratios come from one
# sitting (this VM's speed drifts by 10-20% over minutes):
#   1. offline engine, eagle3 (default config's settings) and its baseline, no Ray running, with
#      2 torch threads (its best on this 2-core box; the served configs' setting since session 9)
#      and with 1;
#   2. benchmarks/serve_bench.yaml (eagle3 colocated, baseline, eagle3 disaggregated), a
#      concurrency sweep with the endpoints taking turns (order rotating per round), ROUNDS
#      rounds per level (3: each endpoint goes first, second and third once), each level
#      sending at least WAVES x concurrency requests (the N prompts repeated) so that c8 is
#      measured at 8 in flight, not mostly draining;
#   3. the offline run again; then benchmarks/serve_ratios.py prints the ratios.
# Usage (inside .venv, on a quiet machine): benchmarks/run_serve.sh [prompts-dir]
set -euo pipefail
cd "$(dirname "$0")/.."
PROMPTS=${1:-rayspec/data/prompts}/mt_bench.jsonl  # default: the bundled set
OUT=${OUT:-benchmarks/results}
TAG=${TAG:-served_sweep_mt_bench}
N=${N:-10}; ROUNDS=${ROUNDS:-3}; CONC=${CONC:-1,2,4,8}; WAVES=${WAVES:-4}
mkdir -p "$OUT"
offline() {  # $1: output JSON, $2: torch threads
  rayspec bench offline --num-threads "$2" --method eagle3 --draft-model heads/smollm2-135m-eagle3 --num-speculative-tokens 8 \
    --eagle-topk 2 --num-steps 4 --eagle-stop-prob 0.2 --eagle-prompt-lookup 5 --prompts "$PROMPTS" --num-prompts "$N" --max-tokens 128 --no-hf \
    --output-json "$1" > /dev/null
}
serve shutdown -y > /dev/null 2>&1 || true
offline "$OUT/${TAG}_offline_before.json" 2
offline "$OUT/${TAG}_offline_before_1thread.json" 1
serve run "${CONFIG:-benchmarks/serve_bench.yaml}" > "${TMPDIR:-/tmp}/rayspec_serve_run.log" 2>&1 &
SERVE_PID=$!
trap 'serve shutdown -y > /dev/null 2>&1 || true; kill $SERVE_PID 2> /dev/null || true' EXIT
for app in spec base disagg; do
  until curl -sf "http://127.0.0.1:8000/$app/v1/models" > /dev/null; do sleep 3; done
done
rayspec bench serve --endpoint http://127.0.0.1:8000/spec --label eagle3 \
  --endpoint http://127.0.0.1:8000/base --label base --endpoint http://127.0.0.1:8000/disagg --label disagg \
  --prompts "$PROMPTS" --num-prompts "$N" --max-tokens 128 --concurrency "$CONC" --rounds "$ROUNDS" --waves "$WAVES" \
  --output-json "$OUT/$TAG.json" --plot "$OUT/$TAG.png"
serve shutdown -y > /dev/null 2>&1 || true
kill $SERVE_PID 2> /dev/null || true
sleep 5
offline "$OUT/${TAG}_offline_after_1thread.json" 1
offline "$OUT/${TAG}_offline_after.json" 2
python benchmarks/serve_ratios.py "$OUT/$TAG.json" "$OUT/${TAG}"_offline_*.json \
  | tee "$OUT/${TAG}_ratios.md"
