#!/usr/bin/env bash
# Speculation that never loses, served (issue #34): configs/default.yaml's EAGLE-3 settings against the
# target alone, both behind HTTP in one Serve instance (benchmarks/serve_bench.yaml: apps /spec and
# /base), `rayspec bench serve` taking turns between them (order rotating per round), per prompt set
# and temperature, at concurrency 1 and 8 (WAVES x 8 requests at 8). Temperature > 0 requests are
# unseeded, as served requests come. Writes benchmarks/results/never_loses_served_<set>_t<T>.json.
#   benchmarks/run_never_loses_served.sh [NUM_PROMPTS] [MAX_TOKENS]      (default 8 64)
#   SETS="unguessable" TEMPS=1 ROUNDS=2 benchmarks/run_never_loses_served.sh     (subsets)
#   SEEDED=1 TEMPS=1 benchmarks/run_never_loses_served.sh   (every request with "seed": 0: the speculative
#     app emits the base app's tokens, so both do the same work; unseeded, EOS ends different requests
#     in each: a noise of its own at concurrency 8). Writes never_loses_served_<set>_t<T>_seeded.json
# Inside .venv, on a quiet machine (the two apps share its cores; one is busy at a time).
set -euo pipefail
cd "$(dirname "$0")/.."
N=${1:-8}
MAX=${2:-64}
PY=${PYTHON:-python}
OUT=${OUT:-benchmarks/results}
PORT=${PORT:-8000}
serve shutdown -y > /dev/null 2>&1 || true
serve run benchmarks/serve_bench.yaml > "${TMPDIR:-/tmp}/rayspec_never_loses_served.log" 2>&1 &
SERVE_PID=$!
trap 'serve shutdown -y > /dev/null 2>&1 || true; kill $SERVE_PID 2> /dev/null || true' EXIT
for app in spec base; do
  until curl -sf "http://127.0.0.1:$PORT/$app/v1/models" > /dev/null; do sleep 3; done
done
for set in ${SETS:-mt_bench humaneval gsm8k unguessable long_documents}; do
  for t in ${TEMPS:-0 1}; do
    extra=()
    suffix=""
    if [ "$t" != 0 ] && [ "${SEEDED:-0}" = 1 ]; then  # every request seeded: spec emits base's tokens
      extra=(--extra-body '{"seed": 0}')
      suffix=_seeded
    fi
    out="$OUT/never_loses_served_${set}_t${t}${suffix}.json"
    echo "== served, $set, temperature $t -> $out" >&2
    $PY -m rayspec_cli bench serve --endpoint "http://127.0.0.1:$PORT/spec" --label eagle3 \
      --endpoint "http://127.0.0.1:$PORT/base" --label base --prompts "$set" --num-prompts "$N" \
      --max-tokens "$MAX" --temperature "$t" --concurrency 1,8 --rounds "${ROUNDS:-2}" --waves "${WAVES:-2}" \
      "${extra[@]}" --output-json "$out"
  done
done
