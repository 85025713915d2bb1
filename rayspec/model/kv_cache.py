"""The paged KV cache the model writes at explicit positions (KVCache: per-layer pools of fixed-size
blocks), and ForwardBatch: where one forward reads and writes it (rows, positions, masks)."""

from __future__ import annotations

import math
import mmap
from dataclasses import dataclass

import torch

from rayspec.model.families import ModelArgs
from rayspec.model.parallel import NO_TP, OP_MOVE_ROWS, TPGroup


class KVCache:
    """Per-layer key/value storage in fixed-size blocks (the paged cache; rayspec.kv.block_manager says
    which blocks a sequence holds).

    k[i], v[i]: layer i's pool, [num_blocks * block_size, num_kv_heads, head_dim] each, a tensor of its
    own: block b is rows b * block_size .. (b + 1) * block_size - 1; a forward reads and writes rows by
    index (ForwardBatch.write_index / read_index). With tensor parallelism each rank holds its own KV
    heads (num_kv_heads / size); rank 0's cache (`tp` set) tells the other ranks to do each of its copies.

    Why a tensor per layer, not one [layers, rows, ...] tensor: under torch.compile a write into a
    view of a graph input (`pool[i][rows] = k`) is functionalized into a copy of the layer's slice
    scattered back into the whole pool, every step (a 2-layer step at 8B widths grew 6x from a 16 MB
    to a 512 MB pool: benchmarks/compiled_pool.py); a write into an input of its own stays in place
    (tests/engine/test_compiled_kv.py inspects the generated code).
    """

    def __init__(self, args: ModelArgs, num_blocks: int, block_size: int, dtype, device, tp: TPGroup = NO_TP):
        shape = (num_blocks * block_size, args.num_kv_heads // tp.size, args.head_dim)
        self.k = [zeroed_pool(shape, dtype, device) for _ in range(args.num_layers)]
        self.v = [zeroed_pool(shape, dtype, device) for _ in range(args.num_layers)]
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.tp = tp
        self.cache_id = 0  # with tp: which of the followers' caches mirrors this one (CausalLM.new_cache)

    @staticmethod
    def bytes_per_token(args: ModelArgs, dtype) -> int:
        itemsize = torch.empty((), dtype=dtype).element_size()
        return 2 * args.num_layers * args.num_kv_heads * args.head_dim * itemsize

    def tensors(self) -> list[torch.Tensor]:
        """Every layer's K and V pools."""
        return [*self.k, *self.v]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def rows(self, index: torch.Tensor) -> list[torch.Tensor]:
        """Copies of the given pool rows ([n] long), per layer: K of every layer, then V."""
        return [t[index] for t in self.tensors()]

    def move_rows(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy cache rows src -> dst ([n] long each, rows of the whole pool), every layer (an
        accepted tree path's rows: a few per sequence)."""
        if self.tp.is_driver:
            self.tp.send(OP_MOVE_ROWS, [src.shape[0], self.cache_id], [src, dst])
        for cache in self.tensors():
            cache.index_copy_(0, dst, cache.index_select(0, src))


LAZY_ZERO_MIN_BYTES = 1 << 20


def zeroed_pool(shape: tuple[int, ...], dtype, device) -> torch.Tensor:
    """A zero-filled pool tensor. On CPU, one of 1 MiB or more is an anonymous memory map, which the
    kernel zeroes a page at a time as it is first written: a pool's pages cost nothing until a
    sequence's keys reach them. torch.zeros writes every page at once: a SmolLM2 replica's 1 GB pool
    took 0.26 s to build alone and 4.6-6.2 s with three replicas starting at once on two cores
    (2026-12-05, AMD EPYC VM; page faults, not the memset), and its memory was resident from the
    start. The pool is the same zeros either way (tests/engine/test_kv_cache.py, test_cpu_pool_is_zero_and_takes_memory_only_where_written). On an
    accelerator: torch.zeros (the device's memset, no host pages)."""
    device = torch.device(device)
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if device.type != "cpu" or nbytes < LAZY_ZERO_MIN_BYTES:
        return torch.zeros(shape, dtype=dtype, device=device)
    # the tensor holds the map (frombuffer keeps its buffer alive), unmapped when the tensor is freed
    return torch.frombuffer(mmap.mmap(-1, nbytes), dtype=dtype).view(shape)


@dataclass
class ForwardBatch:
    """Where a forward reads and writes the cache.

    write_index: [B, Q] long, the cache row (of the whole block pool, KVCache) each query token's
               key/value is written to (padding tokens: a scratch block's rows)
    read_index: [B, kv_len] long, the cache row holding each row's key at positions 0..kv_len-1
               (its block table spelled out; positions past a row's blocks: scratch rows, masked)
    positions: [B, Q] long, absolute position of each query token (padding continues past the end)
    kv_len:    keys 0..kv_len-1 are attended (max over rows of start + Q)
    mask:      [B, 1, Q, kv_len] additive float or None (None: one query per row that sees everything)
    cache_positions: [B, Q] long, the position in its sequence each token's key/value is written at;
               None: `positions` (tree queries differ: siblings share a rope position but need their
               own cache rows)
    real_rows: [N] long, the flat indices (row * Q + column) of the real tokens when rows are
               padded; None: every one of the B x Q tokens is real. Projections and MLPs run on
               the N real tokens only (a padded row costs as much as a real one on CPU); only
               attention sees the padded [B, Q] layout.
    packed_output: return [N, ...] (real tokens, row after row) instead of [B, Q, ...]
    sliding_start: keys before it lie outside every query's sliding window (ModelArgs.sliding_window),
               so sliding-window layers attend to keys sliding_start..kv_len-1 only
    sliding_mask: [B, 1, Q, kv_len - sliding_start] additive float, the mask of sliding-window layers
               over those keys; None where `mask` is None (one query per row, at kv_len - 1, whose
               window is exactly those keys) or where the model has no sliding-window layers
    read_range: (lo, hi) when B is 1 and read_index is lo..hi-1 (its blocks consecutive in the pool):
               the keys are read as a view, not gathered
    write_rows: [N] long, write_index of the real tokens (row after row); None: computed from
               write_index and real_rows when asked for (the runner gives it, built on the host)
    paged:     rayspec.model.paged_attention.PagedLayout: attention reads the pool in place through it
               (read_index and mask unused); None: keys gathered through read_index, masked by mask
    row_keys:  rayspec.model.row_attention.RowKeys (batch-invariant, on CPU): each real row attends over
               its own keys, one row at a time (mask unused); sliding_row_keys: sliding-window layers'
    batch_invariant: attention on a kernel whose rows do not depend on the batch (off the CPU:
               rayspec.model.native.attention); set with row_keys too
    """

    write_index: torch.Tensor
    read_index: torch.Tensor
    positions: torch.Tensor
    kv_len: int
    mask: torch.Tensor | None
    cache_positions: torch.Tensor | None = None
    real_rows: torch.Tensor | None = None
    packed_output: bool = False
    sliding_start: int = 0
    sliding_mask: torch.Tensor | None = None
    read_range: tuple[int, int] | None = None
    write_rows: torch.Tensor | None = None
    paged: "PagedLayout | None" = None
    row_keys: "RowKeys | None" = None
    sliding_row_keys: "RowKeys | None" = None
    batch_invariant: bool = False

    def token_write_rows(self) -> torch.Tensor:
        """[N] long: the cache row of each real token (see write_rows)."""
        if self.write_rows is not None:
            return self.write_rows
        flat = self.write_index.reshape(-1)
        return flat if self.real_rows is None else flat.index_select(0, self.real_rows)

    def write_tokens_kv(self, cache_k: torch.Tensor, cache_v: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        rows: torch.Tensor) -> None:
        """k, v: [N, kv_heads, head_dim], the real tokens' keys/values, into one layer's cache
        [rows, kv_heads, head_dim] at `rows` ([N], token_write_rows): one in-place index_copy_ each."""
        cache_k.index_copy_(0, rows, k.to(cache_k.dtype))
        cache_v.index_copy_(0, rows, v.to(cache_v.dtype))

    def write_kv(self, cache_k: torch.Tensor, cache_v: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """k, v: [B, kv_heads, Q, head_dim] into one layer's cache [rows, kv_heads, head_dim]: one
        index_put each."""
        cache_k[self.write_index] = k.transpose(1, 2).to(cache_k.dtype)
        cache_v[self.write_index] = v.transpose(1, 2).to(cache_v.dtype)

    def read_kv(self, cache_k: torch.Tensor, cache_v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer's keys and values through the block tables: [B, kv_heads, kv_len, head_dim] each."""
        if self.read_range is not None:
            lo, hi = self.read_range
            return cache_k[lo:hi][None].transpose(1, 2), cache_v[lo:hi][None].transpose(1, 2)
        # index_select, not cache_k[read_index]: 6x faster on CPU (31 vs 182 us for 1,536 rows of 3 x 64
        # floats, AMD EPYC, 2 threads)
        B, kv_len = self.read_index.shape
        flat = self.read_index.reshape(-1)
        return tuple(c.index_select(0, flat).view(B, kv_len, *c.shape[1:]).transpose(1, 2) for c in (cache_k, cache_v))

    @property
    def shape(self) -> tuple[int, int]:
        return self.positions.shape  # (B, Q)

    def pack(self, x: torch.Tensor) -> torch.Tensor:
        """[B, Q, ...] -> [N, ...]: the real tokens."""
        flat = x.reshape(-1, *x.shape[2:])
        return flat if self.real_rows is None else flat.index_select(0, self.real_rows)

    def unpack(self, x: torch.Tensor) -> torch.Tensor:
        """[N, D] -> [B * Q, D], padding rows zero."""
        if self.real_rows is None:
            return x
        B, Q = self.shape
        return x.new_zeros(B * Q, x.shape[-1]).index_copy_(0, self.real_rows, x)

    def output(self, x: torch.Tensor) -> torch.Tensor:
        """[N, D] -> what the caller asked for: [N, D] or [B, Q, D]."""
        return x if self.packed_output else self.unpack(x).reshape(*self.shape, x.shape[-1])
