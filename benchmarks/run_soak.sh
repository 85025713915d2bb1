#!/usr/bin/env bash
# A bounded soak of the default deployment (benchmarks/soak.py): MINUTES of mixed traffic at
# CONC clients, memory and latency per minute. Usage (inside .venv, on a quiet machine):
#   MINUTES=10 CONC=8 benchmarks/run_soak.sh [config]
set -euo pipefail
cd "$(dirname "$0")/.."
CONFIG=${1:-configs/default.yaml}
OUT=${OUT:-benchmarks/results}
TAG=${TAG:-soak}
mkdir -p "$OUT"
serve shutdown -y > /dev/null 2>&1 || true
serve run "$CONFIG" > "${TMPDIR:-/tmp}/rayspec_soak_serve.log" 2>&1 &
SERVE_PID=$!
trap 'serve shutdown -y > /dev/null 2>&1 || true; kill $SERVE_PID 2> /dev/null || true' EXIT
until curl -sf http://127.0.0.1:8000/health > /dev/null; do sleep 3; done
python benchmarks/soak.py --minutes "${MINUTES:-10}" --concurrency "${CONC:-8}" --output-json "$OUT/$TAG.json"
