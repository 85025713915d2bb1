#!/usr/bin/env bash
# The GPU serving benchmark in one command (issue 19, item 4):
#
#   benchmarks/gpu.sh                 Llama-3.1-8B-Instruct + EAGLE-3 (configs/llama3_eagle3.yaml)
#   benchmarks/gpu.sh --dry-run       the same path on CPU with SmolLM2-135M (configs/default.yaml)
#
# Serves the config's app twice, as itself (label rayspec-eagle3) and with speculation off
# (rayspec-baseline, the same engine settings), runs `rayspec bench serve` at each concurrency on
# the MT-bench, HumanEval and GSM8K prompt sets, and where vLLM is importable serves vLLM's own
# EAGLE-3 on the same weights (vllm-eagle3) and sends it the same prompts. Writes JSON and plots
# per set into the results directory and prints a summary table: tok/s, TTFT, TPOT, acceptance
# and speedup over the baseline per set and concurrency (benchmarks/README.md, "GPU").
#
# GPU memory is never shared by two engines unless asked (--layout together on one GPU): with
# one GPU our two apps run one after the other (layout sequential), with two or more side by side
# on their own GPUs, interleaved level by level (together); vLLM starts only after ours are
# stopped and the GPUs' memory is back. Everything started here is stopped on exit (trap).
#
# Options (defaults: GPU run / --dry-run):
#   --results-dir DIR     benchmarks/results/gpu/<UTC time> / $TMPDIR/rayspec-gpu-dry-run
#   --prompts-dir DIR     the first of data/prompts, rayspec/data/prompts, ../shared/data/prompts
#                         that holds <set>.jsonl
#   --config FILE         configs/llama3_eagle3.yaml / configs/default.yaml
#   --sets A,B            mt_bench,humaneval,gsm8k
#   --concurrency LIST    1,4,16,64 / 1,2
#   --num-prompts N       20 / 2 (per set; each level sends at least --waves x concurrency requests)
#   --max-tokens N        256 / 8
#   --waves N             2 / 0
#   --layout L            auto (sequential on one GPU or CPU, together on 2+ GPUs), sequential, together
#   --kv-cache-memory-gb  override the config's KV budget (e.g. with --layout together on one GPU)
#   --port N              8600 (vLLM: N+1)
#   --vllm MODE           auto (if importable), skip, require
#   --vllm-python PATH    the Python whose vllm is used (default: the one running rayspec)
#   --vllm-spec-tokens N  3 (vLLM's EAGLE-3 drafts a chain of N)
#   --ready-timeout S     1200 / 300 (each server, from start to answering)
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$(pwd)
PY=${PYTHON:-$([ -x .venv/bin/python ] && echo "$REPO/.venv/bin/python" || command -v python3)}

DRY_RUN=0 RESULTS= PROMPTS_DIR= CONFIG= SETS=mt_bench,humaneval,gsm8k CONC= NUM_PROMPTS= MAX_TOKENS= WAVES=
LAYOUT=auto KV_GB= PORT=8600 VLLM_MODE=auto VLLM_PY= VLLM_SPEC_TOKENS=3 READY_TIMEOUT=
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) DRY_RUN=1 ;;
    --results-dir) RESULTS=$2; shift ;;
    --prompts-dir) PROMPTS_DIR=$2; shift ;;
    --config) CONFIG=$2; shift ;;
    --sets) SETS=$2; shift ;;
    --concurrency) CONC=$2; shift ;;
    --num-prompts) NUM_PROMPTS=$2; shift ;;
    --max-tokens) MAX_TOKENS=$2; shift ;;
    --waves) WAVES=$2; shift ;;
    --layout) LAYOUT=$2; shift ;;
    --kv-cache-memory-gb) KV_GB=$2; shift ;;
    --port) PORT=$2; shift ;;
    --vllm) VLLM_MODE=$2; shift ;;
    --vllm-python) VLLM_PY=$2; shift ;;
    --vllm-spec-tokens) VLLM_SPEC_TOKENS=$2; shift ;;
    --ready-timeout) READY_TIMEOUT=$2; shift ;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
    *) echo "gpu.sh: unknown option $1 (--help lists them)" >&2; exit 2 ;;
  esac
  shift
