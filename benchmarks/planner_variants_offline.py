"""`rayspec bench offline` with a candidate planner change patched in (an experiment, not the engine):
the real-engine side of benchmarks/planner_sim.py's variants.

    python benchmarks/planner_variants_offline.py VARIANT <bench offline arguments...>

VARIANT: current (the planner as shipped), nocal (DraftPlanner.calibration 1), ucb-nocal (also each
level's acceptance at its posterior mean + 1 standard deviation, as planner_sim.py's). The session note
of 2026-12-03 ran, alternating, two rounds of each (and the same arguments with --no-adaptive):

    for v in current nocal ucb-nocal; do python benchmarks/planner_variants_offline.py $v bench offline \\
      --method eagle3 --draft-model heads/smollm2-135m-eagle3 --num-speculative-tokens 8 --eagle-topk 2 \\
      --num-steps 4 --eagle-prompt-lookup 5 --prompts mt_bench --num-prompts 8 --concurrency 1 \\
      --max-tokens 64 --no-hf --num-threads 2 --adaptive --output-json /tmp/$v.json; done
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]

import rayspec.engine.drafting as dr  # noqa: E402
from planner_sim import optimistic_rates  # noqa: E402  (benchmarks/planner_sim.py)


def main() -> int:
    variant, args = sys.argv[1], sys.argv[2:]
    if variant not in ("current", "nocal", "ucb-nocal"):
        raise SystemExit(f"unknown variant {variant!r}")
    if variant in ("nocal", "ucb-nocal"):
        dr.DraftPlanner.calibration = lambda self, shape, greedy: 1.0
    if variant == "ucb-nocal":
        dr.Acceptance.rates = lambda self, own, shape, greedy, depth: optimistic_rates(self, own, shape, greedy, depth)
    from rayspec_cli.main import main as cli

    return cli(args)


if __name__ == "__main__":
    sys.exit(main())
