"""How a batch's tokens are laid out for a forward, as plain functions of lengths and trees: token
trees (TreeQuery) and their depths and visibility masks, sliding-window masks, prefill length groups
and catch-up pieces, packed offsets and last rows. rayspec.model.runner builds each forward from them."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from rayspec.device_io import to_device


@dataclass
class TreeQuery:
    """A token tree under a sequence's cached prefix (see ModelRunner.forward_hidden).

    parents[j]: the node j hangs from (an earlier index), or -1 for the prefix's last token.
    first: this forward computes nodes first..first+len(tokens)-1; earlier ones are cached.
    Or, for a tree whose shape only the device knows (an EAGLE head growing its draft tree there):
    depths[j], node j's depth (0: hangs from the prefix), and sees, [computed nodes, nodes so far]
    bool on the device: which nodes each computed node attends to (its ancestors and itself); with
    depth_add, the depths too are completed on the device (first = 0).
    """

    parents: list[int] | None
    first: int = 0
    depths: list[int] | None = None
    sees: torch.Tensor | None = None
    # [num_nodes] long on the device, added to the nodes' rope positions (depths then hold placeholders):
    # a verification tree whose depths only the device knows (rayspec.engine.deferred_verify)
    depth_add: torch.Tensor | None = None

    @property
    def num_nodes(self) -> int:
        return len(self.parents) if self.parents is not None else len(self.depths)


def tree_depths(parents: list[int]) -> list[int]:
    depths: list[int] = []
    for p in parents:
        depths.append(0 if p < 0 else depths[p] + 1)
    return depths


def tree_layout_host(trees: list[TreeQuery], starts: list[int], Q: int, kv_len: int,
                     with_key_positions: bool = False):
    """Rope positions [B, Q], cache rows [B, Q], visibility [B, 1, Q, kv_len] for tree rows, and
    with_key_positions the position of each cache row's key [B, kv_len] (a tree node's: its rope
    position; a sliding window counts positions, not cache rows), else None; numpy arrays. For a
    tree given by `sees`, visibility covers the prefix only: the caller adds the nodes' own."""
    positions, cache_positions, nodes_visible = tree_layout_nodes(trees, starts, Q)
    B, W = len(trees), nodes_visible.shape[-1]
    visible = np.zeros((B, 1, Q, kv_len), dtype=bool)
    key_positions = np.tile(np.arange(kv_len, dtype=np.int64), (B, 1)) if with_key_positions else None
    for b, (tree, start) in enumerate(zip(trees, starts)):
        visible[b, 0, :, :start] = True
        visible[b, 0, :, start: start + W] = nodes_visible[b, 0, :, : kv_len - start]
        if key_positions is not None:
            depths = tree.depths if tree.parents is None else tree_depths(tree.parents)
            key_positions[b, start: start + len(depths)] = start + np.asarray(depths, dtype=np.int64)
    return positions, cache_positions, visible, key_positions


def tree_layout_nodes(trees: list[TreeQuery], starts: list[int], Q: int):
    """tree_layout_host without the prefix: rope positions [B, Q], cache rows [B, Q], and which nodes
    each row sees [B, 1, Q, W] (W: the most nodes of a tree; node j is cache row start + j), for
    `spread_tree_visible` to place after the prefix on the device: host work per tree node, not per
    position of the context. For a tree given by `sees`, no node is marked (the caller adds them)."""
    # built in numpy: element writes into torch tensors cost microseconds each, on every draft step
    B = len(trees)
    W = max(1, max(t.num_nodes for t in trees))
    positions = np.zeros((B, Q), dtype=np.int64)
    cache_positions = np.zeros((B, Q), dtype=np.int64)
    visible = np.zeros((B, 1, Q, W), dtype=bool)
    for b, (tree, start) in enumerate(zip(trees, starts)):
        depths = tree.depths if tree.parents is None else tree_depths(tree.parents)
        n = len(depths)
        for q in range(Q):
            node = min(tree.first + q, n - 1)  # padding repeats the last node
            positions[b, q] = start + depths[node]
            cache_positions[b, q] = start + node if tree.first + q < n else start + tree.first + q
            if tree.parents is None:
                continue
            a = node
            while a >= 0:
                visible[b, 0, q, a] = True
                a = tree.parents[a]
    return positions, cache_positions, visible