done

die() { echo "gpu.sh: $*" >&2; exit 2; }
log() { echo "[gpu.sh $(date -u +%H:%M:%S)] $*" >&2; }

if [ "$DRY_RUN" = 1 ]; then
  : "${RESULTS:=${TMPDIR:-/tmp}/rayspec-gpu-dry-run}" "${CONFIG:=configs/default.yaml}" "${CONC:=1,2}"
  : "${NUM_PROMPTS:=2}" "${MAX_TOKENS:=8}" "${WAVES:=0}" "${READY_TIMEOUT:=300}"
else
  : "${RESULTS:=benchmarks/results/gpu/$(date -u +%Y%m%dT%H%M%SZ)}" "${CONFIG:=configs/llama3_eagle3.yaml}"
  : "${CONC:=1,4,16,64}" "${NUM_PROMPTS:=20}" "${MAX_TOKENS:=256}" "${WAVES:=2}" "${READY_TIMEOUT:=1200}"
fi
case "$LAYOUT" in auto|sequential|together) ;; *) die "--layout is auto, sequential or together, not $LAYOUT" ;; esac
case "$VLLM_MODE" in auto|skip|require) ;; *) die "--vllm is auto, skip or require, not $VLLM_MODE" ;; esac
: "${VLLM_PY:=$PY}"
VLLM_PORT=$((PORT + 1))
IFS=, read -r -a SET_LIST <<< "$SETS"
IFS=, read -r -a CONC_LIST <<< "$CONC"

# ---- prompts: the repository's copy first, then the shared one -------------------------------
if [ -z "$PROMPTS_DIR" ]; then
  for dir in data/prompts rayspec/data/prompts ../shared/data/prompts; do
    if [ -f "$dir/${SET_LIST[0]}.jsonl" ]; then PROMPTS_DIR=$dir; break; fi
  done
  [ -n "$PROMPTS_DIR" ] || die "no ${SET_LIST[0]}.jsonl in data/prompts, rayspec/data/prompts or ../shared/data/prompts: give --prompts-dir"
fi
for set in "${SET_LIST[@]}"; do
  [ -f "$PROMPTS_DIR/$set.jsonl" ] || die "no prompt set $PROMPTS_DIR/$set.jsonl"
done

# ---- the machine -----------------------------------------------------------------------------
NUM_GPUS=0
if [ "$DRY_RUN" = 0 ]; then
  command -v nvidia-smi > /dev/null || die "nvidia-smi not found: no NVIDIA GPU here (the CPU path: benchmarks/gpu.sh --dry-run)"
  nvidia-smi -L > /dev/null 2>&1 || die "nvidia-smi finds no GPU or no driver: $(nvidia-smi -L 2>&1 | head -1)"
  NUM_GPUS=$(nvidia-smi -L | grep -c '^GPU')
  "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" ||
    die "torch in $PY sees no CUDA device (a CPU build of torch?): install a CUDA build"
  nvidia-smi --query-gpu=index,name,memory.total,memory.used,driver_version --format=csv >&2
fi
if [ "$LAYOUT" = auto ]; then
  if [ "$NUM_GPUS" -ge 2 ]; then LAYOUT=together; else LAYOUT=sequential; fi
fi
NUM_GPUS_PER_APP=
if [ "$DRY_RUN" = 0 ]; then
  # together on one GPU: half each (the KV budget is then the user's to lower, --kv-cache-memory-gb)
  if [ "$LAYOUT" = together ] && [ "$NUM_GPUS" -lt 2 ]; then
    [ -n "$KV_GB" ] || die "--layout together on one GPU holds two engines there: give --kv-cache-memory-gb" \
      "small enough for both (rayspec plan $CONFIG --gpu-memory <GPU memory> shows one engine's needs)"
    NUM_GPUS_PER_APP=0.5
  else
    NUM_GPUS_PER_APP=1
  fi
