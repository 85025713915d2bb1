#!/usr/bin/env bash
# Tensor parallelism on this CPU (gloo; each rank one thread, the analog of one device per rank),
# each TP engine run beside a TP=1 engine at one thread in the same process, interleaved prompt by
# prompt (`tp_vs_tp1`, `tp1_greedy_match`, step times), MT-bench prompts:
#   SmolLM2-135M at TP=3 (its 9 query / 3 KV heads split over 3 ranks only), target-only and n-gram;
#   a random model of SmolLM2's shapes with 8 / 2 heads (benchmarks/make_tp_shaped.py) at TP=2.
# Usage: benchmarks/run_tp.sh [num_prompts] [max_tokens]
set -euo pipefail
cd "$(dirname "$0")/.."
N=${1:-5}; T=${2:-64}
OUT=benchmarks/results/tp
SHAPED=${RAYSPEC_CACHE:-$HOME/.cache/rayspec}/models/smollm2-shaped-8h2kv
mkdir -p "$OUT"
[ -f "$SHAPED/config.json" ] || .venv/bin/python benchmarks/make_tp_shaped.py "$SHAPED"
run() {  # model tp method name
  .venv/bin/rayspec bench offline --model "$1" --tensor-parallel-size "$2" --method "$3" --num-speculative-tokens 4 \
    --prompts mt_bench --num-prompts "$N" --max-tokens "$T" --no-hf --num-threads 1 \
    --output-json "$OUT/$4.json"
}
run "$SHAPED" 2 none shaped_tp2_none
run smollm2-135m-instruct 3 none smollm2_tp3_none
run smollm2-135m-instruct 3 ngram smollm2_tp3_ngram
