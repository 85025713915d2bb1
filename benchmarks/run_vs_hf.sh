#!/usr/bin/env bash
# #23's speed goal: our float32 baseline vs HF transformers' generate(), and n-gram vs HF prompt lookup,
# greedy, 128 new tokens, 10 prompts of each set, interleaved prompt by prompt (rayspec bench offline).
# The JSONs record the CPU model, its matmul features, the versions and the CPU matmul path chosen.
# Usage (inside .venv): benchmarks/run_vs_hf.sh [prompts-dir] [output-dir]
set -euo pipefail
cd "$(dirname "$0")/.."
PROMPTS=${1:-rayspec/data/prompts}  # the bundled evaluation sets
OUT=${2:-benchmarks/results/vs_hf}
mkdir -p "$OUT"
for set in mt_bench humaneval gsm8k; do
  rayspec bench offline --method ngram --num-speculative-tokens 5 --prompts "$PROMPTS/$set.jsonl" \
    --num-prompts 10 --max-tokens 128 --output-json "$OUT/ngram_$set.json"
done
python - "$OUT" <<'PY'
import json, pathlib, sys
for f in sorted(pathlib.Path(sys.argv[1]).glob("ngram_*.json")):
    r = json.loads(f.read_text())
    print(f"{f.stem}: baseline/HF {r['baseline_vs_hf']:.2f}x, ngram/HF prompt lookup {r['method_vs_hf_assisted']:.2f}x, "
          f"greedy_match {r['greedy_match']} hf_greedy_match {r['hf_greedy_match']} ({r['environment']['cpu_model']}, {r['cpu_kernels']})")
PY