def spread_tree_visible(nodes_visible: torch.Tensor, starts: torch.Tensor, kv_len: int) -> torch.Tensor:
    """[B, 1, Q, kv_len] bool on the device: every row sees its sequence's prefix (positions below
    starts [B]) and the nodes nodes_visible [B, 1, Q, W] marks (tree_layout_nodes), at start + j."""
    B, _, Q, W = nodes_visible.shape
    rel = torch.arange(kv_len, device=starts.device)[None] - starts[:, None]  # [B, kv_len]
    index = rel.clamp(0, W - 1)[:, None, None, :].expand(B, 1, Q, kv_len)
    nodes = nodes_visible.gather(3, index) & ((rel >= 0) & (rel < W))[:, None, None, :]
    return nodes | (rel < 0)[:, None, None, :]


def tree_layout(trees: list[TreeQuery], starts: list[int], Q: int, kv_len: int, device,
                with_key_positions: bool = False):
    """tree_layout_host's arrays as tensors on `device` (trees given by parents)."""
    arrays = [a for a in tree_layout_host(trees, starts, Q, kv_len, with_key_positions) if a is not None]
    out = to_device(*arrays, device=torch.device(device))
    return (*out, None) if not with_key_positions else tuple(out)


def sliding_window_mask(visible, mask, positions, key_positions, window: int, first_start: int, kv_len: int):
    """(sliding_start, sliding_mask) of a ForwardBatch (see there) for layers that see, from a query
    at position p, only keys at positions p - window + 1 .. p (transformers' sliding window: key
    position > p - window).

    visible: [B, 1, Q, kv_len] bool, or None (one query per row, at kv_len - 1: no mask needed);
    mask: its additive form; positions: [B, Q] query positions; key_positions: [B or 1, kv_len]
    each cache row's position (None with visible); first_start: the least cached length of a row
    (no query sits before it).
    Keys before first_start - window + 1 are outside every window: they are cut, not masked."""
    start = max(0, first_start - window + 1)
    if visible is None:  # the single query's window is exactly the keys from `start` on
        return start, None
    if kv_len <= window:  # every position is < window: no query's window excludes a key
        return 0, mask
    in_window = key_positions[:, None, None, start:] > positions[:, None, :, None] - window  # [B, 1, Q, kv_len - start]
    return start, additive_mask(visible[..., start:] & in_window, mask.dtype)


def catch_up_pieces(lengths: list[int], max_tokens: int | None) -> list[list[tuple[int, int, int]]]:
    """Forwards that take rows' new tokens (row i: lengths[i] of them) with at most max_tokens
    padded tokens each, as lists of (row, lo, hi): all rows at once when rows x longest fits (or
    with no bound); else the rows that fit a forward, longest first, packed into as few forwards as
    rows x longest allows, and each longer row alone, in order, in pieces of max_tokens. A
    proposer's first catch-up on a long prompt then costs a chunk's activations, not the prompt's,
    and a wave of short catch-ups (256 new requests of 9 tokens each) a few forwards, not one each."""
    if max_tokens is None or not lengths or len(lengths) * max(lengths) <= max_tokens:
        return [[(i, 0, n) for i, n in enumerate(lengths)]]
    short = sorted((i for i, n in enumerate(lengths) if n <= max_tokens), key=lambda i: -lengths[i])
    pieces: list[list[tuple[int, int, int]]] = []
    for i in short:  # longest first: a forward's first row is its longest
        if pieces and (len(pieces[-1]) + 1) * max(lengths[pieces[-1][0][0]], 1) <= max_tokens:
            pieces[-1].append((i, 0, lengths[i]))
        else:
            pieces.append([(i, 0, lengths[i])])
    return pieces + [[(i, lo, min(lo + max_tokens, n))] for i, n in enumerate(lengths) if n > max_tokens
                     for lo in range(0, n, max_tokens)]


