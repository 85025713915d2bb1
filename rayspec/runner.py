"""ModelRunner: token lists in, logits out, over a paged KV cache with a fixed memory budget.

Both the verifier (target) and the proposers (a draft model, an EAGLE head) use it, each with its
own cache: a pool of fixed-size blocks (rayspec.block_manager keeps the books, the runner only reads
block tables into the index tensors of a forward). Block 0 is a scratch block: padding tokens write
there, and positions past a row's blocks read from it (masked). Where a batch's tokens go (trees,
masks, prefill groups) is worked out by rayspec.batch_layout's functions.
"""

from __future__ import annotations

import numpy as np
import torch

from rayspec.batch_layout import (TreeQuery, additive_mask, last_rows, pad_rows, sliding_window_mask,
                                  tree_layout_host)
from rayspec.block_manager import BlockManager
from rayspec.compiled import KV_BUCKET, CompiledForward, bucket, compilable, round_up
from rayspec.device_io import to_device
from rayspec.kv_cache import ForwardBatch, KVCache
from rayspec.model import CausalLM
from rayspec.paged_attention import PagedLayout, chain_tail, tree_tail

SCRATCH_BLOCK = 0
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


class ModelRunner:
    def __init__(self, model: CausalLM, max_model_len: int, num_slots: int, slack: int,
                 num_blocks: int | None = None, block_size: int = DEFAULT_BLOCK_SIZE,
                 enable_prefix_caching: bool = False, compile: bool = False, paged_attention: bool = False):
        """num_slots: the most sequences held at once; slack: extra positions past max_model_len,
        written by speculative/padded queries; num_blocks: the pool's blocks (None: enough for
        num_slots sequences of max_model_len + slack), one scratch block besides."""
        self.model = model
        param = next(model.parameters())
        # the KV cache and inputs follow the layers' dtype (a head's embedding is the target's)
        self.device, self.dtype = param.device, getattr(model, "compute_dtype", param.dtype)
        self.max_model_len = max_model_len
        self.capacity = max_model_len + slack  # positions one sequence may write
        self.num_slots = num_slots
        self.block_size = block_size
        if num_blocks is None:
            num_blocks = default_num_blocks(num_slots, self.capacity, block_size)
        self.blocks = BlockManager(num_blocks, block_size, enable_prefix_caching, first_block=SCRATCH_BLOCK + 1)
        new_cache = getattr(model, "new_cache", None)  # a CausalLM's (tensor-parallel aware)
        self.cache = (new_cache(num_blocks + 1, block_size) if new_cache is not None
                      else KVCache(model.args, num_blocks + 1, block_size, self.dtype, self.device))
        self._cached_len: dict[str, int] = {}  # tokens whose KV is valid, per sequence
        # catch-up forwards (catch_up_pieces) take at most this many tokens at once; None: all
        self.max_chunk_tokens: int | None = None
        # the compiled step (rayspec.compiled): forwards asked for with `static` run through it
        self.compiled = None
        self.set_compile(compile)
        # in the compiled step, attention reads the pool in place (rayspec.paged_attention) rather
        # than gathering each row's keys and masking them densely
        self.paged_attention = paged_attention
        self.max_blocks = -(-self.capacity // block_size)  # a block table's width (a static shape)

    def set_compile(self, on: bool) -> None:
        """Run static forwards (decode, verification, a proposer's drafting steps) through the compiled
        step, or not. A no-op where the model cannot be compiled (rayspec.compiled.compilable)."""
        if not on:
            self.compiled = None
        elif self.compiled is None and compilable(self.model):
            self.compiled = CompiledForward(self.model, self.device)

    # ---- sequences and blocks --------------------------------------------------------------------
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

    def has(self, seq_id: str) -> bool:
        return seq_id in self._cached_len

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
        self._copy_blocks(self.blocks.pop_copies())  # (a shared prefix moved to where it grows on)
        return grown

    def cached_len(self, seq_id: str) -> int:
        return self._cached_len[seq_id]

    def set_cached_len(self, seq_id: str, n: int) -> None:
        """Keep the first n cached tokens; later positions are garbage, overwritten next time (whole
        blocks past them go back to the pool)."""
        if n > len(self.blocks.tables[seq_id]) * self.block_size:
            raise ValueError(f"sequence {seq_id} has no KV cached up to {n}")
        self._cached_len[seq_id] = n
        self._copy_blocks(self.blocks.shrink(seq_id, n))

    def commit(self, seq_id: str, token_ids: list[int]) -> None:
        """token_ids are seq_id's verified tokens: its full blocks among the cached ones may be shared
        (prefix caching; never a block holding draft or tree rows past them)."""
        if self.blocks.enable_prefix_caching and seq_id in self._cached_len:
            self.blocks.commit(seq_id, token_ids, self._cached_len[seq_id])

    def _copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        if copies:
            bs = self.block_size
            src = np.array([b * bs + r for b, _ in copies for r in range(bs)], dtype=np.int64)
            dst = np.array([b * bs + r for _, b in copies for r in range(bs)], dtype=np.int64)
            self.cache.move_rows(*to_device(src, dst, device=self.device))

    def _consecutive(self, seq_id: str, kv_len: int) -> bool:
        blocks = self.blocks.tables[seq_id][: -(-kv_len // self.block_size)]
        return len(blocks) * self.block_size >= kv_len and blocks == list(range(blocks[0], blocks[0] + len(blocks)))

    def _rows(self, seq_ids: list[str], kv_len: int) -> np.ndarray:
        """[B, kv_len] int64: the cache row of each row's positions 0..kv_len-1 (past its blocks: scratch)."""
        bs = self.block_size
        nb = -(-kv_len // bs)
        table = np.full((len(seq_ids), nb), SCRATCH_BLOCK, dtype=np.int64)
        for b, s in enumerate(seq_ids):
            blocks = self.blocks.tables[s][:nb]
            table[b, : len(blocks)] = blocks
        return (table[:, :, None] * bs + np.arange(bs)).reshape(len(seq_ids), nb * bs)[:, :kv_len]

    # ---- forward -----------------------------------------------------------------------
    @torch.inference_mode()
    def padded_groups(self, seq_ids: list[str], lengths: list[int]) -> list[list[int]]:
        """Indices of `seq_ids` split into batches whose padded forward (every row padded to the
        batch's longest, padding written too) stays inside each row's cache. A sequence just
        joined (its whole prompt pending) beside one deep in its context would otherwise write
        padding past capacity. One group in the common case; the longest row always fits alone
        (or its own forward raises CacheFullError)."""
        groups, rest = [], list(range(len(seq_ids)))
        while rest:
            q = max(lengths[i] for i in rest)
            fits = [i for i in rest if self._cached_len[seq_ids[i]] + q <= self.capacity]
            fits = fits or [max(rest, key=lambda i: lengths[i])]
            groups.append(fits)
            rest = [i for i in rest if i not in fits]
        return groups

    def forward(self, seq_ids: list[str], token_lists: list[list[int]], last_only: bool,
                static: bool = False) -> torch.Tensor:
        """Append token_lists[i] to sequence i's cache and return logits.

        Returns [B, vocab] (last real token of each row) if last_only, else [B, Q, vocab]
        with Q = max row length (rows padded at the end; padded logits are meaningless).
        The caller decides afterwards how many of the new tokens stay (`set_cached_len`).
        """
        hidden, lengths = self.forward_hidden(seq_ids, token_lists, static=static)
        if last_only:
            hidden = last_rows(hidden, lengths)
        return self.model.logits(hidden)

    def forward_hidden(self, seq_ids, token_lists, trees: list[TreeQuery] | None = None, packed: bool = False,
                       static: bool = False, **model_kwargs):
        """Run the model over new tokens; returns (model output, row lengths).

        token_lists: a list of token lists (host), or a [B, Q] long tensor on the device (drafted
        tokens that never went to the host: every row Q tokens).
        The output is [B, Q, ...] with rows padded at the end (padding meaningless), or with
        `packed` [N, ...]: the real tokens only, row after row (see `packed_offsets`).

        Without trees the tokens extend each sequence and its cached length grows.
        With trees, row i computes nodes trees[i].first.. of a token tree hanging off the
        sequence's cached prefix: node j sits in cache row cached_len + j at rope position
        cached_len + depth(j) and sees the prefix plus its own ancestors. The cached length
        does not move; the caller keeps an accepted path with `keep_path`.
        model_kwargs go to the model (aux_layers for a target, features for an EAGLE head).
        static: a decode or verification forward, which runs through the compiled step when the
        runner has one and the padded shape fits its buckets.

        Everything the forward needs is built on the host from host data (block tables, lengths,
        tree shapes) and goes to the device in one non-blocking copy (rayspec.device_io): no read
        of device data here.
        """
        B = len(seq_ids)
        on_device = isinstance(token_lists, torch.Tensor)
        lengths = [int(token_lists.shape[1])] * B if on_device else [len(t) for t in token_lists]
        Q = max(lengths)
        if static and self.compiled is not None and self.compiled.fits(B, Q):
            return self._forward_static(seq_ids, token_lists, lengths, trees, packed, model_kwargs), lengths
        starts = [self._cached_len[s] for s in seq_ids]
        kv_len = self._grow_for(seq_ids, starts, lengths, Q, trees)
        t = dict(zip(*self._eager_host(seq_ids, token_lists, lengths, starts, trees, kv_len)))
        input_ids = token_lists if on_device else t["input_ids"]
        batch = self._eager_batch(seq_ids, starts, trees, kv_len, t, packed)
        out = self.model(input_ids, self.cache, batch, **model_kwargs)
        if trees is None:
            for s, start, n in zip(seq_ids, starts, lengths):
                self._cached_len[s] = start + n
        return out, lengths

    @torch.inference_mode()
    def write_kv(self, seq_ids, token_lists, **model_kwargs) -> None:
        """Cache the keys and values of token_lists (host lists, each extending its sequence) without
        running the model past them (`model.write_kv`: a one-layer EAGLE head's positions whose
        outputs nobody reads); the cached lengths grow as with forward_hidden. No masks are built."""
        lengths = [len(t) for t in token_lists]
        Q = max(lengths)
        starts = [self._cached_len[s] for s in seq_ids]
        kv_len = self._grow_for(seq_ids, starts, lengths, Q, None)
        t = dict(zip(*self._eager_host(seq_ids, token_lists, lengths, starts, None, kv_len)))
        batch = ForwardBatch(write_index=t["write_index"], read_index=t["read_index"], positions=t["positions"],
                             kv_len=kv_len, mask=None, real_rows=t.get("real_rows"), write_rows=t.get("write_rows"))
        self.model.write_kv(t["input_ids"], self.cache, batch, **model_kwargs)
        for s, start, n in zip(seq_ids, starts, lengths):
            self._cached_len[s] = start + n

    def _eager_host(self, seq_ids, token_lists, lengths, starts, trees, kv_len) -> tuple[list[str], list]:
        """The eager forward's index arrays, built on the host and sent in one non-blocking copy:
        (names, device tensors)."""
        B, Q = len(seq_ids), max(lengths)
        starts_np = np.asarray(starts, dtype=np.int64)
        host: dict[str, np.ndarray] = {}
        if not isinstance(token_lists, torch.Tensor):
            ids = np.zeros((B, Q), dtype=np.int64)
            for b, t in enumerate(token_lists):
                ids[b, : len(t)] = t
            host["input_ids"] = ids
        if trees is None:
            write_pos = host["positions"] = starts_np[:, None] + np.arange(Q)  # [B, Q]
        else:
            positions, write_pos, visible_np, key_pos_np = tree_layout_host(
                trees, starts, Q, kv_len, with_key_positions=bool(self.model.args.sliding_layers))
            host["positions"], host["cache_positions"], host["visible"] = positions, write_pos, visible_np
            if key_pos_np is not None:
                host["key_positions"] = key_pos_np
        read_np = host["read_index"] = self._rows(seq_ids, kv_len)  # [B, kv_len]
        host["write_index"] = np.take_along_axis(read_np, write_pos, axis=1)  # [B, Q]
        if any(n != Q for n in lengths):  # padded rows: the model computes only the real tokens
            host["real_rows"] = np.concatenate([np.arange(n) + i * Q for i, n in enumerate(lengths)])
            host["write_rows"] = host["write_index"].reshape(-1)[host["real_rows"]]
        return list(host), to_device(*host.values(), device=self.device)

    def _eager_batch(self, seq_ids, starts, trees, kv_len: int, t: dict, packed: bool) -> ForwardBatch:
        """The eager forward's ForwardBatch from its device index tensors `t`: the attention masks
        (causal, a tree's ancestry, a sliding window) and where keys are read and written."""
        positions_t, dev = t["positions"], self.device
        cache_positions = key_positions = None
        if trees is None:
            if len(seq_ids) == 1 and positions_t.shape[1] == 1:
                mask = visible = None
            else:
                key_positions = torch.arange(kv_len, device=dev)[None]  # [1, kv_len]: cache row j holds position j
                visible = (key_positions[:, None, :] <= positions_t[:, :, None])[:, None]  # [B, 1, Q, kv_len]
                mask = additive_mask(visible, self.dtype)
        else:
            cache_positions, visible = t["cache_positions"], t["visible"]
            key_positions = t.get("key_positions")
            for b, (tree, start) in enumerate(zip(trees, starts)):
                if tree.sees is not None:  # ancestry known on the device only
                    n = tree.sees.shape[1]
                    visible[b, 0, : tree.sees.shape[0], start: start + n] = tree.sees
            mask = additive_mask(visible, self.dtype)
        sliding_start, sliding_mask = 0, None
        if self.model.args.sliding_layers:
            sliding_start, sliding_mask = sliding_window_mask(visible, mask, positions_t, key_positions,
                                                              self.model.args.sliding_window, min(starts), kv_len)
        read_range = None
        if len(seq_ids) == 1 and self._consecutive(seq_ids[0], kv_len):  # its keys are a view of the pool
            lo = self.blocks.tables[seq_ids[0]][0] * self.block_size
            read_range = (lo, lo + kv_len)
        return ForwardBatch(write_index=t["write_index"], read_index=t["read_index"], positions=positions_t,
                            kv_len=kv_len, mask=mask, cache_positions=cache_positions, real_rows=t.get("real_rows"),
                            packed_output=packed, sliding_start=sliding_start, sliding_mask=sliding_mask,
                            read_range=read_range, write_rows=t.get("write_rows"))

    def _grow_for(self, seq_ids, starts, lengths, Q, trees) -> int:
        """Blocks for each row's real tokens (rows padded to Q); returns the keys a forward spans
        (padding included: it is written too, past a row's blocks into scratch)."""
        if trees is None:
            ends = [start + Q for start in starts]
            real_ends = [start + n for start, n in zip(starts, lengths)]
        else:
            ends = [start + max(t.num_nodes, t.first + Q) for start, t in zip(starts, trees)]
            real_ends = [start + max(t.num_nodes, t.first + n) for start, t, n in zip(starts, trees, lengths)]
        for s, end in zip(seq_ids, real_ends):
            if not self.grow(s, end):
                raise CacheFullError(f"no free KV block for sequence {s}")
        return max(ends)

    def _forward_static(self, seq_ids, token_lists, lengths, trees, packed, model_kwargs):
        """forward_hidden through the compiled step: batch and rows padded to powers of two, keys to
        a multiple of KV_BUCKET; padding rows read and write the scratch block, padded keys are masked."""
        B, Q = len(seq_ids), max(lengths)
        Bp, Qp = bucket(B), bucket(Q)
        starts = [self._cached_len[s] for s in seq_ids]
        kv_len = round_up(self._grow_for(seq_ids, starts, lengths, Qp, trees), KV_BUCKET)
        on_device = isinstance(token_lists, torch.Tensor)  # [B, Q] drafted on the device: padded there
        ids = np.zeros((Bp, Qp) if not on_device else (0, 0), dtype=np.int64)
        for b, t in enumerate([] if on_device else token_lists):
            ids[b, : len(t)] = t
        real = np.concatenate([np.arange(n) + b * Qp for b, n in enumerate(lengths)])
        t_ids, t_real, batch = self._static_batch(seq_ids, starts, trees, ids, real, Bp, Qp, kv_len)
        if on_device:
            t_ids = pad_rows(token_lists, Bp, Qp)
        # tensor arguments per token (an EAGLE head's features, [B, Q, F]) padded as the tokens are
        model_kwargs = {k: pad_rows(v, Bp, Qp) if isinstance(v, torch.Tensor) and v.dim() >= 2
                        and tuple(v.shape[:2]) == (B, Q) else v for k, v in model_kwargs.items()}
        out = self.compiled(t_ids, self.cache, batch, **model_kwargs)

        def unpad(x):  # [Bp, Qp, ...] -> the real tokens, packed or [B, Q, ...]
            if packed:
                return x.reshape(Bp * Qp, *x.shape[2:]).index_select(0, t_real)
            return x[:B, :Q]

        if trees is None:
            for s, start, n in zip(seq_ids, starts, lengths):
                self._cached_len[s] = start + n
        return tuple(unpad(o) for o in out) if isinstance(out, tuple) else unpad(out)

    def _static_positions(self, starts, trees, Bp: int, Qp: int, kv_len: int, paged: bool):
        """The compiled step's padded [Bp, Qp] rope and cache positions, and (not paged) its dense
        visibility [Bp, 1, Qp, kv_len] on the host: (positions, write positions, visible or None)."""
        B = len(starts)
        positions = np.tile(np.arange(Qp, dtype=np.int64), (Bp, 1))
        visible = None
        if trees is None:
            positions[:B] += np.asarray(starts, dtype=np.int64)[:, None]
            write_pos = positions
            if not paged:
                visible = np.arange(kv_len)[None, None, None, :] <= positions[:, None, :, None]
        else:
            tree_pos, cache_pos, tree_visible, _ = tree_layout_host(trees, starts, Qp, kv_len)
            positions[:B] = tree_pos
            write_pos = positions.copy()
            write_pos[:B] = cache_pos
            if not paged:
                visible = np.arange(kv_len)[None, None, None, :] <= positions[:, None, :, None]
                visible[:B] = tree_visible
        return positions, write_pos, visible

    def _static_batch(self, seq_ids, starts, trees, ids, real, Bp: int, Qp: int, kv_len: int):
        """The compiled step's inputs on the device, in one copy: (token ids, real rows, ForwardBatch),
        reading the pool through block tables (paged) or through every key's row and a dense mask."""
        B, bs = len(seq_ids), self.block_size
        paged = self._pages(trees)
        positions, write_pos, visible = self._static_positions(starts, trees, Bp, Qp, kv_len, paged)
        if paged:  # block tables, not every key's row, and no dense mask (rayspec.paged_attention)
            table, context, tail = self._paged_arrays(seq_ids, starts, Bp, Qp, trees)
            block = write_pos // bs  # padding written past a table's width: the scratch block
            write = np.where(block < self.max_blocks,
                             np.take_along_axis(table, np.minimum(block, self.max_blocks - 1), axis=1),
                             SCRATCH_BLOCK) * bs + write_pos % bs
            t_ids, t_pos, t_write, t_real, t_table, t_context, t_tail = to_device(
                ids, positions, write, real, table, context, tail, device=self.device)
            layout = PagedLayout.build(t_table, t_context, t_tail, bs, self.cache.k[0].shape[0] // bs)
            return t_ids, t_real, ForwardBatch(write_index=t_write, read_index=t_write[:, :0], positions=t_pos,
                                               kv_len=kv_len, mask=None, paged=layout)
        read = np.empty((Bp, kv_len), dtype=np.int64)
        read[:B] = self._rows(seq_ids, kv_len)
        read[B:] = SCRATCH_BLOCK * bs + np.arange(kv_len) % bs
        t_ids, t_pos, t_read, t_write, t_visible, t_real = to_device(
            ids, positions, read, np.take_along_axis(read, write_pos, axis=1), visible, real, device=self.device)
        for b, (tree, start) in enumerate(zip(trees or [], starts)):
            if tree.sees is not None:
                t_visible[b, 0, : tree.sees.shape[0], start: start + tree.sees.shape[1]] = tree.sees
        return t_ids, t_real, ForwardBatch(write_index=t_write, read_index=t_read, positions=t_pos, kv_len=kv_len,
                                           mask=additive_mask(t_visible, self.dtype))

    def _pages(self, trees) -> bool:
        """Whether the compiled step's attention reads the pool in place (rayspec.paged_attention):
        paged attention on, and no tree given as a device mask or partly cached (an EAGLE head's
        draft steps: one layer, whose gather is small)."""
        return self.paged_attention and (trees is None or all(t.parents is not None and not t.first for t in trees))

    def _paged_arrays(self, seq_ids, starts, Bp, Qp, trees):
        """A PagedLayout's table [Bp, max_blocks] (scratch past a row's blocks, and for padding rows),
        context [Bp] and tail [Bp, Qp, Qp], as numpy arrays."""
        table = np.full((Bp, self.max_blocks), SCRATCH_BLOCK, dtype=np.int64)
        for b, s in enumerate(seq_ids):
            blocks = self.blocks.tables[s][: self.max_blocks]
            table[b, : len(blocks)] = blocks
        context = np.zeros(Bp, dtype=np.int64)
        context[: len(starts)] = starts
        tail = np.empty((Bp, Qp, Qp), dtype=bool)
        tail[:] = chain_tail(Qp)
        for b, tree in enumerate(trees or []):
            tail[b] = tree_tail(tree.parents, Qp)
        return table, context, tail

    def keep_path(self, seq_id: str, tree_rows: list[int]) -> None:
        """After a tree forward: move the KV of the accepted nodes (tree-relative rows, in path
        order) to follow the prefix contiguously, and extend the cached length over them."""
        self.keep_paths([(seq_id, tree_rows)])

    def keep_paths(self, paths: list[tuple[str, list[int]]]) -> None:
        """keep_path for several sequences, their KV moves in one copy."""
        src, dst = [], []
        bs = self.block_size
        for seq_id, tree_rows in paths:
            if tree_rows != list(range(len(tree_rows))):
                start, table = self._cached_len[seq_id], self.blocks.tables[seq_id]
                src += [table[p // bs] * bs + p % bs for p in (start + r for r in tree_rows)]
                dst += [table[p // bs] * bs + p % bs for p in range(start, start + len(tree_rows))]
        if src:
            self.cache.move_rows(*to_device(np.asarray(src, dtype=np.int64), np.asarray(dst, dtype=np.int64),
                                            device=self.device))
        for seq_id, tree_rows in paths:
            self.set_cached_len(seq_id, self._cached_len[seq_id] + len(tree_rows))
