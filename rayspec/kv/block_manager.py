"""BlockManager: the paged KV cache's bookkeeping (no tensors): a pool of fixed-size blocks, a block
table per sequence, reference counts, and automatic prefix caching.

A sequence's token at position p lives in block table[p // block_size], row p % block_size. Blocks
are taken as a sequence grows and given back when it ends or its cached length shrinks past whole
blocks. With prefix caching, a full block of *verified* tokens is registered under the hash of the
whole token prefix it ends (a chain: the previous block's hash and this block's tokens), so a later
sequence with the same prefix starts with those blocks shared (their reference count says by how
many). A registered block nobody holds stays in an LRU and is evicted only when the free list is
empty. Blocks holding unverified rows (drafts, tree nodes) are never registered: the caller commits
only the tokens it has verified.

A growing sequence takes the block after its last where it can, so a lone sequence's keys read as a
view of the pool (`_take`). Where that block starts another request's cached text after the same
prefix, that text is evicted only when it is short beside the prefix (EVICT_TAIL_RATIO: a prompt
asked again, whose earlier answer follows it); otherwise the sequence's prefix blocks are copied to
the start of a free run (`_relocate`; the runner copies their rows) and the other chain stays whole.
Both only for a table that is still a cached prefix alone: once a sequence has taken blocks of its
own it grows wherever blocks are free (its full blocks are registered as they fill, and sequences
decoding side by side, each next block taken by a neighbour, were copying their whole context at
every block boundary).
Evicting it always, each new conversation after a shared system prompt took the previous
conversation's blocks, and its whole cached prefix with them (8 documents of 1,600 tokens served
twice: 6 of 8 recomputed the second time behind an EAGLE head, 0.68x the base's tok/s).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

import numpy as np

# a prefix of at most this many tokens is copied for a sequence whoever else holds it; a longer one
# only where the sequence holds it alone (the copies' memory is then one sequence's)
RELOCATE_MAX_TOKENS = 256
# another request's cached text after a prefix is evicted for consecutiveness only when the prefix is
# this many times longer (a block's recomputation costs hundreds of times its copy, and the evicted
# text is lost only if asked for again)
EVICT_TAIL_RATIO = 16
_RUN_SCAN = 4096  # free blocks tried as the start of a run before a relocation gives up

def chain_root(cache_salt: str | None) -> bytes:
    """Where a sequence's hash chain starts: b"" without a salt; with one (vLLM's `cache_salt`, one
    per tenant) a root of its own, so its blocks are found only by requests with the same salt.
    A root is never 32 bytes long, so it cannot be mistaken for a block's hash."""
    return b"" if not cache_salt else b"salt" + hashlib.sha256(cache_salt.encode("utf-8")).digest()


