"""ModelRunner: token lists in, logits out, over a paged KV cache with a fixed memory budget.

Both the verifier (target) and the proposers (a draft model, an EAGLE head) use it, each over its
own pool. The runner holds the pool's device tensors (KVCache) and nothing of its books: it is
handed the pool's KVSpace (rayspec.kv.kv_space; the Scheduler owns the target's, a proposer its own)
and reads block tables and cached lengths into the index tensors of a forward. Block 0 is a scratch
block: padding tokens write there, and positions past a row's blocks read from it (masked). Where a
batch's tokens go (trees, masks, prefill groups) is worked out by rayspec.model.batch_layout's functions.
"""

from __future__ import annotations

import numpy as np
import torch

from rayspec.device_io import to_device
from rayspec.model.batch_layout import (TreeQuery, add_tree_depths, additive_mask, last_rows, pad_rows,
                                        rows_of_blocks, sliding_window_mask, spread_tree_visible, tree_layout_host,
                                        tree_layout_nodes)
from rayspec.model.compiled import KV_BUCKET, MAX_ROWS, CompiledForward, bucket, compilable, round_up, verify_rows
from rayspec.model.kv_cache import ForwardBatch, KVCache
from rayspec.kv.kv_space import DEFAULT_BLOCK_SIZE, SCRATCH_BLOCK, CacheFullError, KVSpace
from rayspec.model.native import CausalLM
from rayspec.model.paged_attention import PagedLayout, chain_tail, tree_tail
from rayspec.model.row_attention import RowKeys, row_key_spans
from rayspec.model.tree_steps import TreeSteps


def make_runner(model: CausalLM, max_model_len: int, num_slots: int, slack: int, num_blocks: int | None = None,
                block_size: int = DEFAULT_BLOCK_SIZE, enable_prefix_caching: bool = False, compile: bool = False,
                paged_attention: bool = False, batch_invariant: bool = False) -> "ModelRunner":
    """A runner over a pool of its own books (a KVSpace made here, reached as runner.kv): for a model
    run on its own (tests, benchmarks, a training data pass); an engine's scheduler and a proposer
    make their KVSpace themselves and hand it in."""
    kv = KVSpace(max_model_len, num_slots, slack, num_blocks, block_size, enable_prefix_caching)
    return ModelRunner(model, kv, compile=compile, paged_attention=paged_attention, batch_invariant=batch_invariant)


