#!/usr/bin/env bash
# Speculation that never loses (issue #34): each proposer at its shipped settings against the target
# alone, on every prompt set (the three favourable ones, and the adversarial unguessable and
# long_documents), greedy and at temperature 1 (unseeded, as served requests come), at concurrency 1
# and 8. Offline, in-process; every batch of prompts runs the baseline and each method in turn
# (`rayspec bench sweep` interleaves them), one torch thread. Writes
# benchmarks/results/never_loses_<proposers>_<set>_t<T>.json, then a table of the ratios:
#   benchmarks/run_never_loses.sh [NUM_PROMPTS] [MAX_TOKENS]     (default 8 64)
#   SETS="mt_bench unguessable" TEMPS=1 PROPOSERS=eagle3 benchmarks/run_never_loses.sh 8 32   (subsets)
#   ROUNDS=3 benchmarks/run_never_loses.sh   (each sweep's batches 3 times over, interleaved; default 1)
#   CONCURRENCY=8 ROUNDS=8 benchmarks/run_never_loses.sh   (one level, more rounds: a batch of 8 runs in ~3 s,
#     +-4% apart run to run on the 2-core AMD EPYC, so a concurrency-8 ratio needs several rounds; file names end _c8)
#   SEEDED=1 TEMPS=1 benchmarks/run_never_loses.sh   (seeded requests: each run emits the baseline's tokens
#     exactly, so both do the same work; unseeded, the runs sample their own outputs and EOS ends a
#     different set of sequences each time: at concurrency 8 a noise of its own, 0.79-0.95x seen for an
#     engine that drafted nothing). Writes never_loses_<proposers>_<set>_t<T>_seeded.json
# Proposers: eagle3 = configs/default.yaml's tree (8 nodes, top-2, 4 deep, stop below 0.2, a 5-token
# prompt-lookup branch, no drafts at batch >= 3); chains = n-gram and the draft model of
# configs/draft_model.yaml (the target's first 8 layers) at k = 4.
set -euo pipefail
cd "$(dirname "$0")/.."
N=${1:-8}
MAX=${2:-64}
PY=${PYTHON:-python}
OUT=${OUT:-benchmarks/results}
TREE=(--methods eagle3 --num-speculative-tokens 8 --eagle-topk 2 --num-steps 4 --eagle-stop-prob 0.2
      --eagle-prompt-lookup 5 --disable-by-batch-size 3)
CHAINS=(--methods ngram,draft_model --num-speculative-tokens 4 --draft-num-layers 8)
files=()
for set in ${SETS:-mt_bench humaneval gsm8k unguessable long_documents}; do
  for t in ${TEMPS:-0 1}; do
    for proposers in ${PROPOSERS:-eagle3 chains}; do
      if [ "$proposers" = eagle3 ]; then flags=("${TREE[@]}"); else flags=("${CHAINS[@]}"); fi
      suffix=""
      if [ "$t" != 0 ] && [ "${SEEDED:-0}" = 1 ]; then
        suffix=_seeded
      elif [ "$t" != 0 ]; then
        flags+=(--unseeded)
      fi
      [ -z "${CONCURRENCY:-}" ] || suffix+="_c${CONCURRENCY//,/-}"
      out="$OUT/never_loses_${proposers}_${set}_t${t}${suffix}.json"
      echo "== $proposers, $set, temperature $t -> $out" >&2
      $PY -m rayspec_cli bench sweep "${flags[@]}" --prompts "$set" --num-prompts "$N" --max-tokens "$MAX" \
        --temperature "$t" --concurrency "${CONCURRENCY:-1,8}" --num-threads 1 --rounds "${ROUNDS:-1}" --output-json "$out"
      files+=("$out")
    done
  done
done
$PY benchmarks/never_loses_table.py "${files[@]}"
