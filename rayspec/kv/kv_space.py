"""KVSpace: the books of one paged KV pool, in one place (no tensors).

Which sequences hold a place (at most num_slots), which blocks each holds (rayspec.kv.block_manager),
how many of its positions hold valid keys and values (its cached length), and the rows the device
has to move before the next forward reads them (copy-on-write, a relocated prefix, an accepted tree
path). Whoever decides what runs owns it: the Scheduler for the target's pool, a proposer for its
own (a draft model's, an EAGLE head's). A ModelRunner is handed one and only reads it (block tables
and cached lengths into a forward's index tensors), except that a forward's written rows extend the
cached length it was asked to extend and take the blocks they need; it moves the queued rows
(`pop_moves`) on its device tensors before each forward.
"""

from __future__ import annotations

import itertools
import operator

import numpy as np

from rayspec.kv.block_manager import BlockManager

SCRATCH_BLOCK = 0  # padding tokens write here, positions past a row's blocks read from it (masked)
DEFAULT_BLOCK_SIZE = 16


class CacheFullError(RuntimeError):
    pass


def default_num_blocks(num_slots: int, capacity: int, block_size: int) -> int:
    """The blocks that hold num_slots sequences of `capacity` positions each (the slot cache's size)."""
    return num_slots * -(-capacity // block_size)


def proposer_num_blocks(target_blocks: int | None, num_slots: int, capacity: int, slack: int,
                        block_size: int = DEFAULT_BLOCK_SIZE) -> int:
    """A proposer's pool beside a target pool of target_blocks: as many blocks plus a sequence's
    slack (drafts, tree nodes) per slot, at most num_slots whole sequences of `capacity`. None (a
    proposer deployment serving any verifier): num_slots whole sequences."""
    whole = default_num_blocks(num_slots, capacity, block_size)
    return whole if target_blocks is None else min(whole, target_blocks + num_slots * -(-slack // block_size))


class KVSpace:
    def __init__(self, max_model_len: int, num_slots: int, slack: int, num_blocks: int | None = None,
                 block_size: int = DEFAULT_BLOCK_SIZE, enable_prefix_caching: bool = False):
        """num_slots: the most sequences held at once; slack: extra positions past max_model_len,
        written by speculative/padded queries; num_blocks: the pool's blocks (None: enough for
        num_slots sequences of max_model_len + slack), one scratch block (SCRATCH_BLOCK) besides."""
        self.max_model_len = max_model_len
        self.capacity = max_model_len + slack  # positions one sequence may write
        self.num_slots = num_slots
        self.block_size = block_size
        if num_blocks is None:
            num_blocks = default_num_blocks(num_slots, self.capacity, block_size)
        self.blocks = BlockManager(num_blocks, block_size, enable_prefix_caching, first_block=SCRATCH_BLOCK + 1)
        self.max_blocks = -(-self.capacity // block_size)  # a block table's width (a static shape)
        self._cached_len: dict[str, int] = {}  # tokens whose KV is valid, per sequence
        # rows to move before the next forward: ([source rows], [destination rows]) in order
        self._moves: list[tuple[np.ndarray, np.ndarray]] = []

    # ---- counts ----------------------------------------------------------------------------------
    @property
    def num_pool_blocks(self) -> int:
        """Blocks of the device tensors: the pool's and the scratch block."""
        return self.blocks.num_blocks + 1

    @property
    def num_free_slots(self) -> int:
        """Sequences that may still join (max_num_seqs); whether their tokens fit is num_free_blocks'."""
        return self.num_slots - len(self._cached_len)

    @property
    def num_free_blocks(self) -> int:
        return self.blocks.num_free_blocks

    @property
    def num_blocks(self) -> int:
        return self.blocks.num_blocks

    @property
    def prefix_caching(self) -> bool:
        return self.blocks.enable_prefix_caching

    def kv_cache_usage(self) -> float:
        """The fraction of the pool's blocks held by sequences (cached blocks nobody holds are free)."""
        return self.blocks.num_used_blocks / self.blocks.num_blocks

    def blocks_for(self, num_tokens: int) -> int:
        return self.blocks.blocks_for(num_tokens)

    # ---- sequences -------------------------------------------------------------------------------
    def has(self, seq_id: str) -> bool:
        return seq_id in self._cached_len

    def table(self, seq_id: str) -> list[int]:
        return self.blocks.tables[seq_id]

    def allocate(self, seq_id: str, token_ids: list[int] | None = None, max_cached: int | None = None,
                 cache_salt: str | None = None) -> int:
        """Take a place for seq_id; with prefix caching and its token_ids, its cached prefix (full
        blocks, at least one token left to compute, at most max_cached tokens) is found and counts as
        computed. Returns the cached length it starts with."""
        if seq_id in self._cached_len:
            return self._cached_len[seq_id]
        if self.num_free_slots == 0:
            raise CacheFullError("no free KV cache slot")
        self._cached_len[seq_id] = self.blocks.allocate(seq_id, token_ids, max_cached, cache_salt)
        return self._cached_len[seq_id]

    def free(self, seq_id: str) -> None:
        if self._cached_len.pop(seq_id, None) is not None:
            self.blocks.free(seq_id)

    def can_grow(self, seq_id: str, num_tokens: int) -> bool:
        return self.blocks.can_grow(seq_id, num_tokens)

    def grow(self, seq_id: str, num_tokens: int) -> bool:
        """Blocks for positions up to num_tokens of seq_id; False (none taken) when the pool lacks them."""
        if num_tokens > self.capacity:
            raise CacheFullError(f"sequence {seq_id} exceeds the cache capacity")
        grown = self.blocks.grow(seq_id, num_tokens)
        self._queue_blocks(self.blocks.pop_copies())  # (a shared prefix moved to where it grows on)
        return grown

    def cached_len(self, seq_id: str) -> int:
        return self._cached_len[seq_id]

    def set_cached_len(self, seq_id: str, n: int) -> None:
        """Keep the first n cached tokens (n may also extend over rows a forward wrote); later
        positions are garbage, overwritten next time (whole blocks past them go back to the pool)."""
        if n > len(self.blocks.tables[seq_id]) * self.block_size:
            raise ValueError(f"sequence {seq_id} has no KV cached up to {n}")
        self._cached_len[seq_id] = n
        self._queue_blocks(self.blocks.shrink(seq_id, n))

    def extend(self, seq_id: str, n: int) -> None:
        """A forward wrote positions up to n (its blocks held): they count as cached."""
        self._cached_len[seq_id] = n

    def commit(self, seq_id: str, token_ids: list[int]) -> None:
        """token_ids are seq_id's verified tokens: its full blocks among the cached ones may be shared
        (prefix caching; never a block holding draft or tree rows past them)."""
        if self.blocks.enable_prefix_caching and seq_id in self._cached_len:
            self.blocks.commit(seq_id, token_ids, self._cached_len[seq_id])

    def keep_paths(self, paths: list[tuple[str, list[int]]]) -> None:
        """After tree forwards: each sequence keeps the accepted nodes (tree-relative rows, in path
        order) right after its prefix (their rows queued to move there) and its cached length grows
        over them."""
        src, dst = [], []
        bs = self.block_size
        for seq_id, tree_rows in paths:
            if tree_rows != list(range(len(tree_rows))):
                start, table = self._cached_len[seq_id], self.blocks.tables[seq_id]
                src += [table[p // bs] * bs + p % bs for p in (start + r for r in tree_rows)]
                dst += [table[p // bs] * bs + p % bs for p in range(start, start + len(tree_rows))]
        if src:
            self._moves.append((np.asarray(src, dtype=np.int64), np.asarray(dst, dtype=np.int64)))
        for seq_id, tree_rows in paths:
            self.set_cached_len(seq_id, self._cached_len[seq_id] + len(tree_rows))

    def pop_moves(self) -> list[tuple[np.ndarray, np.ndarray]]:
        """The rows to move, in order, before the next forward reads the pool: (sources, destinations)
        per move. The runner that holds the pool's tensors takes them."""
        moves, self._moves = self._moves, []
        return moves

    def _queue_blocks(self, copies: list[tuple[int, int]]) -> None:
        if copies:
            bs = self.block_size
            src = np.array([b * bs + r for b, _ in copies for r in range(bs)], dtype=np.int64)
            dst = np.array([b * bs + r for _, b in copies for r in range(bs)], dtype=np.int64)
            self._moves.append((src, dst))

    # ---- reading ---------------------------------------------------------------------------------
    def consecutive(self, seq_id: str, kv_len: int) -> bool:
        """seq_id's first kv_len positions lie in consecutive blocks (its keys read as a view)."""
        table, n = self.blocks.tables[seq_id], -(-kv_len // self.block_size)
        # compared in C, nothing copied (a lone sequence asks at every forward)
        return len(table) >= n and all(map(operator.eq, itertools.islice(table, n), range(table[0], table[0] + n)))

    def rows(self, seq_ids: list[str], kv_len: int) -> np.ndarray:
        """[B, kv_len] int64: the pool row of each sequence's positions 0..kv_len-1 (past its blocks:
        scratch)."""
        bs, table = self.block_size, self.covering_blocks(seq_ids, kv_len)
        return (table[:, :, None] * bs + np.arange(bs)).reshape(len(seq_ids), -1)[:, :kv_len]

    def covering_blocks(self, seq_ids: list[str], kv_len: int) -> np.ndarray:
        """[B, ceil(kv_len / block_size)] int64: the blocks holding each sequence's positions
        0..kv_len-1 (past its blocks: scratch), which `rows` spreads into rows (a runner does that on
        the device: a forward's host work is then a block per block_size positions, not a row each)."""
        nb = -(-kv_len // self.block_size)
        table = np.full((len(seq_ids), nb), SCRATCH_BLOCK, dtype=np.int64)
        for b, s in enumerate(seq_ids):
            blocks = self.blocks.tables[s]
            table[b, : len(blocks)] = blocks if len(blocks) <= nb else blocks[:nb]
        return table

    def block_tables(self, seq_ids: list[str], num_rows: int) -> np.ndarray:
        """[num_rows, max_blocks] int64: the sequences' block tables (scratch past a row's blocks, and
        for rows past len(seq_ids))."""
        table = np.full((num_rows, self.max_blocks), SCRATCH_BLOCK, dtype=np.int64)
        for b, s in enumerate(seq_ids):
            blocks = self.blocks.tables[s][: self.max_blocks]
            table[b, : len(blocks)] = blocks
        return table

