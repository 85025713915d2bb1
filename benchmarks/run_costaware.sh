#!/usr/bin/env bash
# Cost-aware drafting (issue #34 item 1): configs/default.yaml's EAGLE-3 tree settings with the
# draft planner (the new default) and with the full tree every step (--no-adaptive: what the
# engine did before at batch <= tree_max_batch), each interleaved batch by batch with the target
# alone, on MT-bench and on the unguessable set, greedy and at temperature 1 (unseeded, as served
# requests come); then EAGLE-3 chains at k = 1, 2, 4, planned and fixed (the sweep of
# sweep_smollm2_mt_bench*.json). One torch thread. Writes benchmarks/results/costaware_*.json.
#   benchmarks/run_costaware.sh [NUM_PROMPTS] [MAX_TOKENS]   (SETS, TEMPS, MODES, CHAINS: subsets)
set -euo pipefail
cd "$(dirname "$0")/.."
N=${1:-6}
MAX=${2:-64}
PY=${PYTHON:-python}
TREE=(--methods eagle3 --num-speculative-tokens 8 --eagle-topk 2 --num-steps 4 --eagle-stop-prob 0.2
      --eagle-prompt-lookup 5 --disable-by-batch-size 3)
for set in ${SETS:-mt_bench unguessable}; do
  for t in ${TEMPS:-0 1}; do
    for mode in ${MODES:-default fixed}; do
      flags=(); [ "$mode" = fixed ] && flags=(--no-adaptive)
      $PY -m rayspec_cli bench sweep "${TREE[@]}" "${flags[@]}" --prompts "$set" --num-prompts "$N" \
        --max-tokens "$MAX" --temperature "$t" --unseeded --num-threads 1 \
        --output-json "benchmarks/results/costaware_${mode}_${set}_t${t}.json"
    done
  done
done
for mode in ${CHAINS:-default fixed}; do
  flags=(); [ "$mode" = fixed ] && flags=(--no-adaptive)
  $PY -m rayspec_cli bench sweep --methods eagle3 --num-speculative-tokens 1,2,4 "${flags[@]}" --prompts mt_bench \
    --num-prompts "$N" --max-tokens "$MAX" --num-threads 1 --output-json "benchmarks/results/costaware_chains_${mode}_mt_bench_t0.json"
done
