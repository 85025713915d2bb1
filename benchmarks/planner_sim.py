"""The cost-aware planner against fixed draft budgets, simulated (issue #50: "the planner within 5% of
the best fixed draft length"): no model, no timer, the same numbers on every machine.

    python benchmarks/planner_sim.py                       # the planner as it is
    python benchmarks/planner_sim.py --variant current ucb-nocal   # and candidate changes (VARIANTS)
    python benchmarks/planner_sim.py --output-json benchmarks/results/planner_sim.json

One sequence at a time (concurrency 1), `--requests` requests of `--tokens` tokens each, an EAGLE-3
tree of configs/default.yaml's shape (8 nodes, topk 2, 4 levels). A draft of depth d accepts its
first n levels with probability alpha_1 ... alpha_n (1 - alpha_{n+1}): the true acceptance per
level, one profile per row (PROFILES). Step costs are ModelledCosts (COSTS: an 8-node tree step
costs ~1.6x a one-row step, as measured for SmolLM2 on the AMD EPYC, benchmarks/results/
planner_c1_*.json), so every budget's worth is known exactly: the output is tokens per modelled
second against a plain decode step's, for the planner, for each fixed budget, and the best of them
(budget 0 included: not drafting at all). Seeds 0..--seeds-1, averaged.

Variants (candidate changes, patched in here; none is the engine's):
- current: the planner as shipped (each level's acceptance at its posterior mean, the estimates
  scaled by the calibration: what the planned drafts accepted over what was expected of them);
- nocal: without the calibration;
- ucb: each level at its posterior mean + --optimism standard deviations (the sequence's and the
  pool's draws as the evidence), calibrated;
- ucb-nocal: both;
- ucb1-nocal: the optimism on the first level only, uncalibrated.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import rayspec.engine.drafting as drafting  # noqa: E402
from rayspec.engine.drafting import DraftPlanner, ModelledCosts, PlanInput, SeqDraftState  # noqa: E402

COSTS = {"step_s": 0.010, "multirow_s": 0.0035, "row_s": 0.0002, "propose_s": 0.0002, "propose_depth_s": 0.0004}
PROFILES = [[0.70, 0.65, 0.60, 0.60], [0.55, 0.50, 0.45, 0.40], [0.45, 0.45, 0.40, 0.40],
            [0.35, 0.30, 0.30, 0.30], [0.20, 0.20, 0.20, 0.20], [0.05, 0.05, 0.05, 0.05]]
VARIANTS = ("current", "nocal", "ucb", "ucb-nocal", "ucb1-nocal")


def optimistic_rates(acc, own, shape, greedy, depth, z: float = 1.0, levels: int | None = None) -> list[float]:
    """Acceptance.rates (`acc` an Acceptance) at the posterior mean + z standard deviations, on the first
    `levels` levels (None: all); the sequence's and the pool's draws as the evidence."""
    pool, out = acc.pool.get((shape, greedy)), []
    for d in range(depth):
        pa, pt = pool.get(d) if pool is not None else (0.0, 0.0)
        prior = (pa + drafting.PRIOR_MEAN * drafting.PRIOR_WEIGHT) / (pt + drafting.PRIOR_WEIGHT)
        a, t = own.get(d) if own is not None else (0.0, 0.0)
        m = (a + prior * drafting.POOL_WEIGHT) / (t + drafting.POOL_WEIGHT)
        if levels is None or d < levels:
            m = min(1.0, m + z * (m * (1 - m) / (t + pt + drafting.PRIOR_WEIGHT + 1)) ** 0.5)
        out.append(m)
    return out


def make_planner(variant: str, optimism: float = 1.0) -> DraftPlanner:
    planner = DraftPlanner(8, ModelledCosts(COSTS), topk=2, max_depth=4, probe_share=0.02)
    if variant.endswith("nocal"):
        planner.calibration = lambda shape, greedy: 1.0
    if variant.startswith("ucb"):
        acc, levels = planner.acceptance, 1 if variant.startswith("ucb1") else None
        acc.rates = lambda own, shape, greedy, depth: optimistic_rates(acc, own, shape, greedy, depth, optimism, levels)
    return planner


def run(alphas, budget: int | None, variant: str, seed: int, requests: int, tokens: int, optimism: float = 1.0
        ) -> tuple[float, int]:
    """(tokens per modelled second, drafts made): budget None: the planner's; else that fixed budget."""
    rng = np.random.default_rng(seed)
    planner = make_planner(variant, optimism)
    costs = planner.costs
    seconds = out = drafts = 0
    for _ in range(requests):
        state, made, context = SeqDraftState(), 1, 200
        while made < tokens:
            cap = min(8, tokens - made - 1)
            b = planner.plan([PlanInput(state, True, context, cap)], tree=True)[0] if budget is None else min(budget, cap)
            n = 0
            if b:
                depth = planner.depth(b, True)
                while n < depth and rng.random() < alphas[n]:
                    n += 1
                planner.observe(state, True, True, depth, n)
                drafts += 1
                seconds += costs.verify_s(1, 1 + b, (1 + b) * context) + costs.propose_s(planner.proposer_depth(b, True), 1)
            else:
                seconds += costs.verify_s(1, 1, context)
            made, context, out = made + 1 + n, context + 1 + n, out + 1 + n
    return out / seconds, drafts


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variant", choices=VARIANTS, nargs="+", default=["current"])
    parser.add_argument("--optimism", type=float, default=1.0, help="the ucb variants' standard deviations")
    parser.add_argument("--seeds", type=int, default=20)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--output-json")
    args = parser.parse_args(argv)
    plain = 1 / COSTS["step_s"]
    rows = []
    for alphas in PROFILES:
        fixed = {b: float(np.mean([run(alphas, b, "current", s, args.requests, args.tokens)[0]
                                   for s in range(args.seeds)])) / plain for b in (0, 2, 4, 6, 8)}
        best = max(fixed, key=fixed.get)
        row = {"alphas": alphas, "fixed": {str(b): round(v, 4) for b, v in fixed.items()}, "best_fixed": best}
        for variant in args.variant:
            runs = [run(alphas, None, variant, s, args.requests, args.tokens, args.optimism) for s in range(args.seeds)]
            speed = float(np.mean([r for r, _ in runs])) / plain
            row[variant] = {"speedup": round(speed, 4), "vs_best_fixed": round(speed / fixed[best], 4),
                            "drafts": round(float(np.mean([d for _, d in runs])), 1)}
        rows.append(row)
        print(f"alphas {alphas}: fixed " + " ".join(f"{b}:{v:.3f}" for b, v in fixed.items()) + "  planner " +
              "  ".join(f"{v}: {row[v]['speedup']:.3f} ({row[v]['vs_best_fixed']:.3f} of best, {row[v]['drafts']:.0f} drafts)"
                        for v in args.variant))
    report = {"what": "cost-aware planner vs fixed budgets, simulated (ModelledCosts, EAGLE-3 tree 8/topk 2/depth 4, c1)",
              "command": "python benchmarks/planner_sim.py " + " ".join(sys.argv[1:] if argv is None else argv),
              "costs": COSTS, "optimism": args.optimism, "seeds": args.seeds, "requests": args.requests, "tokens": args.tokens, "rows": rows}
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(report, indent=2) + "\n")
    return report


if __name__ == "__main__":
    main()
