#!/usr/bin/env bash
# configs/default.yaml served by two checkouts of rayspec, one after the other, in alternating order
# (A B, then B A, ...), each measured by `rayspec bench serve` at concurrency 1 and 8: the "no slower
# than today" check of issue #50 (the code before a change against the code after, on one machine in
# one sitting; this VM drifts, so the sides take turns and the ratios are read per round).
# Usage (inside .venv, on a quiet machine):
#   benchmarks/run_served_ab.sh CHECKOUT_A CHECKOUT_B [ROUNDS]
# Each side runs `serve run configs/default.yaml` from its own checkout with PYTHONPATH set to it (its
# replicas import its rayspec and deployments); results: $OUT/${TAG}_{A,B}_round{i}.json, then
# benchmarks/served_ab.py prints per-round ratios B/A.
set -euo pipefail
A=$(cd "$1" && pwd); B=$(cd "$2" && pwd); ROUNDS=${3:-2}
cd "$(dirname "$0")/.."
OUT=${OUT:-benchmarks/results}; TAG=${TAG:-served_ab}
PROMPTS=${PROMPTS:-mt_bench}; N=${N:-8}; MAX_TOKENS=${MAX_TOKENS:-96}; CONC=${CONC:-1,8}; WAVES=${WAVES:-2}
mkdir -p "$OUT"
start() {  # $1: side label, $2: checkout; returns once it answers (1: its serve run exited first)
  ray stop --force > /dev/null 2>&1 || true
  while curl -s -o /dev/null http://127.0.0.1:8000/; do sleep 1; done  # the last side's proxy gone
  sleep 3
  (cd "$2" && env -u RAY_ADDRESS PYTHONPATH="$2" serve run configs/default.yaml > "${TMPDIR:-/tmp}/served_ab_$1.log" 2>&1) &
  pid=$!
  until curl -sf http://127.0.0.1:8000/v1/models > /dev/null; do
    kill -0 $pid 2> /dev/null || return 1
    sleep 3
  done
}
one() {  # $1: side label, $2: checkout, $3: round
  # (a start can fail when Ray's previous processes are still going away: tried once more)
  start "$1" "$2" || start "$1" "$2" || { echo "side $1 did not start: ${TMPDIR:-/tmp}/served_ab_$1.log"; exit 1; }
  rayspec bench serve --endpoint http://127.0.0.1:8000 --label "$1" --prompts "$PROMPTS" --num-prompts "$N" \
    --max-tokens "$MAX_TOKENS" --concurrency "$CONC" --waves "$WAVES" --warmup 2 \
    --output-json "$OUT/${TAG}_$1_round$3.json" > /dev/null
  kill $pid 2> /dev/null || true
  wait $pid 2> /dev/null || true
  ray stop --force > /dev/null 2>&1 || true
}
for r in $(seq 1 "$ROUNDS"); do
  if [ $((r % 2)) = 1 ]; then one A "$A" "$r"; one B "$B" "$r"; else one B "$B" "$r"; one A "$A" "$r"; fi
done
python benchmarks/served_ab.py "$OUT/${TAG}"_*_round*.json | tee "$OUT/${TAG}.md"