fi

gpu_used_mib() {  # the most memory in use on any GPU, MiB (0 where nvidia-smi cannot say, e.g. MIG)
  local used
  used=$(nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits 2> /dev/null | grep -E '^[0-9]+$' | sort -n | tail -1)
  echo "${used:-0}"
}
GPU_USED_AT_START=0
[ "$DRY_RUN" = 1 ] || GPU_USED_AT_START=$(gpu_used_mib)

port_free() {
  "$PY" -c "import socket, sys; s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind(('127.0.0.1', int(sys.argv[1])))" "$1" 2> /dev/null
}

# ---- models: resolve (download) before any timeout starts ------------------------------------
mkdir -p "$RESULTS/runs" "$RESULTS/logs"
log "results in $RESULTS; prompts from $PROMPTS_DIR; config $CONFIG; layout $LAYOUT"
if ! "$PY" -c "import sys; from huggingface_hub import get_token; sys.exit(0 if get_token() else 1)"; then
  [ "$DRY_RUN" = 1 ] || log "no Hugging Face token (HF_TOKEN, or huggingface-cli login): a gated model such as" \
    "meta-llama/Llama-3.1-8B-Instruct loads only if it is already in the Hugging Face cache"
fi
if ! MODELS=$("$PY" benchmarks/gpu_serve.py fetch --config "$CONFIG"); then
  die "the config's models could not be found or downloaded (above). For meta-llama/Llama-3.1-8B-Instruct:" \
    "accept its license at https://huggingface.co/meta-llama/Llama-3.1-8B-Instruct, then export HF_TOKEN=<a token" \
    "of that account> (or run huggingface-cli login), or copy the model into the Hugging Face cache"
fi
field() { "$PY" -c "import json, sys; v = json.loads(sys.argv[1]).get(sys.argv[2]); print('' if v is None else v)" "$MODELS" "$1"; }
SERVED_NAME=$(field served_model_name)
echo "$MODELS" > "$RESULTS/models.json"

# ---- servers, stopped on any exit -------------------------------------------------------------
SERVER_PID= VLLM_PID=
stop_pid() {  # $1: a process started here with setsid (so it leads its process group)
  local pid=$1 i
  [ -n "$pid" ] && kill -0 "$pid" 2> /dev/null || return 0
  kill -TERM "$pid" 2> /dev/null || true
  for i in $(seq 1 90); do kill -0 "$pid" 2> /dev/null || break; sleep 1; done
  kill -KILL -- "-$pid" 2> /dev/null || true  # what is left of its group (Ray's processes)
  wait "$pid" 2> /dev/null || true
}
cleanup() {
  stop_pid "$SERVER_PID"; SERVER_PID=
  stop_pid "$VLLM_PID"; VLLM_PID=
}
trap cleanup EXIT
trap 'exit 130' INT TERM

wait_ready() {  # $1: pid, $2: log, $3...: URLs that must answer
  local pid=$1 logfile=$2 start=$SECONDS url
  shift 2
  for url in "$@"; do
    until curl -sf -m 10 "$url" > /dev/null; do
      if ! kill -0 "$pid" 2> /dev/null; then
        tail -n 30 "$logfile" >&2
        log "the server ($logfile) exited before $url answered"
        return 1
      fi
      if [ $((SECONDS - start)) -ge "$READY_TIMEOUT" ]; then
        tail -n 30 "$logfile" >&2
        log "$url did not answer within --ready-timeout $READY_TIMEOUT s ($logfile)"
        return 1
      fi
      sleep 3
    done
  done
  log "ready after $((SECONDS - start)) s: $*"
}

wait_gpu_free() {  # until the GPUs hold no more than at the start (+1 GiB), at most 180 s
  local i
  [ "$DRY_RUN" = 0 ] || return 0
  for i in $(seq 1 60); do
    [ "$(gpu_used_mib)" -le $((GPU_USED_AT_START + 1024)) ] && return 0
    sleep 3
  done
  return 1
}

