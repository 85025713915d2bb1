#!/usr/bin/env bash
# Speculation that never loses, served (issue #34): each proposer at its shipped settings against the
# target alone, behind HTTP in one Serve instance (benchmarks/serve_never_loses.yaml, of which only /base
# and the PROPOSERS' apps are started: /base, and
# /spec configs/default.yaml's EAGLE-3, /ngram n-gram at k = 4, /draft configs/draft_model.yaml's draft
# model), `rayspec bench serve` taking turns between them (order rotating per round), per prompt set
# and temperature, at concurrency 1 and 8 (WAVES x 8 requests at 8). Temperature > 0 requests are
# unseeded, as served requests come. Writes benchmarks/results/never_loses_served_<set>_t<T>.json
# (EAGLE-3 alone, PROPOSERS=eagle3, the default) or never_loses_served_<proposers>_<set>_t<T>.json.
#   benchmarks/run_never_loses_served.sh [NUM_PROMPTS] [MAX_TOKENS]      (default 8 64)
#   SETS="unguessable" TEMPS=1 ROUNDS=2 benchmarks/run_never_loses_served.sh     (subsets)
#   PROPOSERS="ngram draft_model" benchmarks/run_never_loses_served.sh   (other endpoints, one run each)
#   SEEDED=1 TEMPS=1 benchmarks/run_never_loses_served.sh   (every request with "seed": 0: the speculative
#     app emits the base app's tokens, so both do the same work; unseeded, EOS ends different requests
#     in each: a noise of its own at concurrency 8). Writes never_loses_served_..._t<T>_seeded.json
# Inside .venv, on a quiet machine (the apps share its cores; one is busy at a time).
set -euo pipefail
cd "$(dirname "$0")/.."
N=${1:-8}
MAX=${2:-64}
PY=${PYTHON:-python}
OUT=${OUT:-benchmarks/results}
PORT=${PORT:-8000}
PROPOSERS=${PROPOSERS:-eagle3}
declare -A APP=([eagle3]=spec [ngram]=ngram [draft_model]=draft)
apps=(base)
for p in $PROPOSERS; do
  [ -n "${APP[$p]:-}" ] || { echo "unknown proposer $p (eagle3, ngram, draft_model)" >&2; exit 2; }
  apps+=("${APP[$p]}")
done
# only the apps measured are started (an idle app's replica still shares the cores)
names="${apps[*]}"
CONFIG="${TMPDIR:-/tmp}/rayspec_never_loses_${names// /_}.yaml"
$PY - "$CONFIG" "${apps[@]}" <<'PYEOF'
import sys, yaml
config = yaml.safe_load(open("benchmarks/serve_never_loses.yaml"))
config["applications"] = [a for a in config["applications"] if a["name"] in sys.argv[2:]]
yaml.safe_dump(config, open(sys.argv[1], "w"), sort_keys=False)
PYEOF
serve shutdown -y > /dev/null 2>&1 || true
serve run "$CONFIG" > "${TMPDIR:-/tmp}/rayspec_never_loses_served.log" 2>&1 &
SERVE_PID=$!
trap 'serve shutdown -y > /dev/null 2>&1 || true; kill $SERVE_PID 2> /dev/null || true' EXIT
# ready: /health answers 200 once the app's verifier does (its engine built and warmed up; /v1/models
# is answered by the ingress alone, earlier: a run started there measured apps still loading beside it)
for app in "${apps[@]}"; do
  until curl -sf "http://127.0.0.1:$PORT/$app/health" > /dev/null; do sleep 3; done
done
MODEL=$(curl -sf "http://127.0.0.1:$PORT/base/v1/models" | $PY -c 'import json, sys; print(json.load(sys.stdin)["data"][0]["id"])')
for app in "${apps[@]}"; do  # one short request each: every app's first-request work done before timing
  curl -sf "http://127.0.0.1:$PORT/$app/v1/completions" -H 'Content-Type: application/json' \
    -d "{\"model\": \"$MODEL\", \"prompt\": \"Hello\", \"max_tokens\": 4}" > /dev/null
done
# apps that loaded side by side measured their CPU kernels on busy cores: they measure again once idle
# (rayspec/cpu/kernels.py); wait until none reports a provisional choice (at most a minute)
for _ in $(seq 30); do
  pending=0
  for app in "${apps[@]}"; do
    curl -sf "http://127.0.0.1:$PORT/$app/v1/stats" | grep -q provisional && pending=1
  done
  [ "$pending" = 0 ] && break
  sleep 2
done
for app in "${apps[@]}"; do
  echo "$app: $(curl -sf "http://127.0.0.1:$PORT/$app/v1/stats" | $PY -c 'import json, sys; print(json.load(sys.stdin).get("cpu_kernels"))')" >&2
done
for set in ${SETS:-mt_bench humaneval gsm8k unguessable long_documents}; do
  for t in ${TEMPS:-0 1}; do
    extra=()
    suffix=""
    if [ "$t" != 0 ] && [ "${SEEDED:-0}" = 1 ]; then  # every request seeded: spec emits base's tokens
      extra=(--extra-body '{"seed": 0}')
      suffix=_seeded
    fi
    name=""
    [ "$PROPOSERS" = eagle3 ] || name="${PROPOSERS// /_}_"
    out="$OUT/never_loses_served_${name}${set}_t${t}${suffix}.json"
    endpoints=()
    for p in $PROPOSERS; do endpoints+=(--endpoint "http://127.0.0.1:$PORT/${APP[$p]}" --label "$p"); done
    echo "== served, $PROPOSERS, $set, temperature $t -> $out" >&2
    $PY -m rayspec_cli bench serve "${endpoints[@]}" \
      --endpoint "http://127.0.0.1:$PORT/base" --label base --prompts "$set" --num-prompts "$N" \
      --max-tokens "$MAX" --temperature "$t" --concurrency 1,8 --rounds "${ROUNDS:-2}" --waves "${WAVES:-2}" \
      "${extra[@]}" --output-json "$out"
  done
done
