"""The paged cache's books cost a decode step the same whatever the pool's size (rayspec.kv.block_manager):
a sequence growing into the block after its last (`_take`'s prefer: nearly every block a decode takes,
often the one it gave back a step before) takes it off the free stack in O(1).

Timed as a ratio, the same batch's books per decode step with 200,000 free blocks beside it against
2,000 (benchmarks/block_books.py's decode pattern), best of three tries against a loaded machine's noise:
flat is about 1. On a54e25d (the free stack a list, the block removed by list.remove, which scans it
from the front while the block given back last sits at its end) the ratio was 61x (Intel Xeon: 0.37 ms
a step of batch 32 at 2,000 free blocks, 22.9 ms at 200,000); a GPU's KV budget leaves 30,000-50,000
blocks for Llama-3.1-8B (`benchmarks/results/block_books_session25.json`).
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import block_books  # noqa: E402  (benchmarks/block_books.py)
from rayspec.kv import block_manager  # noqa: E402
from rayspec.kv.block_manager import BlockManager  # noqa: E402

FLAT = 3.0


def test_books_per_step_do_not_grow_with_the_free_pool():
    best = float("inf")
    for attempt in range(3):
        small, large = (block_books.decode_steps(block_manager, free, batch=8, context=256, steps=20, tree_rows=9,
                                                 block_size=16, prefix_caching=True, seed=attempt)
                        for free in (2_000, 200_000))
        best = min(best, large / small)
        if best < FLAT:
            break
    assert best < FLAT, f"books per step {best:.1f}x slower beside 200,000 free blocks than beside 2,000"


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_free_stack_order_is_last_given_back_first(prefix_caching):
    """The stack's order, which keeps a sequence's blocks consecutive: the block given back last is
    taken first, a preferred block leaves from anywhere in it, the others keep their order."""
    books = BlockManager(8, 4, enable_prefix_caching=prefix_caching)
    books.allocate("a")
    books.grow("a", 12)
    assert books.tables["a"] == [0, 1, 2]  # each the block after the last
    books.allocate("b")
    books.grow("b", 4)
    assert books.tables["b"] == [3]
    books.shrink("a", 4)  # 2 then 1 given back: 1 on top
    books.allocate("c")
    books.grow("c", 4)
    assert books.tables["c"] == [1]
    books.grow("a", 8)  # prefers 1 (held), takes the top: 2
    assert books.tables["a"] == [0, 2]
    books.grow("a", 12)  # prefers 3 (held by b): the top, 4
    assert books.tables["a"] == [0, 2, 4]
    books.grow("c", 8)  # prefers 2 (held): the top, 5
    books.free("b")  # 3 back, on top
    books.grow("c", 12)  # prefers 6, free: taken from under 3
    assert books.tables["c"] == [1, 5, 6] and books.num_free_blocks == 2
    books.allocate("d")
    books.grow("d", 8)  # the top first (3, given back last), then the block after it is taken: 7
    assert books.tables["d"] == [3, 7] and books.num_free_blocks == 0