bench() {  # $1: set, $2: output stem, $3: concurrency list, $4: warmup; then --endpoint/--label pairs
  local set=$1 stem=$2 conc=$3 warmup=$4
  shift 4
  "$PY" -m rayspec_cli bench serve "$@" --model "$SERVED_NAME" --prompts "$PROMPTS_DIR/$set.jsonl" \
    --num-prompts "$NUM_PROMPTS" --max-tokens "$MAX_TOKENS" --concurrency "$conc" --waves "$WAVES" \
    --warmup "$warmup" --output-json "$RESULTS/runs/$stem.json" --plot "$RESULTS/runs/$stem.png" \
    2> "$RESULTS/logs/bench_$stem.log" | tee "$RESULTS/logs/bench_$stem.txt"
}

serve_ours() {  # $1: comma-separated apps (eagle3, baseline), $2: run name
  local apps=$1 name=$2 app urls=() extra=()
  port_free "$PORT" || die "port $PORT is in use: give --port"
  [ -z "$NUM_GPUS_PER_APP" ] || extra+=(--num-gpus "$NUM_GPUS_PER_APP")
  [ -z "$KV_GB" ] || extra+=(--kv-cache-memory-gb "$KV_GB")
  # the dry run drafts its whole budget: on a loaded CPU the cost-aware planner may rightly find that
  # drafting does not pay, and the dry run is there to go through drafting and verification
  if [ "$DRY_RUN" = 1 ]; then extra+=(--ray-num-cpus 4 --full-drafts); else extra+=(--ray-num-cpus "$(( $(nproc) > 12 ? $(nproc) : 12 ))"); fi
  log "starting rayspec ($apps) on port $PORT"
  setsid "$PY" benchmarks/gpu_serve.py serve --config "$CONFIG" --apps "$apps" --port "$PORT" "${extra[@]}" \
    > "$RESULTS/logs/serve_$name.log" 2>&1 &
  SERVER_PID=$!
  IFS=, read -r -a app_list <<< "$apps"
  for app in "${app_list[@]}"; do urls+=("http://127.0.0.1:$PORT/$app/v1/models"); done
  wait_ready "$SERVER_PID" "$RESULTS/logs/serve_$name.log" "${urls[@]}" || die "rayspec ($apps) did not start"
  local endpoints=()
  for app in "${app_list[@]}"; do endpoints+=(--endpoint "http://127.0.0.1:$PORT/$app" --label "rayspec-$app"); done
  for set in "${SET_LIST[@]}"; do
    log "$set: ${endpoints[*]}"
    bench "$set" "${set}_$name" "$CONC" 1 "${endpoints[@]}" || log "$set: the benchmark failed (logs/bench_${set}_$name.log)"
  done
  log "stopping rayspec ($apps)"
  stop_pid "$SERVER_PID"; SERVER_PID=
}

START=$SECONDS
if [ "$LAYOUT" = together ]; then
  serve_ours eagle3,baseline rayspec
else
  serve_ours eagle3 rayspec-eagle3
  serve_ours baseline rayspec-baseline
fi