def block_hash(prev: bytes, tokens: list[int]) -> bytes:
    """The hash of a block of tokens after the prefix whose hash is `prev` (b"" for the first).
    SHA-256: two prefixes sharing a hash would hand one sequence another's keys and values."""
    return hashlib.sha256(prev + np.asarray(tokens, dtype=np.int64).tobytes()).digest()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = False, first_block: int = 0,
                 relocate_max_tokens: int = RELOCATE_MAX_TOKENS):
        """Blocks first_block .. first_block + num_blocks - 1 (ids below first_block are the caller's)."""
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.enable_prefix_caching = enable_prefix_caching
        # a stack: the block given back last is taken first, so a sequence that returns its slack
        # blocks after a verification takes the same ones at the next (its blocks stay consecutive).
        # An insertion-ordered dict, not a list: a sequence taking the block after its last (`_take`'s
        # prefer, nearly every block a decode takes) removes it from the middle, O(1) here where a list's
        # remove scans the pool (~80 us at 2,400 free blocks on an Intel Xeon, ~40 such a step at batch 32)
        self._free: dict[int, None] = dict.fromkeys(range(first_block + num_blocks - 1, first_block - 1, -1))
        self._ref = {b: 0 for b in self._free}
        self._cached: dict[bytes, int] = {}  # prefix hash -> the block holding it
        self._hash_of: dict[int, bytes] = {}  # registered block -> its prefix hash
        self._parent_of: dict[int, bytes] = {}  # registered block -> the prefix hash it follows (b"": first)
        self._lru: OrderedDict[int, None] = OrderedDict()  # registered blocks nobody holds, oldest first
        self.tables: dict[str, list[int]] = {}
        self._own: set[str] = set()  # sequences that took blocks of their own since they were allocated
        self._roots: dict[str, bytes] = {}  # per salted sequence: its chain's root (chain_root)
        self._hashes: dict[str, list[bytes]] = {}  # per sequence: the hash chain of its first full blocks
        self.relocate_max_tokens = relocate_max_tokens
        self._copies: list[tuple[int, int]] = []  # (source, destination) blocks the caller has to copy

    # ---- counts ---------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks a sequence can take now: free ones and cached ones nobody holds (evictable)."""
        return len(self._free) + len(self._lru)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- sequences ------------------------------------------------------------------------------
    def allocate(self, seq_id: str, token_ids: list[int] | None = None, max_cached: int | None = None,
                 cache_salt: str | None = None) -> int:
        """Start a block table for seq_id. With prefix caching and token_ids, it begins with the
        cached blocks of token_ids' longest cached prefix of full blocks, leaving at least one token
        to compute (its logits are needed), at most max_cached tokens. Returns the number of tokens
        found cached. `cache_salt`: the prefix is looked up, and registered, among its salt's only."""
        if seq_id in self.tables:
            raise ValueError(f"sequence {seq_id} already has a block table")
        table, hashes = [], []
        root = chain_root(cache_salt)
        if root:
            self._roots[seq_id] = root
        if self.enable_prefix_caching and token_ids:
            bs, prev = self.block_size, root
            n = (len(token_ids) - 1) // bs
            for i in range(n if max_cached is None else min(n, max_cached // bs)):
                h = block_hash(prev, token_ids[i * bs: (i + 1) * bs])
                block = self._cached.get(h)
                if block is None:
                    break
                self._hold(block)
                table.append(block)
                hashes.append(h)
                prev = h
        self.tables[seq_id], self._hashes[seq_id] = table, hashes
        self._own.discard(seq_id)
        return len(table) * self.block_size

    def can_grow(self, seq_id: str, num_tokens: int) -> bool:
        return self.blocks_for(num_tokens) - len(self.tables[seq_id]) <= self.num_free_blocks

    def grow(self, seq_id: str, num_tokens: int) -> bool:
        """Make seq_id's table cover num_tokens positions; False (nothing taken) when the pool cannot."""
        table = self.tables[seq_id]
        need = self.blocks_for(num_tokens) - len(table)
        if need > self.num_free_blocks:
            return False
        after = None  # a cached tail after the table's prefix that the first block may evict
        # only a table that is a cached prefix alone is moved or evicted for: once the sequence has
        # taken blocks of its own (its prompt's rest, its output), its full blocks are registered as
        # they fill, and a batch growing in lockstep (each next block taken by a neighbour) copied every
        # sequence's whole context at every block boundary
        if (need > 0 and table and self.enable_prefix_caching and seq_id not in self._own
                and not self._open(table[-1] + 1)):
            end = self._chain_end(seq_id)
            tail = self._tail(table[-1] + 1, end, len(table) // EVICT_TAIL_RATIO + 1)
            if tail is not None and tail * EVICT_TAIL_RATIO <= len(table):
                after = end
            else:
                self._relocate(seq_id, need)
        for i in range(need):
            table.append(self._take(prefer=table[-1] + 1 if table else None, after=after if i == 0 else None))
        if need > 0:
            self._own.add(seq_id)
        return True

    def pop_copies(self) -> list[tuple[int, int]]:
        """Blocks `grow` relocated since the last call, as (source, destination): the caller copies
        their rows before the sequence's next forward reads them."""
        copies, self._copies = self._copies, []
        return copies

    def shrink(self, seq_id: str, num_tokens: int) -> list[tuple[int, int]]:
        """Keep the positions below num_tokens: whole blocks past them go back, registrations past
        them are dropped from the sequence's chain. The block num_tokens falls inside will be written
        again: one registered (shared or cached) is replaced by a private copy. Returns those copies
        as (source block, new block): the caller copies their rows."""
        table, hashes = self.tables[seq_id], self._hashes[seq_id]
        keep = self.blocks_for(num_tokens)
        while len(table) > keep:
            self._release(table.pop())
        full = num_tokens // self.block_size
        del hashes[full:]
        copies = []
        if full < len(table) and table[full] in self._hash_of:  # a registered block about to be rewritten
            src = table[full]
            dst = self._take()
            table[full] = dst
            self._release(src)
            copies.append((src, dst))
        return copies

    def commit(self, seq_id: str, token_ids: list[int], num_tokens: int) -> None:
        """The first num_tokens of token_ids are verified and their keys/values written: register the
        sequence's full blocks among them (prefix caching only)."""
        if not self.enable_prefix_caching:
            return
        table, hashes = self.tables[seq_id], self._hashes[seq_id]
        bs = self.block_size
        for i in range(len(hashes), min(num_tokens, len(token_ids), len(table) * bs) // bs):
            root = self._roots.get(seq_id, b"")
            h = block_hash(hashes[-1] if hashes else root, token_ids[i * bs: (i + 1) * bs])
            hashes.append(h)
            block = table[i]
            if h not in self._cached and block not in self._hash_of:  # else another block holds it already
                self._cached[h], self._hash_of[block] = block, h
                self._parent_of[block] = hashes[-2] if len(hashes) > 1 else root

    def free(self, seq_id: str) -> None:
        """Give back seq_id's blocks (the last first: the tail of a prefix is evicted before its head)."""
        table = self.tables.pop(seq_id, None)
        self._hashes.pop(seq_id, None)
        self._own.discard(seq_id)
        self._roots.pop(seq_id, None)
        for block in reversed(table or []):
            self._release(block)

    # ---- blocks ---------------------------------------------------------------------------------
    def _chain_end(self, seq_id: str) -> bytes | None:
        """The hash of the prefix seq_id's table ends with when every block of it is a registered full
        block of its chain (its root for an empty table), else None."""
        table, hashes = self.tables[seq_id], self._hashes[seq_id]
        if len(hashes) != len(table):
            return None
        return hashes[-1] if hashes else self._roots.get(seq_id, b"")

    def _orphan(self, block: int) -> bool:
        """A registered block whose prefix's previous block is no longer registered: a lookup walks the
        chain from its start, so it can never be found again."""
        parent = self._parent_of.get(block, b"")
        return len(parent) == hashlib.sha256().digest_size and parent not in self._cached  # (not a root)

    def _free_block(self, block: int) -> bool:
        """In the pool, held by nobody and registered by none."""
        return self._ref.get(block, 1) == 0 and block not in self._lru

    def _open(self, block: int) -> bool:
        """Free, or registered but unreachable: a sequence may take it without costing anyone's prefix."""
        return self._free_block(block) or (self._ref.get(block, 1) == 0 and self._orphan(block))

    def _relocate(self, seq_id: str, need: int) -> None:
        """seq_id's table is registered blocks only (a cached prefix, nothing of its own past it) and
        the block after it is not open: copy the table to the start of a free run, so it grows on
        consecutively and the chain after it stays. Only for a short prefix (relocate_max_tokens: a
        chat template's system prompt, whoever holds it) or one the sequence holds alone (a
        conversation's history, a document asked about again: it will likely run alone, where a view
        pays); nothing where no run of free blocks is found (it then goes on elsewhere, gathered)."""
        table = self.tables[seq_id]
        k = len(table)
        if len(self._hashes[seq_id]) != k or k + need > len(self._free):
            return
        if k * self.block_size > self.relocate_max_tokens and self._ref[table[-1]] > 1:
            return  # a long prefix others hold too: they run beside it (keys gathered anyway), no copies
        start = self._free_run(k + 1)
        if start is None:
            return
        run = list(range(start, start + k))
        for b in run:
            del self._free[b]
            self._ref[b] = 1
        for b in reversed(table):
            self._release(b)  # (registered: they stay cached for others)
        self._copies += list(zip(table, run))
        table[:] = run

    def _tail(self, block: int, after: bytes | None, limit: int) -> int | None:
        """When `block` starts another request's cached text after the prefix `after` (registered,
        nobody holds it): its chain's length in consecutive blocks, counted up to limit; else None."""
        if after is None or block not in self._lru or self._parent_of.get(block) != after:
            return None
        m = 1
        while m < limit and block + m in self._lru and self._parent_of.get(block + m) == self._hash_of[block + m - 1]:
            m += 1
        return m

    def _free_run(self, n: int) -> int | None:
        """The first of n consecutive free blocks, trying the most recently freed first; None if none
        among the first _RUN_SCAN tried."""
        ref, lru = self._ref, self._lru  # (_free_block inlined: grow asks at every block boundary)
        for tried, b in enumerate(reversed(self._free)):
            if tried >= _RUN_SCAN:
                break
            c = b + 1
            while c < b + n and ref.get(c, 1) == 0 and c not in lru:
                c += 1
            if c >= b + n:
                return b
        return None

    def _take(self, prefer: int | None = None, after: bytes | None = None) -> int:
        """A block for a sequence to write: `prefer` (the one after its last) when nobody holds it, so
        its blocks stay consecutive and a lone sequence's keys are read as a view of the pool, not
        gathered (a gather reads and writes the whole context per layer per step: 0.77x decode speed at
        1,500 tokens of SmolLM2 on a 2-core AMD EPYC). A cached block nobody holds is evicted for it
        only when it continues the same prefix (`after`, which `grow` gives only where that text is
        short beside the prefix: EVICT_TAIL_RATIO), or when no lookup can reach it any more (its
        parent's registration is gone: `_orphan`); never the head or middle of a live chain."""
        if prefer is not None and self._ref.get(prefer, 1) == 0 and (
                prefer not in self._lru or self._parent_of.get(prefer) == after or self._orphan(prefer)):
            if prefer in self._lru:
                del self._lru[prefer]
                del self._cached[self._hash_of.pop(prefer)]
                del self._parent_of[prefer]
            else:
                del self._free[prefer]
            self._ref[prefer] = 1
            return prefer
        if self._free:
            block, _ = self._free.popitem()  # (the last given back)
        elif self._lru:  # evict the least recently released cached block
            block, _ = self._lru.popitem(last=False)
            del self._cached[self._hash_of.pop(block)]
            self._parent_of.pop(block, None)
        else:
            raise RuntimeError("no free KV block")
        self._ref[block] = 1
        return block

    def _hold(self, block: int) -> None:
        if self._ref[block] == 0:
            self._lru.pop(block)
        self._ref[block] += 1

    def _release(self, block: int) -> None:
        self._ref[block] -= 1
        if self._ref[block] == 0:
            if block in self._hash_of:
                self._lru[block] = None
            else:
                self._free[block] = None

    def ref_count(self, block: int) -> int:
        return self._ref[block]
