"""The paged cache's books per decode step (rayspec.kv.block_manager.BlockManager), this checkout's against
another commit's, side by side in one process, interleaved: B sequences decoding in lockstep as a tree
verification leaves them (each step: grow to cover the tree's rows past the context, shrink back to the
accepted tokens, commit them), in pools of growing size (the free blocks a GPU's KV budget leaves). Each
sequence finds the blocks after its own free (its room, as the engine's sequences find it), so it grows
consecutively: the block it takes is the one after its last (`_take`'s prefer), often the one it gave back
a step before.

    python benchmarks/block_books.py --json benchmarks/results/block_books_<tag>.json
    python benchmarks/block_books.py --dry-run       # small pools, a few steps (tests/unit)

Per (pool, side): microseconds of books per decode step (the batch's), median over --rounds rounds.
The other side's block_manager.py is read with `git show REV:rayspec/kv/block_manager.py` (default: the
last commit before its free list became a dict, a54e25d).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks")]

from revisions import module_at  # noqa: E402

from rayspec.kv import block_manager as current  # noqa: E402

BASELINE = "a54e25d"


def decode_steps(module, free_blocks: int, batch: int, context: int, steps: int, tree_rows: int, block_size: int,
                 prefix_caching: bool, seed: int) -> float:
    """Seconds of books for `steps` decode steps of `batch` sequences of `context` tokens each."""
    rng = random.Random(seed)
    per_seq = -(-(context + steps * tree_rows + tree_rows) // block_size)
    books = module.BlockManager(free_blocks + batch * per_seq, block_size, enable_prefix_caching=prefix_caching)
    tokens, lengths = {}, {}
    for b in range(batch):
        sid = f"s{b}"
        tokens[sid] = [rng.randrange(32000) for _ in range(context)]
        books.allocate(sid, tokens[sid])
        books.grow(sid, per_seq * block_size)  # every sequence's blocks after its context taken, then given back:
    for sid in tokens:  # the room each grows into, as the engine's sequences find it (`_take`'s prefer)
        books.shrink(sid, context)
        books.commit(sid, tokens[sid], context)
        lengths[sid] = context
    accepted = [rng.randint(1, 5) for _ in range(steps * batch)]
    started = time.perf_counter()
    i = 0
    for _ in range(steps):
        for sid in tokens:
            n = lengths[sid]
            books.grow(sid, n + tree_rows)  # the tree's rows past the context
            keep = n + accepted[i]
            i += 1
            books.shrink(sid, keep)  # the accepted path's rows kept, the rest given back
            tokens[sid] += [7] * (keep - n)
            books.commit(sid, tokens[sid], keep)
            lengths[sid] = keep
    return time.perf_counter() - started


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--baseline", default=BASELINE, help="the commit whose block_manager.py is the other side")
    parser.add_argument("--pools", default="2000,20000,200000", help="free blocks beside the batch's (commas)")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--tree-rows", type=int, default=9, help="rows a verification writes past the context")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--prefix-caching", choices=("on", "off"), default="on")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dry-run", action="store_true")
    parser.add_argument("--json")
    a = parser.parse_args(argv)
    pools = [int(p) for p in a.pools.split(",")]
    if a.dry_run:
        pools, a.batch, a.context, a.steps, a.rounds = [100, 1000], 4, 64, 5, 1
    sides = {"this checkout": current, a.baseline: module_at(a.baseline, "rayspec/kv/block_manager.py")}
    from rayspec.bench.environment import cpu_model

    rows = []
    for pool in pools:
        seconds = {name: [] for name in sides}
        for r in range(a.rounds):
            order = list(sides) if r % 2 == 0 else list(reversed(sides))
            for name in order:
                seconds[name].append(decode_steps(sides[name], pool, a.batch, a.context, a.steps, a.tree_rows,
                                                  a.block_size, a.prefix_caching == "on", seed=r))
        row = {"free_blocks": pool}
        for name in sides:
            row[f"{name} us_per_step"] = round(statistics.median(seconds[name]) / a.steps * 1e6, 1)
        row["ratio"] = round(row["this checkout us_per_step"] / row[f"{a.baseline} us_per_step"], 3)
        rows.append(row)
        print(f"free blocks {pool:7d}: " + "  ".join(f"{name} {row[f'{name} us_per_step']:8.1f} us/step" for name in sides)
              + f"  ({row['ratio']:.2f}x)", flush=True)
    report = {"what": "the paged cache's books (BlockManager grow/shrink/commit) per decode step of a batch, "
                      "this checkout against another commit's, interleaved", "cpu_model": cpu_model()[0],
              "cpu_count": os.cpu_count(), "command": "python benchmarks/block_books.py " + " ".join(
                  sys.argv[1:] if argv is None else argv),
              "baseline": a.baseline, "batch": a.batch, "context": a.context, "steps": a.steps,
              "tree_rows": a.tree_rows, "prefix_caching": a.prefix_caching, "rounds": a.rounds, "rows": rows}
    if a.json:
        Path(a.json).write_text(json.dumps(report, indent=2) + "\n")
    return report


if __name__ == "__main__":
    main()
