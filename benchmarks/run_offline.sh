#!/usr/bin/env bash
# Offline benchmark of the issue: SmolLM2-135M, greedy, 128 new tokens, 10 prompts of each set.
# Usage (inside .venv, on a quiet machine): benchmarks/run_offline.sh [prompts-dir]
set -euo pipefail
cd "$(dirname "$0")/.."
PROMPTS=${1:-rayspec/data/prompts}  # the bundled evaluation sets
OUT=benchmarks/results
mkdir -p "$OUT"
for set in mt_bench humaneval gsm8k; do
  rayspec bench offline --method ngram --num-speculative-tokens 5 --prompts "$PROMPTS/$set.jsonl" \
    --num-prompts 10 --max-tokens 128 --output-json "$OUT/offline_ngram_$set.json"
done
# draft_model on a real pair built from SmolLM2: the first 8 of its 30 layers as the draft
for set in mt_bench humaneval gsm8k; do
  rayspec bench offline --method draft_model --draft-num-layers 8 --num-speculative-tokens 3 \
    --prompts "$PROMPTS/$set.jsonl" --num-prompts 10 --max-tokens 128 --output-json "$OUT/offline_draft_model_$set.json"
done
# batching: 8 concurrent requests vs the same prompts one at a time
rayspec bench offline --method none --concurrency 8 --prompts "$PROMPTS/mt_bench.jsonl" --num-prompts 16 \
  --max-tokens 128 --output-json "$OUT/offline_none_c8_mt_bench.json"
rayspec bench offline --method ngram --concurrency 8 --prompts "$PROMPTS/humaneval.jsonl" --num-prompts 16 \
  --max-tokens 128 --output-json "$OUT/offline_ngram_c8_humaneval.json"
python benchmarks/summarize.py "$OUT"/offline_*.json > benchmarks/results/offline_summary.md
cat benchmarks/results/offline_summary.md
