#!/usr/bin/env bash
# Issue 20: asynchronous drafting against its synchronous twin, served, c=CONC, greedy, MAX_TOKENS
# tokens, on MT-bench, HumanEval and GSM8K (N prompts each), the apps taking turns (BENCH:
# benchmarks/async_eagle_bench.yaml, EAGLE-3; benchmarks/async_bench.yaml, draft_model; ENDPOINTS
# picks which apps; ROUNDS rounds per set, the apps' order rotating). Each app's step-time
# breakdown, acceptance and the proposer's speculation-cache
# counts go to $OUT/${TAG}_stats.json (benchmarks/async_serve.py, which runs a Ray instance of its own).
set -euo pipefail
cd "$(dirname "$0")/.."
python benchmarks/async_serve.py "${BENCH:-benchmarks/async_eagle_bench.yaml}" --apps ${ENDPOINTS:-sync async} \
  --num-prompts "${N:-5}" --max-tokens "${MAX_TOKENS:-128}" --concurrency "${CONC:-1}" --waves "${WAVES:-1}" --rounds "${ROUNDS:-1}" \
  --out "${OUT:-benchmarks/results}" --tag "${TAG:-async}"
