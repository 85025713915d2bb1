"""Attention that reads the paged KV pool in place: FlexAttention over the block tables.

The default attention (rayspec.model.native.attention) gathers each row's keys and values through its block
table into [B, kv_heads, kv_len, head_dim] per layer and masks them with a dense additive
[B, 1, Q, kv_len] mask: at batch 32 and a 1k context that is twice the KV bytes read once, and the mask
keeps SDPA off its flash kernel. Here each layer's attention reads the pool where it lies: torch's
FlexAttention with a BlockMask whose KV blocks are a row's physical blocks (its block table), and a
mask_mod that finds, for a pool row, its position in the sequence (through the inverse of the block
table) and decides visibility from two small tensors instead of a dense mask:
- `context[b]`: every query of row b sees the keys at positions < context[b] (the cached prefix);
- `tail[b, q, j]`: query q of row b sees the key at position context[b] + j (this step's tokens:
  causal for a chain, ancestors-and-self for a tree).
Used by the compiled step (rayspec.model.compiled), where FlexAttention is compiled into one fused kernel
per layer; the eager path keeps gather + SDPA (flex_attention run eagerly materializes the scores).
Which is faster depends on the GPU and batch: benchmarks/gpu_roofline.py measures both, and
`EngineConfig.paged_attention` chooses (see rayspec.model.compiled.default_paged_attention).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import numpy as np
import torch

# a BlockMask's query block: one block covers every query row of a step (at most MAX_ROWS = 64 per
# row); GPU kernels need it to be a multiple of their tile (16-128 rows)
Q_BLOCK = 128


@dataclass
class PagedLayout:
    """Where each row's keys lie in the pool and which of them each query sees (see the module doc).

    table:     [B, NB] long, row b's logical block i lies in physical block table[b, i] (scratch past
               a row's blocks; those positions are never visible to a real query)
    context:   [B] long
    tail:      [B, Q, W] bool
    block_size: the pool's rows per block
    logical:   [B, pool blocks] long, the inverse of `table` (inverse_tables): the logical block
               of each physical block in row b, -1 where it is not row b's. Built before the compiled
               forward, not in it: a tensor computed inside the graph and read by the mask_mod gave
               wrong outputs under inductor (torch 2.13 on CPU, 2.11 on an H100), a graph input does not
    """

    table: torch.Tensor
    context: torch.Tensor
    tail: torch.Tensor
    block_size: int
    logical: torch.Tensor

    @classmethod
    def build(cls, table, context, tail, block_size: int, pool_blocks: int) -> "PagedLayout":
        return cls(table, context, tail, block_size, inverse_tables(table, pool_blocks))

    def attend(self, q: torch.Tensor, cache_k: torch.Tensor, cache_v: torch.Tensor) -> torch.Tensor:
        """q [B, heads, Q, D]; cache_k / cache_v one layer's pool [rows, kv_heads, D] -> [B, heads, Q, D]."""
        from torch.nn.attention.flex_attention import flex_attention

        B, _, Q, _ = q.shape
        rows, kv_heads, _ = cache_k.shape
        keys = cache_k.permute(1, 0, 2)[None].expand(B, -1, -1, -1)  # [B, kv_heads, rows, D]: a view
        values = cache_v.permute(1, 0, 2)[None].expand(B, -1, -1, -1)
        scale = None
        if q.device.type == "cpu":  # inductor's CPU lowering of flex_attention takes no view as the query:
            q, scale = q * q.shape[-1] ** -0.5, 1.0  # the scale applied to it makes it a buffer of its own
        out = flex_attention(q, keys, values, block_mask=self.block_mask(Q, rows, q.device), scale=scale,
                             enable_gqa=q.shape[1] != kv_heads)
        return out

    def block_mask(self, num_queries: int, pool_rows: int, device):
        from torch.nn.attention.flex_attention import BlockMask

        bs = self.block_size
        B, NB = self.table.shape
        W = self.tail.shape[-1]
        pool_blocks = pool_rows // bs
        table = self.table
        # the position (in its sequence) of each physical block, per row: -1 where it is not the row's
        logical = self.logical
        # the blocks a row's queries may see: those holding positions < context + W
        seen = torch.clamp((self.context + W + bs - 1) // bs, max=NB).to(torch.int32)
        kv_indices = torch.cat([table.to(torch.int32), table.new_zeros(B, pool_blocks - NB, dtype=torch.int32)],
                               dim=1).view(B, 1, 1, pool_blocks)
        context, tail = self.context, self.tail

        def mask_mod(b, h, q_idx, kv_idx):
            block = logical[b, kv_idx // bs]
            position = block * bs + kv_idx % bs
            j = position - context[b]
            in_tail = (j >= 0) & (j < W) & tail[b, torch.clamp(q_idx, max=tail.shape[1] - 1), torch.clamp(j, 0, W - 1)]
            return (block >= 0) & ((position < context[b]) | in_tail)

        return BlockMask.from_kv_blocks(seen.view(B, 1, 1), kv_indices, BLOCK_SIZE=(Q_BLOCK, bs),
                                        mask_mod=mask_mod, seq_lengths=(num_queries, pool_rows), **_NO_Q_BLOCKS)


# the transposed (query-block) indices are for the backward pass: not built where torch can skip them
_NO_Q_BLOCKS = {}
try:
    from torch.nn.attention.flex_attention import BlockMask as _BlockMask

    if "compute_q_blocks" in inspect.signature(_BlockMask.from_kv_blocks).parameters:
        _NO_Q_BLOCKS = {"compute_q_blocks": False}
except ImportError:  # a torch without FlexAttention: PagedLayout is never built (supported() is False)
    pass


def inverse_tables(table: torch.Tensor, pool_blocks: int) -> torch.Tensor:
    """[B, NB] block tables -> [B, pool_blocks] long: the logical block of each physical block per row
    (-1: not the row's). A block listed twice (scratch) keeps one of its logical indices."""
    B, NB = table.shape
    return torch.full((B, pool_blocks), -1, dtype=torch.long, device=table.device).scatter_(
        1, table, torch.arange(NB, device=table.device).expand(B, NB))


def supported() -> bool:
    try:
        from torch.nn.attention.flex_attention import BlockMask, flex_attention  # noqa: F401
    except ImportError:
        return False
    return True


def chain_tail(Q: int) -> np.ndarray:
    """[Q, Q] bool: a chain's (or one decode token's) queries see this step's keys causally."""
    return np.tril(np.ones((Q, Q), dtype=bool))


def tree_tail(parents: list[int], Q: int) -> np.ndarray:
    """[Q, Q] bool: tree node q sees itself and its ancestors (rows past the tree: the last node's)."""
    n = len(parents)
    sees = np.zeros((Q, Q), dtype=bool)
    for q in range(Q):
        if q >= n:
            sees[q] = sees[n - 1] if n else False
            sees[q, q] = True  # a padding column's own key (never read by a real query)
            continue
        a = q
        while a >= 0:
            sees[q, a] = True
            a = parents[a]
    return sees