def prefill_groups(lengths: list[int], overhead_tokens: int, max_padded_tokens: int | None = None) -> list[list[int]]:
    """Split prompts (indices into `lengths`) into batches to prefill, padding included.

    A padded batch costs about len(batch) x its longest prompt in tokens, and every forward a
    fixed `overhead_tokens` more (weights read, per-op costs). On CPU, where prefill is
    compute-bound, one 243-token prompt among seven of ~60 would make the batch cost 8 x 243;
    here it goes alone. Exact minimum over groups of consecutive lengths in sorted order (n is
    at most max_num_seqs, so the O(n^2) search is nothing). With max_padded_tokens, no group of
    two or more costs more than that (rows x longest): attention sees the padded layout.
    """
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    n = len(order)
    best = [0.0] + [float("inf")] * n  # best[j]: cost of prefilling the j shortest prompts
    cut = [0] * (n + 1)
    for j in range(1, n + 1):
        for i in range(j):  # the last group: sorted positions i..j-1, its longest is position j-1
            padded = (j - i) * lengths[order[j - 1]]
            if max_padded_tokens is not None and j - i > 1 and padded > max_padded_tokens:
                continue
            cost = best[i] + overhead_tokens + padded
            if cost < best[j]:
                best[j], cut[j] = cost, i
    groups, j = [], n
    while j > 0:
        groups.append(order[cut[j]:j])
        j = cut[j]
    return groups[::-1]


def pad_rows(x: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """[B, Q, ...] -> [rows, cols, ...], zero past B and Q (on x's device; x itself when it fits)."""
    if tuple(x.shape[:2]) == (rows, cols):
        return x
    out = x.new_zeros(rows, cols, *x.shape[2:])
    out[: x.shape[0], : x.shape[1]] = x
    return out


def additive_mask(visible: torch.Tensor, dtype) -> torch.Tensor:
    # an additive float mask keeps SDPA on its fused CPU kernel (a bool mask falls back to math)
    return torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill_(~visible, float("-inf"))


def packed_offsets(lengths: list[int]) -> list[int]:
    """Where each row's tokens start in a packed [N, ...] output."""
    return np.concatenate(([0], np.cumsum(lengths)[:-1])).astype(int).tolist()


def last_rows(hidden: torch.Tensor, lengths: list[int]) -> torch.Tensor:
    """[B, Q, H] -> [B, H]: the last real (unpadded) row of each sequence."""
    B, Q = hidden.shape[:2]
    if all(n == Q for n in lengths):
        return hidden[:, -1]
    (idx,) = to_device(np.asarray([b * Q + n - 1 for b, n in enumerate(lengths)], dtype=np.int64),
                       device=hidden.device)
    return hidden.reshape(B * Q, *hidden.shape[2:]).index_select(0, idx)


def add_tree_depths(positions: torch.Tensor, trees: list[TreeQuery] | None) -> None:
    """positions: [B(+padding), Q] rope positions on the device, in place: each tree's depth_add on
    its nodes' rows."""
    for b, tree in enumerate(trees or []):
        if tree.depth_add is not None:
            positions[b, : tree.depth_add.shape[0]] += tree.depth_add


def rows_of_blocks(blocks: torch.Tensor, block_size: int, kv_len: int) -> torch.Tensor:
    """[B, kv_len] the pool row of each position 0..kv_len-1, from the blocks [B, nb] holding them
    (KVSpace.covering_blocks), on their device."""
    B, nb = blocks.shape
    offsets = torch.arange(block_size, device=blocks.device)
    return (blocks[:, :, None] * block_size + offsets).reshape(B, nb * block_size)[:, :kv_len]
