#!/usr/bin/env bash
# Offline benchmark of the EAGLE issue: SmolLM2-135M with the trained EAGLE-3 head in heads/,
# greedy, concurrency 1, 128 new tokens, 10 prompts of each bundled set (rayspec/data/prompts).
# Usage (inside .venv, on a quiet machine): benchmarks/run_eagle.sh [prompts-dir]
set -euo pipefail
cd "$(dirname "$0")/.."
PROMPTS=${1:-rayspec/data/prompts}  # the bundled evaluation sets
OUT=benchmarks/results
HEAD=${HEAD:-heads/smollm2-135m-eagle3}
K=${K:-8}; TOPK=${TOPK:-2}; STEPS=${STEPS:-4}; STOP=${STOP:-0.2}; LOOKUP=${LOOKUP:-5}
mkdir -p "$OUT"
for set in mt_bench humaneval gsm8k; do
  rayspec bench offline --method eagle3 --draft-model "$HEAD" --num-speculative-tokens "$K" \
    --eagle-topk "$TOPK" --num-steps "$STEPS" --eagle-stop-prob "$STOP" --eagle-prompt-lookup "$LOOKUP" --prompts "$PROMPTS/$set.jsonl" --num-prompts 10 \
    --max-tokens 128 --no-hf --output-json "$OUT/offline_eagle3_$set.json"
done
# n-gram in the same sitting, for the "faster than ngram on every set" comparison
for set in mt_bench humaneval gsm8k; do
  rayspec bench offline --method ngram --num-speculative-tokens 5 --prompts "$PROMPTS/$set.jsonl" --num-prompts 10 \
    --max-tokens 128 --no-hf --output-json "$OUT/offline_ngram_${set}_with_eagle3.json"
done
python benchmarks/summarize.py "$OUT"/offline_eagle3_*.json "$OUT"/offline_ngram_*_with_eagle3.json
