#!/bin/bash
# Ray Serve on the GPU machine, once (issue #50 item 4): the target alone served through
# /v1/chat/completions, streamed at concurrency 1 and 32, on a random-weights model of Llama-3.1-8B's
# shapes written on the spot (benchmarks/gpu_serve.py random-model: no network), 1k-token prompts, 256
# output tokens: the served figure to set beside benchmarks/gpu_engine.py's engine-level one (the same
# shapes, prompt and output lengths). Ray comes from benchmarks/gpu_ray_parts.py's parts, installed in
# /tmp/site by the last part's stage.sh (PYTHONPATH=/tmp/site:$PWD). Writes to $OUT (the device tool's
# folder; /tmp/gpu_serve_random elsewhere): served.json (rayspec bench serve's), serve.log, bench.txt.
#
#   bash benchmarks/gpu_serve_random.sh             # on the GPU machine (< 5 min: ~1 min writing 16 GB of weights)
#   NUM=16 CONC=1,16 bash benchmarks/gpu_serve_random.sh   # fewer prompts (MAX_TOKENS too)
#   bash benchmarks/gpu_serve_random.sh --dry-run   # tiny shapes on CPU, concurrency 1 and 2 (Ray needed)
set -eo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/gpu_serve_random}
PY=${PY:-python3}
PORT=${PORT:-8123}
MODEL_DIR=${MODEL_DIR:-/tmp/rayspec-random}
SHAPE=llama3.1-8b VOCAB=128256 WORDS=1000 MAX_TOKENS=${MAX_TOKENS:-256} CONC=${CONC:-1,32} NUM=${NUM:-64} KV_GB=8 GPUS=1
CONFIG=configs/llama3_eagle3.yaml NAME=llama-3.1-8b-instruct
if [ "$1" = --dry-run ]; then
  SHAPE=tiny VOCAB=512 WORDS=40 MAX_TOKENS=16 CONC=1,2 NUM=4 KV_GB=0.05 GPUS=0
fi
mkdir -p "$OUT"
log() { echo "[$(date -u +%H:%M:%S) +${SECONDS}s] $*"; }
log "writing the random model ($SHAPE) to $MODEL_DIR"
"$PY" benchmarks/gpu_serve.py random-model --out "$MODEL_DIR" --shape "$SHAPE"
"$PY" benchmarks/gpu_serve.py prompts --out "$MODEL_DIR/prompts.jsonl" --vocab "$VOCAB" --words "$WORDS" --num "$NUM"
log "serving the target alone (the config's app with speculation off) on port $PORT"
# (no setsid: on the GPU machine whatever a command leaves running is ended when it returns)
"$PY" benchmarks/gpu_serve.py serve --config "$CONFIG" --apps baseline --port "$PORT" --model "$MODEL_DIR" \
  --num-gpus "$GPUS" --kv-cache-memory-gb "$KV_GB" --ray-num-cpus 8 > "$OUT/serve.log" 2>&1 &
SERVER=$!
stop() {  # SIGTERM: the server shuts Serve and its Ray down; SIGKILL if that takes over 60 s
  kill -TERM "$SERVER" 2>/dev/null || return 0
  for _ in $(seq 1 60); do kill -0 "$SERVER" 2>/dev/null || return 0; sleep 1; done
  log "the server did not stop in 60 s: SIGKILL"; kill -KILL "$SERVER" 2>/dev/null || true
}
trap stop EXIT
for _ in $(seq 1 200); do
  curl -sf "http://127.0.0.1:$PORT/baseline/v1/models" > /dev/null && break
  kill -0 "$SERVER" 2>/dev/null || { tail -50 "$OUT/serve.log"; log "the server exited"; exit 1; }
  sleep 3
done
curl -sf "http://127.0.0.1:$PORT/baseline/v1/models" > /dev/null || { tail -50 "$OUT/serve.log"; log "not ready in 600 s"; exit 1; }
log "ready; streaming /v1/chat/completions at concurrency $CONC"
"$PY" -m rayspec_cli bench serve --endpoint "http://127.0.0.1:$PORT/baseline" --label rayspec-target-alone \
  --model "$NAME" --prompts "$MODEL_DIR/prompts.jsonl" --num-prompts "$NUM" --max-tokens "$MAX_TOKENS" \
  --concurrency "$CONC" --ignore-eos --warmup 1 --output-json "$OUT/served.json" 2>&1 | tee "$OUT/bench.txt"
log "done"
