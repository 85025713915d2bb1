"""Batch-invariant attention (EngineConfig.batch_invariant): every query row of a decode or
verification forward computes its attention over exactly its own visible keys, in the order a decode
of that token alone reads them, so its output has the same bits whatever else the forward computes.

Why: SDPA's CPU kernel computes a row differently with the number of query rows beside it and the
masked keys after it (it blocks the query rows into one GEMM and the keys by their count; measured on
an AMD EPYC, torch 2.13: a row of a 2-row verification differed from the same row decoded alone in
float32 in every case tried, and in bfloat16 attention, which runs in float32 on CPU, from 6 rows
on). A K+1-row verification then rounds a row unlike the 1-row decode of target-only decoding, and
a near-tie between two tokens flips: greedy speculative output stops equalling target-only output.

On CPU each row here is one SDPA call over a view of its sequence's keys (a chain's row j: keys
0..start+j; a tree node: the cached prefix, then its ancestors, which commit moves to exactly those
positions if the node is accepted). A 1-row decode goes through the same call. Off the CPU the model
keeps its batched attention and runs it on a kernel whose per-row order does not depend on the
batch (rayspec.model.native.attention: the memory-efficient kernel, one query block's rows
independent, keys in fixed blocks, masked keys adding exact zeros), since one call per row would
cost a kernel launch each; the step runs eager there too (ModelRunner.set_compile). Written for
review: not yet run on a GPU.

The cost on CPU: each row reads its keys again where a batched call reads them once per sequence,
so a verification of k+1 rows, or many sequences' decodes, take longer (BATCH_INVARIANT_BY_DEFAULT).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from rayspec.model.batch_layout import TreeQuery, tree_depths


@dataclass
class RowKeys:
    """Which keys each real query row of a forward attends to, in ForwardBatch.read_kv's layout
    ([B, kv_heads, kv_len, head_dim]: column c of sequence b holds its cache position c).

    spans: per real row (packed order, row after row): (b, lo, hi, at) -- the row sees columns lo..hi-1
           of sequence b (at < 0), or the columns index[at: at + hi - lo] (a tree node's prefix and
           ancestors, not contiguous)
    index: [sum of the tree rows' key counts] long on the device, or None without tree rows
    """

    spans: list[tuple[int, int, int, int]]
    index: torch.Tensor | None = None

    def attend(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
               sinks: torch.Tensor | None = None) -> torch.Tensor:
        """q [N, heads, head_dim] (the real rows, packed); keys / values [B, kv_heads, kv_len, head_dim]
        -> [N, heads, head_dim]. On CPU in float32 (as rayspec.model.native.attention: its reduced
        precision kernel rounds probabilities in blocks shaped by the batch). sinks [heads]: gpt-oss's
        (rayspec.model.native.sink_attention)."""
        from rayspec.model.native import sink_attention

        dtype = q.dtype
        if q.device.type == "cpu" and dtype in (torch.bfloat16, torch.float16):
            q, keys, values = q.float(), keys.float(), values.float()
        gqa = q.shape[1] != keys.shape[1]
        queries, out = q[:, None, :, None], []  # [N, 1, heads, 1, D]: row r's query, as SDPA takes one
        for r, (b, lo, hi, at) in enumerate(self.spans):
            if at < 0:
                k, v = keys[b: b + 1, :, lo:hi], values[b: b + 1, :, lo:hi]
            else:
                cols = self.index[at: at + hi - lo]
                k, v = keys[b: b + 1].index_select(2, cols), values[b: b + 1].index_select(2, cols)
            if sinks is not None:
                out.append(sink_attention(queries[r], k, v, None, sinks))
            else:
                out.append(F.scaled_dot_product_attention(queries[r], k, v, enable_gqa=gqa))  # [1, heads, 1, D]
        return torch.cat(out)[:, :, 0].to(dtype)


def row_key_spans(starts: list[int], lengths: list[int], trees: list[TreeQuery] | None,
                  window: int | None = None) -> tuple[list[tuple[int, int, int, int]], np.ndarray | None]:
    """RowKeys.spans and its host index (int64, None without tree rows) for a forward whose row b
    computes lengths[b] tokens past starts[b] cached ones: a chain (trees None) or the nodes
    trees[b].first.. of a token tree given by parents. window: a sliding-window layer's (a key is
    seen from a query at position p when its position is > p - window)."""
    spans, index = [], []
    for b, (start, n) in enumerate(zip(starts, lengths)):
        if trees is None:
            for j in range(n):
                hi = start + j + 1
                spans.append((b, 0 if window is None else max(0, hi - window), hi, -1))
            continue
        tree = trees[b]
        depths = tree_depths(tree.parents)
        for node in range(tree.first, tree.first + n):
            position = start + depths[node]
            lowest = 0 if window is None else position - window + 1  # the least position it sees
            path, a = [], node
            while a >= 0:  # the node and its ancestors, nearest first
                path.append(a)
                a = tree.parents[a]
            cols = list(range(max(0, lowest), start)) + [start + a for a in reversed(path) if start + depths[a] >= lowest]
            spans.append((b, 0, len(cols), len(index)))
            index += cols
    flat = np.asarray(index, dtype=np.int64) if trees is not None else None
    return spans, flat


# where batch-invariant decoding is on when EngineConfig.batch_invariant is left unset (device type -> on):
# where it measured at most 10% of a step's time; elsewhere it is an option. CPU: off -- SmolLM2 on a
# 2-core AMD EPYC, the settings in turn in one process (benchmarks/results/batch_invariance_cpu_run*.json),
# a 6-row verification took 1.06-1.27x the step time, 4 or 16 of them batched 1.20-1.72x (each row
# reads its keys again). CUDA: not measured yet.
BATCH_INVARIANT_BY_DEFAULT: dict[str, bool] = {"cpu": False, "cuda": False}


def default_batch_invariant(config, model, device: torch.device) -> bool:
    """The engine's batch_invariant: the config's (rayspec.config.EngineSettings), or where unset
    BATCH_INVARIANT_BY_DEFAULT's for this device (off where it cannot run: a model without the path, the
    generic one, a mixture of experts; compile, paged attention or tensor parallelism asked for)."""
    if config.batch_invariant is not None:
        return config.batch_invariant
    if not hasattr(model, "set_batch_invariant") or config.compile or config.paged_attention \
            or config.tensor_parallel_size > 1 or model.args.num_experts:
        return False
    return BATCH_INVARIANT_BY_DEFAULT.get(device.type, False)
