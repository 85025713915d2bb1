"""The EAGLE proposer's time per drafting cycle with its depth forwards prepared once per cycle
(rayspec.model.tree_steps, EagleProposer.prepared_depths) against one forward_hidden per depth, side by side
in one process, interleaved (issue #50, item 2b's ground).

gpu_engine.py's oracle engine (the real EAGLE-3 proposer over a random head of the target's shapes, a random
target: tiny shapes by default, so the host's work dominates as it does on a GPU), 16-node trees 8 deep
(top-k 4) or chains (--topk 1), batch 1 and 4, eager and compiled (on CPU the compiled step is traced with
aot_eager: inductor's C++ builds take minutes). Each engine runs every batch once untimed (compiles), then
--rounds rounds alternate the two engines; per run the proposer's seconds (EngineStats.propose_seconds) over
the decode. Writes JSON (the median per cell and its ratio, every round) with the machine.

    python benchmarks/draft_depths.py --json benchmarks/results/draft_depths_<commit>.json
    python benchmarks/draft_depths.py --dry-run      # one batch, eager, 1 round (tests)
    python benchmarks/draft_depths.py --compare captured --json ...  # the depth loop from Python against the
        whole loop captured as one graph (rayspec.proposers.tree_graph; compiled engines)
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import gpu_engine  # noqa: E402
from gpu_roofline import build_ours  # noqa: E402

from rayspec.bench.environment import environment  # noqa: E402


# --compare: the two proposer variants side by side, (name, prepared_depths, captured_trees) each
COMPARISONS = {"prepared": (("per_depth", False, "off"), ("prepared", True, "off")),
               "captured": (("loop", True, "off"), ("captured", True, "on"))}


def engine_for(a, compiled: bool, prepared: bool, batch: int, captured: str = "off"):
    args = SimpleNamespace(device="cpu", dtype_name="float32", prompt_len=a.prompt_len, max_tokens=a.max_tokens,
                           batches=[batch], kv_gb=0.05, chunk=8192, defer_draft_reads="on", overlap="on",
                           nodes=a.nodes, topk=a.topk, depth=a.depth, tree_max_batch=32, draft_vocab=256, warm_tokens=8,
                           captured_trees=captured)
    model = build_ours(a.shape, torch.device("cpu"), torch.float32)
    engine = gpu_engine.oracle_engine(args, model, compiled)
    engine.proposer.prepared_depths, engine.proposer.p = prepared, 0.8  # (random target: the oracle's tokens miss)
    return engine


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shape", default="tiny")
    parser.add_argument("--batches", default="1,4")
    parser.add_argument("--modes", default="eager,compiled")
    parser.add_argument("--prompt-len", type=int, default=200)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--nodes", type=int, default=16)
    parser.add_argument("--depth", type=int, default=8)
    parser.add_argument("--topk", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--compare", default="prepared", choices=sorted(COMPARISONS),
                        help="prepared: a forward per depth against prepared once; captured: the prepared loop "
                             "from Python against the whole loop captured as one graph (compiled mode only)")
    parser.add_argument("--backend", default="aot_eager", help="torch.compile's backend on CPU (inductor: C++ builds)")
    parser.add_argument("--json", default=None)
    parser.add_argument("--dry-run", action="store_true")
    a = parser.parse_args()
    if a.compare == "captured":
        a.modes = "compiled"  # the captured loop is the compiled head's
    if a.dry_run:
        a.batches, a.rounds, a.max_tokens, a.prompt_len = "1", 1, 16, 40
        a.modes = "compiled" if a.compare == "captured" else "eager"
    torch.set_num_threads(1)
    from rayspec.model.compiled import CompiledForward
    CompiledForward.backend = a.backend
    (name_a, prep_a, cap_a), (name_b, prep_b, cap_b) = COMPARISONS[a.compare]
    rng = random.Random(0)
    vocab = gpu_engine.SHAPES[a.shape][0]
    cells = []
    for mode in a.modes.split(","):
        for batch in (int(b) for b in a.batches.split(",")):
            prompts = [[rng.randrange(3, vocab) for _ in range(a.prompt_len)] for _ in range(batch)]
            engines = {False: engine_for(a, mode == "compiled", prep_a, batch, cap_a),
                       True: engine_for(a, mode == "compiled", prep_b, batch, cap_b)}
            for p, engine in engines.items():
                gpu_engine.run_batch(engine, prompts, a.max_tokens, f"warm-{p}", 0, False)
            seconds = {False: [], True: []}
            for r in range(a.rounds):
                for p in ((False, True) if r % 2 == 0 else (True, False)):
                    engine = engines[p]
                    before = engine.stats.propose_seconds
                    gpu_engine.run_batch(engine, prompts, a.max_tokens, f"r{r}-{p}", 0, False)
                    seconds[p].append(engine.stats.propose_seconds - before)
            old, new = statistics.median(seconds[False]), statistics.median(seconds[True])
            cell = {"mode": mode, "batch": batch, f"{name_a}_s": round(old, 4), f"{name_b}_s": round(new, 4),
                    f"{name_b}_over_{name_a}": round(new / old, 3), "rounds": {name_a: seconds[False],
                                                                                name_b: seconds[True]}}
            cells.append(cell)
            print(f"{mode:9s} batch {batch}: proposer s per run {old:.3f} ({name_a}) -> {new:.3f} "
                  f"({name_b}): {new / old:.3f}x", flush=True)
    out = {"args": vars(a), "environment": environment(), "cells": cells,
           "note": "the proposer's seconds over a run's decode (EngineStats.propose_seconds), median of the rounds"}
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
