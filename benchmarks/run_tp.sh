#!/usr/bin/env bash
# Tensor parallelism on this CPU: SmolLM2-135M at TP=2 and TP=3 (gloo, each rank one thread: the
# analog of one device per rank), each run beside a TP=1 engine at one thread in the same process
# (`tp_vs_tp1`, `tp1_greedy_match`), n-gram drafts and target-only, MT-bench prompts.
# Usage: benchmarks/run_tp.sh [num_prompts] [max_tokens]
set -euo pipefail
cd "$(dirname "$0")/.."
N=${1:-5}; T=${2:-64}
OUT=benchmarks/results/tp
mkdir -p "$OUT"
for tp in 2 3; do
  for method in none ngram; do
    .venv/bin/rayspec bench offline --model smollm2-135m-instruct --method "$method" --num-speculative-tokens 4 \
      --prompts ../shared/data/prompts/mt_bench.jsonl --num-prompts "$N" --max-tokens "$T" --no-hf \
      --num-threads 1 --tensor-parallel-size "$tp" --output-json "$OUT/tp${tp}_${method}.json"
  done
done