# ---- vLLM's EAGLE-3, after ours have stopped ----------------------------------------------------
EXPECT=rayspec-eagle3,rayspec-baseline
run_vllm() {
  local vllm_bin model_dir draft_dir max_len dtype spec url set c stem
  vllm_bin=$(dirname "$VLLM_PY")/vllm
  [ -x "$vllm_bin" ] || vllm_bin=$(command -v vllm) || { log "vllm is importable but its command is not found"; return 1; }
  wait_gpu_free || { log "the GPUs did not free their memory after rayspec stopped: vLLM not started"; return 1; }
  port_free "$VLLM_PORT" || { log "port $VLLM_PORT is in use: vLLM not started"; return 1; }
  model_dir=$(field model_dir) draft_dir=$(field draft_model_dir) max_len=$(field max_model_len) dtype=$(field dtype)
  spec=$(printf '{"method": "eagle3", "model": "%s", "num_speculative_tokens": %d}' "$draft_dir" "$VLLM_SPEC_TOKENS")
  log "starting vLLM $("$VLLM_PY" -c 'import vllm; print(vllm.__version__)') on port $VLLM_PORT: $spec"
  setsid "$vllm_bin" serve "$model_dir" --served-model-name "$SERVED_NAME" --host 127.0.0.1 --port "$VLLM_PORT" \
    --max-model-len "$max_len" --dtype "${dtype:-auto}" --seed 0 --speculative-config "$spec" \
    > "$RESULTS/logs/serve_vllm.log" 2>&1 &
  VLLM_PID=$!
  wait_ready "$VLLM_PID" "$RESULTS/logs/serve_vllm.log" "http://127.0.0.1:$VLLM_PORT/v1/models" || return 1
  url=http://127.0.0.1:$VLLM_PORT
  for set in "${SET_LIST[@]}"; do
    # one run per level, the server's speculative counters read around it (/metrics): vLLM
    # reports no acceptance in its responses. The set's first prompt warms the server up first,
    # as `bench serve --warmup 1` does for ours.
    NUM_PROMPTS=1 WAVES=0 bench "$set" "${set}_vllm-warmup" 1 0 --endpoint "$url" --label vllm-eagle3 > /dev/null
    rm -f "$RESULTS/runs/${set}_vllm-warmup".*
    for c in "${CONC_LIST[@]}"; do
      stem=${set}_vllm-eagle3_c$c
      curl -sf "$url/metrics" > "$RESULTS/runs/${stem}_before.prom" || true
      bench "$set" "$stem" "$c" 0 --endpoint "$url" --label vllm-eagle3
      curl -sf "$url/metrics" > "$RESULTS/runs/${stem}_after.prom" || true
      rm -f "$RESULTS/runs/$stem.png"
    done
  done
  stop_pid "$VLLM_PID"; VLLM_PID=
}
VLLM_STATUS=skipped
if [ "$VLLM_MODE" != skip ]; then
  if "$VLLM_PY" -c "import vllm" 2> /dev/null; then
    if run_vllm; then VLLM_STATUS=ran; EXPECT+=,vllm-eagle3; else VLLM_STATUS=failed; fi
  else
    [ "$VLLM_MODE" = require ] && die "--vllm require: vllm is not importable by $VLLM_PY"
    log "vllm is not importable by $VLLM_PY: no vLLM run"
  fi
fi

# ---- summary ----------------------------------------------------------------------------------
"$PY" - "$RESULTS/run.json" <<EOF
import json, platform, subprocess, sys, torch
def out(cmd):
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=30).stdout.strip()
    except OSError:
        return None
json.dump({"dry_run": bool($DRY_RUN), "config": "$CONFIG", "prompts_dir": "$PROMPTS_DIR", "sets": "$SETS".split(","),
           "concurrency": [int(c) for c in "$CONC".split(",")], "num_prompts": $NUM_PROMPTS, "max_tokens": $MAX_TOKENS,
           "waves": $WAVES, "layout": "$LAYOUT", "kv_cache_memory_gb": "$KV_GB" or None, "vllm": "$VLLM_STATUS",
           "vllm_num_speculative_tokens": $VLLM_SPEC_TOKENS, "wall_s": $((SECONDS - START)),
           "commit": out(["git", "rev-parse", "HEAD"]), "torch": torch.__version__, "cuda": torch.version.cuda,
           "gpus": out(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"]) if not $DRY_RUN else None,
           "cpu": next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), platform.machine())}, open(sys.argv[1], "w"), indent=2)
EOF
log "all runs done in $((SECONDS - START)) s; vLLM: $VLLM_STATUS"
"$PY" benchmarks/gpu_summary.py "$RESULTS" --sets "$SETS" --baseline rayspec-baseline --expect "$EXPECT" \
  --concurrency "$CONC"
[ "$VLLM_STATUS" != failed ] || { log "the vLLM run failed: $RESULTS/logs/serve_vllm.log"; exit 3; }
log "JSON and plots: $RESULTS/<set>.json, $RESULTS/<set>.png, $RESULTS/summary.md"