class ModelRunner:
    def __init__(self, model: CausalLM, kv: KVSpace, compile: bool = False, paged_attention: bool = False,
                 batch_invariant: bool = False, max_compiled_rows: int = MAX_ROWS):
        """kv: the books of the pool this runner's cache tensors hold (its owner's).
        batch_invariant: decode and verification forwards (`static`) compute each row with the bits a
        1-row decode of it gives (EngineConfig.batch_invariant): the model's projections on a
        batch-invariant kernel in every forward (CausalLM.set_batch_invariant, set again before a
        forward where another runner of the model chose otherwise), attention row by row on CPU
        (rayspec.model.row_attention), on a batch-invariant kernel elsewhere; prefill attention stays
        batched. Every forward runs eager (set_compile)."""
        self.model = model
        param = next(model.parameters())
        # the KV cache and inputs follow the layers' dtype (a head's embedding is the target's)
        self.device, self.dtype = param.device, getattr(model, "compute_dtype", param.dtype)
        self.kv = kv
        new_cache = getattr(model, "new_cache", None)  # a CausalLM's (tensor-parallel aware)
        self.cache = (new_cache(kv.num_pool_blocks, kv.block_size) if new_cache is not None
                      else KVCache(model.args, kv.num_pool_blocks, kv.block_size, self.dtype, self.device))
        # catch-up forwards (catch_up_pieces) take at most this many tokens at once; None: all
        self.max_chunk_tokens: int | None = None
        self.batch_invariant = batch_invariant
        # the compiled step (rayspec.model.compiled): forwards asked for with `static` run through it, up
        # to max_compiled_rows padded rows (batch x rows)
        self.compiled, self.max_compiled_rows = None, max_compiled_rows
        # the verification's rows, bucketed (an engine sets 1 + num_speculative_tokens): a shorter one (a
        # request's last tokens, a planner's shorter draft) at a small batch is padded to it, the graph
        # the warm-up compiled, rather than compiling (on CUDA: recording) a new one mid-serving
        # (rayspec.model.compiled.verify_rows)
        self.min_verify_rows = 1
        self.set_compile(compile)
        # in the compiled step, attention reads the pool in place (rayspec.model.paged_attention) rather
        # than gathering each row's keys and masking them densely
        self.paged_attention = paged_attention
        if batch_invariant:
            if not hasattr(model, "set_batch_invariant"):
                raise ValueError(f"batch_invariant needs the native model ({type(model).__name__} has no such path)")
            if model.args.num_experts:  # an expert's matmul takes the tokens routed to it: a count the batch sets
                raise ValueError("batch_invariant has no mixture-of-experts path (rayspec.model.moe)")
            model.set_batch_invariant(True)

    def set_compile(self, on: bool) -> None:
        """Run static forwards (decode, verification, a proposer's drafting steps) through the compiled
        step, or not. A no-op where the model cannot be compiled (rayspec.model.compiled.compilable), and
        batch-invariant: inductor picks a reduction's blocks (split reductions, autotuned block sizes) per
        shape, so a row's bits would follow the batch's bucket; row-by-row attention is not compiled either."""
        if not on:
            self.compiled = None
        elif self.compiled is None and compilable(self.model) and not self.batch_invariant:
            self.compiled = CompiledForward(self.model, self.device, self.max_compiled_rows)

    def tree_steps(self, seq_ids: list[str], width: int, steps: int, static: bool = True) -> TreeSteps | None:
        """A drafting cycle's depth forwards prepared once (rayspec.model.tree_steps), or None where they
        do not apply: sliding-window layers (keys' positions per row) and batch-invariant forwards (rows
        computed one by one on CPU)."""
        if self.model.args.sliding_layers or self.batch_invariant:
            return None
        return TreeSteps(self, seq_ids, width, steps, static)

    def apply_moves(self) -> None:
        """Move the rows the books queued (copy-on-write, a relocated prefix, accepted tree paths) on
        the pool's tensors, in order; every forward does so first."""
        for src, dst in self.kv.pop_moves():
            self.cache.move_rows(*to_device(src, dst, device=self.device))

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
            fits = [i for i in rest if self.kv.cached_len(seq_ids[i]) + q <= self.kv.capacity]
            fits = fits or [max(rest, key=lambda i: lengths[i])]
            groups.append(fits)
            if len(fits) == len(rest):
                break
            taken = set(fits)
            rest = [i for i in rest if i not in taken]
        return groups

    def forward(self, seq_ids: list[str], token_lists: list[list[int]], last_only: bool,
                static: bool = False) -> torch.Tensor:
        """Append token_lists[i] to sequence i's cache and return logits.

        Returns [B, vocab] (last real token of each row) if last_only, else [B, Q, vocab]
        with Q = max row length (rows padded at the end; padded logits are meaningless).
        The caller decides afterwards how many of the new tokens stay (`kv.set_cached_len`).
        """
        hidden, lengths = self.forward_hidden(seq_ids, token_lists, static=static)
        if last_only:
            hidden = last_rows(hidden, lengths)
        return self.model.logits(hidden)

    def forward_hidden(self, seq_ids, token_lists, trees: list[TreeQuery] | None = None, packed: bool = False,
                       static: bool = False, advance: bool = True, lengths: list[int] | None = None,
                       **model_kwargs):
        """Run the model over new tokens; returns (model output, row lengths).

        token_lists: a list of token lists (host), or a [B, Q] long tensor on the device (drafted
        tokens that never went to the host: every row Q tokens, or lengths[i] real ones).
        The output is [B, Q, ...] with rows padded at the end (padding meaningless), or with
        `packed` [N, ...]: the real tokens only, row after row (see `packed_offsets`).

        Without trees the tokens extend each sequence, and with `advance` its cached length grows
        over them (without, the rows are written and the caller decides what stays: the engine's
        commit).
        With trees, row i computes nodes trees[i].first.. of a token tree hanging off the
        sequence's cached prefix: node j sits in cache row cached_len + j at rope position
        cached_len + depth(j) and sees the prefix plus its own ancestors. The cached length
        does not move; the caller keeps an accepted path with `kv.keep_paths`.
        model_kwargs go to the model (aux_layers for a target, features for an EAGLE head).
        static: a decode or verification forward, which runs through the compiled step when the
        runner has one and the padded shape fits its buckets.

        Everything the forward needs is built on the host from host data (block tables, lengths,
        tree shapes) and goes to the device in one non-blocking copy (rayspec.device_io): no read
        of device data here.
        """
        B = len(seq_ids)
        on_device = isinstance(token_lists, torch.Tensor)
        if lengths is None:
            lengths = [int(token_lists.shape[1])] * B if on_device else [len(t) for t in token_lists]
        Q = max(lengths)
        starts = [self.kv.cached_len(s) for s in seq_ids]
        invariant = static and self.batch_invariant
        if getattr(self.model, "batch_invariant", self.batch_invariant) != self.batch_invariant:
            self.model.set_batch_invariant(self.batch_invariant)  # (another runner of this model chose otherwise)
        if static and self.compiled is not None and self.compiled.fits(B, Q):
            out = self._forward_static(seq_ids, token_lists, lengths, starts, trees, packed, model_kwargs)
        else:
            kv_len = self._grow_for(seq_ids, starts, lengths, Q, trees)
            self.apply_moves()
            t = self._eager_host(seq_ids, token_lists, lengths, starts, trees, kv_len)
            input_ids = token_lists if on_device else t["input_ids"]
            batch = self._eager_batch(seq_ids, starts, trees, kv_len, t, packed)
            if invariant:
                self._invariant_batch(batch, starts, lengths, trees, kv_len)
            out = self.model(input_ids, self.cache, batch, **model_kwargs)
        if trees is None and advance:
            for s, start, n in zip(seq_ids, starts, lengths):
                self.kv.extend(s, start + n)
        return out, lengths

    @torch.inference_mode()
    def write_kv(self, seq_ids, token_lists, **model_kwargs) -> None:
        """Cache the keys and values of token_lists (host lists, each extending its sequence) without
        running the model past them (`model.write_kv`: a one-layer EAGLE head's positions whose
        outputs nobody reads); the cached lengths grow as with forward_hidden. No masks are built."""
        lengths = [len(t) for t in token_lists]
        Q = max(lengths)
        starts = [self.kv.cached_len(s) for s in seq_ids]
        kv_len = self._grow_for(seq_ids, starts, lengths, Q, None)
        self.apply_moves()
        t = self._eager_host(seq_ids, token_lists, lengths, starts, None, kv_len)
        batch = ForwardBatch(write_index=t["write_index"], read_index=t["read_index"], positions=t["positions"],
                             kv_len=kv_len, mask=None, real_rows=t.get("real_rows"), write_rows=t.get("write_rows"))
        self.model.write_kv(t["input_ids"], self.cache, batch, **model_kwargs)
        for s, start, n in zip(seq_ids, starts, lengths):
            self.kv.extend(s, start + n)

    def _eager_host(self, seq_ids, token_lists, lengths, starts, trees, kv_len) -> dict[str, torch.Tensor]:
        """The eager forward's index tensors, built on the host and sent in one non-blocking copy. What
        grows with the context (every key's cache row, the prefix's visibility) is spread on the
        device from per-block and per-node arrays: the host's work does not grow with the context."""
        B, Q, bs = len(seq_ids), max(lengths), self.kv.block_size
        starts_np = np.asarray(starts, dtype=np.int64)
        host: dict[str, np.ndarray] = {}
        if not isinstance(token_lists, torch.Tensor):
            ids = np.zeros((B, Q), dtype=np.int64)
            for b, t in enumerate(token_lists):
                ids[b, : len(t)] = t
            host["input_ids"] = ids
        if trees is None:
            write_pos = host["positions"] = starts_np[:, None] + np.arange(Q)  # [B, Q]
        elif self.model.args.sliding_layers:  # (key positions per cache row: built here whole)
            positions, write_pos, visible_np, key_pos_np = tree_layout_host(trees, starts, Q, kv_len, True)
            host["positions"], host["cache_positions"], host["visible"] = positions, write_pos, visible_np
            host["key_positions"] = key_pos_np
        else:
            host["positions"], write_pos, host["nodes_visible"] = tree_layout_nodes(trees, starts, Q)
            host["cache_positions"], host["starts"] = write_pos, starts_np
        blocks = host["blocks"] = self.kv.covering_blocks(seq_ids, kv_len)  # [B, ceil(kv_len / bs)]
        host["write_index"] = np.take_along_axis(blocks, write_pos // bs, axis=1) * bs + write_pos % bs  # [B, Q]
        if any(n != Q for n in lengths):  # padded rows: the model computes only the real tokens
            host["real_rows"] = np.concatenate([np.arange(n) + i * Q for i, n in enumerate(lengths)])
            host["write_rows"] = host["write_index"].reshape(-1)[host["real_rows"]]
        t = dict(zip(host, to_device(*host.values(), device=self.device)))
        t["read_index"] = rows_of_blocks(t.pop("blocks"), bs, kv_len)  # [B, kv_len]
        if "nodes_visible" in t:
            t["visible"] = spread_tree_visible(t.pop("nodes_visible"), t.pop("starts"), kv_len)
        return t

    def _eager_batch(self, seq_ids, starts, trees, kv_len: int, t: dict, packed: bool) -> ForwardBatch:
        """The eager forward's ForwardBatch from its device index tensors `t`: the attention masks
        (causal, a tree's ancestry, a sliding window) and where keys are read and written."""
        positions_t, dev = t["positions"], self.device
        add_tree_depths(positions_t, trees)
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
        if len(seq_ids) == 1 and self.kv.consecutive(seq_ids[0], kv_len):  # its keys are a view of the pool
            lo = self.kv.table(seq_ids[0])[0] * self.kv.block_size
            read_range = (lo, lo + kv_len)
        return ForwardBatch(write_index=t["write_index"], read_index=t["read_index"], positions=positions_t,
                            kv_len=kv_len, mask=mask, cache_positions=cache_positions, real_rows=t.get("real_rows"),
                            packed_output=packed, sliding_start=sliding_start, sliding_mask=sliding_mask,
                            read_range=read_range, write_rows=t.get("write_rows"))

    def _invariant_batch(self, batch: ForwardBatch, starts, lengths, trees, kv_len: int) -> None:
        """Make an eager decode or verification batch-invariant: on CPU each row attends over its own
        keys (rayspec.model.row_attention; its spans on the host, so trees given by parents), elsewhere
        the batched attention on a batch-invariant kernel, masked even for one query."""
        batch.batch_invariant = True
        if self.device.type == "cpu" and (trees is None or all(t.parents is not None for t in trees)):
            batch.row_keys = self._row_keys(starts, lengths, trees, None)
            if self.model.args.sliding_layers:
                batch.sliding_row_keys = self._row_keys(starts, lengths, trees, self.model.args.sliding_window)
        elif batch.mask is None:  # one query seeing every key: the same kernel as the masked rows
            batch.mask = torch.zeros((1, 1, 1, kv_len), dtype=self.dtype, device=self.device)

    def _row_keys(self, starts, lengths, trees, window: int | None) -> RowKeys:
        spans, index = row_key_spans(starts, lengths, trees, window)
        return RowKeys(spans, None if index is None else torch.from_numpy(index).to(self.device))

    def _grow_for(self, seq_ids, starts, lengths, Q, trees) -> int:
        """Blocks for each row's real tokens (rows padded to Q); returns the keys a forward spans
        (padding included: it is written too, past a row's blocks into scratch)."""
        if trees is None:
            ends = [start + Q for start in starts]
            real_ends = [start + n for start, n in zip(starts, lengths)]
        else:
            ends = [start + max(t.num_nodes, t.first + Q) for start, t in zip(starts, trees)]
            real_ends = [start + max(t.num_nodes, t.first + n) for start, t, n in zip(starts, trees, lengths)]
        for s, end in zip(seq_ids, real_ends):  # (the target's: reserved by its scheduler already)
            if not self.kv.grow(s, end):
                raise CacheFullError(f"no free KV block for sequence {s}")
        return max(ends)

    def _forward_static(self, seq_ids, token_lists, lengths, starts, trees, packed, model_kwargs):
        """forward_hidden through the compiled step: batch and rows padded to powers of two, keys to
        a multiple of KV_BUCKET; padding rows read and write the scratch block, padded keys are masked."""
        B, Q = len(seq_ids), max(lengths)
        Bp, Qp = bucket(B), verify_rows(B, Q, self.min_verify_rows)
        kv_len = round_up(self._grow_for(seq_ids, starts, lengths, Qp, trees), KV_BUCKET)
        self.apply_moves()
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

        return tuple(unpad(o) for o in out) if isinstance(out, tuple) else unpad(out)

    def _static_positions(self, starts, trees, Bp: int, Qp: int, kv_len: int, paged: bool):
        """The compiled step's padded [Bp, Qp] rope and cache positions, for trees (not paged) which
        nodes each tree row sees [B, 1, Qp, W] (tree_layout_nodes; the visibility is spread on the
        device), and for a model with sliding-window layers (not paged) the position of each cache
        row's key [Bp, kv_len] (a tree node's: its rope position):
        (positions, write positions, nodes seen or None, key positions or None)."""
        B = len(starts)
        positions = np.tile(np.arange(Qp, dtype=np.int64), (Bp, 1))
        nodes = key_positions = None
        sliding = not paged and bool(self.model.args.sliding_layers)
        if sliding:
            key_positions = np.tile(np.arange(kv_len, dtype=np.int64), (Bp, 1))
        if trees is None:
            positions[:B] += np.asarray(starts, dtype=np.int64)[:, None]
            write_pos = positions
        else:
            tree_pos, cache_pos, nodes = tree_layout_nodes(trees, starts, Qp)
            positions[:B] = tree_pos
            write_pos = positions.copy()
            write_pos[:B] = cache_pos
            if sliding:
                key_positions[:B] = tree_layout_host(trees, starts, Qp, kv_len, True)[3]
        return positions, write_pos, None if paged else nodes, key_positions

    def _static_batch(self, seq_ids, starts, trees, ids, real, Bp: int, Qp: int, kv_len: int):
        """The compiled step's inputs on the device, in one copy: (token ids, real rows, ForwardBatch),
        reading the pool through block tables (paged) or through every key's row and a dense mask."""
        B, bs = len(seq_ids), self.kv.block_size
        paged = self._pages(trees)
        positions, write_pos, visible, key_positions = self._static_positions(starts, trees, Bp, Qp, kv_len, paged)
        if paged:  # block tables, not every key's row, and no dense mask (rayspec.model.paged_attention)
            table, context, tail = self._paged_arrays(seq_ids, starts, Bp, Qp, trees)
            block = write_pos // bs  # padding written past a table's width: the scratch block
            width = self.kv.max_blocks
            write = np.where(block < width, np.take_along_axis(table, np.minimum(block, width - 1), axis=1),
                             SCRATCH_BLOCK) * bs + write_pos % bs
            t_ids, t_pos, t_write, t_real, t_table, t_context, t_tail = to_device(
                ids, positions, write, real, table, context, tail, device=self.device)
            layout = PagedLayout.build(t_table, t_context, t_tail, bs, self.cache.k[0].shape[0] // bs)
            return t_ids, t_real, ForwardBatch(write_index=t_write, read_index=t_write[:, :0], positions=t_pos,
                                               kv_len=kv_len, mask=None, paged=layout)
        blocks = np.full((Bp, -(-kv_len // bs)), SCRATCH_BLOCK, dtype=np.int64)
        blocks[:B] = self.kv.covering_blocks(seq_ids, kv_len)
        write = np.take_along_axis(blocks, write_pos // bs, axis=1) * bs + write_pos % bs
        nodes = visible if visible is not None else np.zeros((0, 1, Qp, 1), dtype=bool)
        t_ids, t_pos, t_blocks, t_write, t_nodes, t_starts, t_real, *t_keys = to_device(
            ids, positions, blocks, write, nodes, np.asarray(starts, dtype=np.int64), real,
            *([key_positions] if key_positions is not None else []), device=self.device)
        add_tree_depths(t_pos, trees)  # (a tree whose depths the device completes: deferred drafts)
        t_read = rows_of_blocks(t_blocks, bs, kv_len)  # [Bp, kv_len]
        # every row sees the keys up to its position (padding rows: their own scratch rows), a tree's
        # rows their prefix and the nodes tree_layout_nodes marked
        t_visible = torch.arange(kv_len, device=self.device)[None, None, None, :] <= t_pos[:, None, :, None]
        if trees is not None:
            t_visible[:B] = spread_tree_visible(t_nodes, t_starts, kv_len)
        for b, (tree, start) in enumerate(zip(trees or [], starts)):
            if tree.sees is not None:
                t_visible[b, 0, : tree.sees.shape[0], start: start + tree.sees.shape[1]] = tree.sees
        mask = additive_mask(t_visible, self.dtype)
        sliding_mask = None
        if t_keys:  # sliding-window layers: every key kept (a static start), those outside a window masked
            _, sliding_mask = sliding_window_mask(t_visible, mask, t_pos, t_keys[0], self.model.args.sliding_window,
                                                  0, kv_len)
        return t_ids, t_real, ForwardBatch(write_index=t_write, read_index=t_read, positions=t_pos, kv_len=kv_len,
                                           mask=mask, sliding_mask=sliding_mask)

    def _pages(self, trees) -> bool:
        """Whether the compiled step's attention reads the pool in place (rayspec.model.paged_attention):
        paged attention on, and no tree given as a device mask or partly cached (an EAGLE head's
        draft steps: one layer, whose gather is small)."""
        if self.model.args.sliding_layers:  # its layout has no windows: such models gather their keys
            return False
        return self.paged_attention and (trees is None or all(t.parents is not None and not t.first for t in trees))

    def _paged_arrays(self, seq_ids, starts, Bp, Qp, trees):
        """A PagedLayout's table [Bp, max_blocks] (scratch past a row's blocks, and for padding rows),
        context [Bp] and tail [Bp, Qp, Qp], as numpy arrays."""
        table = self.kv.block_tables(seq_ids, Bp)
        context = np.zeros(Bp, dtype=np.int64)
        context[: len(starts)] = starts
        tail = np.empty((Bp, Qp, Qp), dtype=bool)
        tail[:] = chain_tail(Qp)
        for b, tree in enumerate(trees or []):
            tail[b] = tree_tail(tree.parents, Qp)
        return table, context, tail

