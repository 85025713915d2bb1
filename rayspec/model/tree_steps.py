"""A draft tree's depth forwards with one host preparation per cycle (issue #50, item 2b's ground).

An EAGLE head grows its draft tree one depth at a time: each depth feeds the `width` frontier nodes
chosen on the device and attends to the sequence's prefix and each node's ancestors. Through
`ModelRunner.forward_hidden` every depth grew the cache, built positions, cache rows and block rows
on the host, sent them and spread the visibility: host work and a host-to-device copy per depth,
with a key length that moved as the tree grew. Here the host prepares once per cycle for all the
depths (the nodes' cache rows, every key's pool row up to a key length fixed for the cycle, the
prefix lengths), sends it in one copy, and each depth is device work only: slices of those tensors,
the visibility from the device's ancestry, the head's forward. Every depth has the same shapes
(batch bucket x width rows over the same keys), so they share one compiled graph, and nothing
between them waits for the host: the ground for capturing the whole drafting loop in one graph. (Each
depth's rows are their own [Bp, width] tensor with standard strides: a compiled graph is specialised on its
inputs' strides, and slices of one [Bp, nodes] tensor compiled a graph per depth.)

Node slot j of the tree (depth j // width) sits in cache row start + j at rope position
start + j // width, as TreeQuery(depths=..., sees=...) puts it: the same forward, the same cache
rows, so the engine's bookkeeping after verification (kv.keep_paths) is unchanged.
"""

from __future__ import annotations

import numpy as np
import torch

from rayspec.device_io import to_device
from rayspec.kv.kv_space import SCRATCH_BLOCK
from rayspec.model.batch_layout import pad_rows, rows_of_blocks
from rayspec.model.compiled import KV_BUCKET, bucket, round_up
from rayspec.model.kv_cache import ForwardBatch


class TreeSteps:
    """The depth forwards of one drafting cycle over `seq_ids` (see the module doc). Built by
    ModelRunner.tree_steps, which says when it applies."""

    def __init__(self, runner, seq_ids: list[str], width: int, steps: int, static: bool):
        self.runner, self.width, self.steps = runner, width, steps
        B, n, kv = len(seq_ids), width * steps, runner.kv
        starts = [kv.cached_len(s) for s in seq_ids]
        runner._grow_for(seq_ids, starts, [n] * B, n, None)  # every node's cache row, grown once
        runner.apply_moves()
        self.B = B
        self.compiled = static and runner.compiled is not None and runner.compiled.fits(B, width)
        Bp = bucket(B) if self.compiled else B
        self.kv_len = kv_len = round_up(max(starts) + n, KV_BUCKET if self.compiled else 1)
        bs = kv.block_size
        blocks = np.full((Bp, -(-kv_len // bs)), SCRATCH_BLOCK, dtype=np.int64)
        blocks[:B] = kv.covering_blocks(seq_ids, kv_len)
        starts_np = np.ones(Bp, dtype=np.int64)  # padding rows: a prefix of one key (their scratch row 0)
        starts_np[:B] = starts
        node_pos = starts_np[:, None] + np.arange(n)  # [Bp, n] each node's cache position
        write = np.take_along_axis(blocks, np.minimum(node_pos // bs, blocks.shape[1] - 1), axis=1) * bs + node_pos % bs
        write[B:] = SCRATCH_BLOCK * bs + np.arange(n) % bs  # padding rows write scratch
        # per depth [steps, Bp, width]: each depth's rows a tensor of standard strides (a compiled graph is
        # specialised on its inputs' strides: a [Bp, width] slice of [Bp, n] compiled a graph per depth)
        by_step = lambda a: a.reshape(Bp, steps, width).transpose(1, 0, 2).copy()  # noqa: E731 (copy: C strides)
        depth_pos = np.repeat(starts_np[:, None] + np.arange(steps), width, axis=1)  # [Bp, n] each slot's rope position
        t_blocks, self.write, self.starts, self.cache_pos, self.positions = to_device(
            blocks, by_step(write), starts_np, by_step(node_pos), by_step(depth_pos), device=runner.device)
        self.read = rows_of_blocks(t_blocks, bs, kv_len)  # [Bp, kv_len]
        self.Bp = Bp
        self._shared = None  # the depths' shared part of the mask (`mask`; not built where a graph masks itself)

    def forward(self, step: int, tokens: torch.Tensor, features: torch.Tensor, sees: torch.Tensor) -> torch.Tensor:
        """Depth `step` (0: the root's children fed): tokens [B, width] and features [B, width, F] on the
        device, sees [B, width, width * steps] which node slots each fed node attends to (its ancestors and
        itself) -> the head's output [B, width, H]."""
        w, B, Bp, runner = self.width, self.B, self.Bp, self.runner
        batch = ForwardBatch(write_index=self.write[step], read_index=self.read, positions=self.positions[step],
                             kv_len=self.kv_len, mask=self.mask(sees), cache_positions=self.cache_pos[step])
        if self.compiled:
            out = runner.compiled(pad_rows(tokens, Bp, w), runner.cache, batch, features=pad_rows(features, Bp, w))
            return out[:B]
        return runner.model(tokens, runner.cache, batch, features=features)

    def mask(self, sees: torch.Tensor) -> torch.Tensor:
        """sees [B, width, n] (which node slots each fed node attends to) -> the additive mask [Bp, 1, width,
        kv_len]: the prefix and those slots 0, the rest -inf; what additive_mask(spread_tree_visible(...))
        gives, in four ops instead of fifteen (tests/engine/test_tree_steps.py compares them)."""
        if self._shared is None:  # once a cycle: the prefix seen and the rest not, where each row's nodes sit
            dtype, dev, kv_len = self.runner.dtype, self.runner.device, self.kv_len
            prefix = torch.zeros((self.Bp, 1, 1, kv_len), dtype=dtype, device=dev).masked_fill_(
                (torch.arange(kv_len, device=dev) >= self.starts[:, None])[:, None, None], float("-inf"))
            columns = (self.starts[:, None] + torch.arange(sees.shape[-1], device=dev))[:, None, None]  # [Bp, 1, 1, n]
            seen = (torch.zeros((), dtype=dtype, device=dev), torch.full((), float("-inf"), dtype=dtype, device=dev))
            self._shared = prefix, columns, seen
        prefix, columns, seen = self._shared
        nodes = pad_rows(sees, self.Bp, self.width)[:, None]  # [Bp, 1, w, n]
        out = prefix.expand(self.Bp, 1, self.width, self.kv_len).contiguous()  # (kv_len holds every row's nodes)
        return out.scatter_(3, columns.expand(nodes.shape), torch.where(nodes, *seen))
