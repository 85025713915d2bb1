"""Drafts that stay on the device until the verification's one read.

A proposer asked to defer (ProposeRequest.defer_read) answers with Drafts whose tokens are still on
the device (`Draft.deferred`, a DeferredRow): the engine verifies them where they are (their tokens
placed into its input ids on the device, a tree's ancestry and depths as device tensors:
rayspec.model.batch_layout.TreeQuery) and reads them back with the target's choices, in the one
read of the cycle (rayspec.device_io.to_host; rayspec.engine.deferred_verify). `DeferredBatch.finish`
then turns the read arrays into the host Drafts every later phase uses.

A deferred draft takes a fixed number of verification rows, known before drafting (its budget):
the nodes the host would have kept come first, in the order it would have kept them; rows past
them (a stop rule or a short tree left fewer) are verified and never accepted (the host Draft
does not hold them).

`select_tree` is EagleProposer's host tree choice (`_add_lookup_branch`, `_keep`, `_tree_draft`)
done with device ops: the same nodes in the same order (tests/engine/test_deferred_reads.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from rayspec.device_io import to_device


@dataclass
class DeferredRow:
    """One request's draft, still on the device."""
    batch: "DeferredBatch"
    row: int  # its row in the batch's read tensors
    num_nodes: int  # verification rows it takes
    tokens: torch.Tensor  # [num_nodes] target ids
    depth: torch.Tensor | None = None  # [num_nodes] 1: a child of the last committed token; None: a chain
    sees: torch.Tensor | None = None  # [num_nodes, num_nodes] bool: each node's ancestors and itself (trees)
    parents: torch.Tensor | None = None  # [num_nodes] each node's parent among them, -1 the root (trees)
    live: torch.Tensor | None = None  # [num_nodes] bool: the node is kept (trees; a chain's all are)
    probs: torch.Tensor | None = None  # [num_nodes, vocab] a sampled chain's q, None for a point mass


class DeferredBatch:
    """What one proposer call left on the device: `tensors` to read (with the engine's own, in its
    one read) and `finish(arrays) -> list[Draft]` (one per row) that builds the host drafts."""

    def __init__(self, tensors: list[torch.Tensor], finish: Callable[[list[np.ndarray]], list]):
        self.tensors = tensors
        self._finish = finish
        self.drafts: list | None = None

    def finish(self, arrays: list[np.ndarray]) -> None:
        self.drafts = self._finish(arrays)


def graft_lookup(tok: torch.Tensor, score: torch.Tensor, parent: torch.Tensor, depth: torch.Tensor,
                 chains: list[list[int]]):
    """The n-gram prompt-lookup chains grafted onto raw trees as sure branches (EagleProposer's
    `_add_lookup_branch`): a chain token matching a live child of the chain's node so far gives that
    node path score 0; otherwise a new node (score 0) hangs there.

    tok, score, parent: [B, R] raw nodes (target ids, path log-probabilities with -inf for a dead node,
    parent raw index or -1 for the root), depth: [B, R] (1: a child of the root). Returns them
    extended to [B, R + L] (L the longest chain; a slot of a shorter chain stays dead)."""
    B, R = tok.shape
    L = max((len(c) for c in chains), default=0)
    if not L:
        return tok, score, parent, depth
    dev = tok.device
    chain = np.zeros((B, L), dtype=np.int64)
    valid = np.zeros((B, L), dtype=bool)
    for b, c in enumerate(chains):
        chain[b, : len(c)] = c
        valid[b, : len(c)] = True
    chain_t, valid_t = to_device(chain, valid, device=dev)
    live = score > float("-inf")  # [B, R] (a raw node the host never saw cannot be matched)
    tok = torch.cat([tok, chain_t], 1)
    score = torch.cat([score, torch.full((B, L), float("-inf"), dtype=score.dtype, device=dev)], 1)
    parent = torch.cat([parent, torch.full((B, L), -1, dtype=parent.dtype, device=dev)], 1)
    depth = torch.cat([depth, torch.arange(1, L + 1, device=dev).expand(B, L)], 1)
    rows = torch.arange(B, device=dev)
    at = torch.full((B,), -1, dtype=torch.long, device=dev)  # each row's chain node so far
    zero = torch.zeros((), dtype=score.dtype, device=dev)
    for j in range(L):
        match = live & (parent[:, :R] == at[:, None]) & (tok[:, :R] == chain_t[:, j, None])  # [B, R]
        found = match.any(1)
        first = match.to(torch.float32).argmax(1)  # the first match (argmax takes the first maximum)
        use = valid_t[:, j]
        score[rows, first] = torch.where(use & found, zero, score[rows, first])
        new = use & ~found
        score[:, R + j] = torch.where(new, zero, score[:, R + j])
        parent[:, R + j] = at
        at = torch.where(use & found, first, torch.where(new, torch.full_like(at, R + j), at))
    return tok, score, parent, depth


def select_tree(tok: torch.Tensor, score: torch.Tensor, parent: torch.Tensor, depth: torch.Tensor,
                budgets: list[int], max_depth: int):
    """Each row's `budgets[b]` best nodes by path score (shallower first on ties, then earlier),
    ordered by depth (parents before children): EagleProposer._keep on the device.

    tok, score, parent, depth: [B, N] (as graft_lookup returns them); max_depth: the deepest node.
    Returns (tokens [B, K], parents [B, K] (index among the kept, -1 the root), kept [B, K] bool,
    depths [B, K], sees [B, K, K]) with K = max(budgets); row b's kept nodes come first, the rest
    (dead, or past its budget) are not kept and hang from the root."""
    B, N = tok.shape
    dev = tok.device
    K = min(max(budgets), N)
    # (-score, depth, index): stable sorts, the least significant key first
    order = torch.argsort(depth, dim=1, stable=True)
    order = order.gather(1, torch.argsort(-score.gather(1, order), dim=1, stable=True))
    top = order[:, :K]  # [B, K]
    (budget_t,) = to_device(np.asarray(budgets, dtype=np.int64), device=dev)
    kept = (score.gather(1, top) > float("-inf")) & (torch.arange(K, device=dev)[None] < budget_t[:, None])
    # kept first, then by (depth, index): parents come before their children
    top_depth = depth.gather(1, top)
    key = (~kept).long() * (N * (max_depth + 2)) + top_depth * N + top
    perm = torch.argsort(key, dim=1)
    top, kept = top.gather(1, perm), kept.gather(1, perm)
    position = torch.full((B, N), -1, dtype=torch.long, device=dev)
    position.scatter_(1, top, torch.arange(K, device=dev).expand(B, K).contiguous())
    raw_parent = parent.gather(1, top)
    parents = torch.where(raw_parent >= 0, position.gather(1, raw_parent.clamp(min=0)), -1)
    parents = torch.where(kept, parents, -1)
    depths = torch.where(kept, depth.gather(1, top), 1)
    return tok.gather(1, top), parents, kept, depths, ancestry(parents, max_depth)


def ancestry(parents: torch.Tensor, max_depth: int) -> torch.Tensor:
    """parents: [B, K] (-1 the root) -> [B, K, K] bool: node j sees node i (i is j or an ancestor)."""
    B, K = parents.shape
    columns = torch.arange(K, device=parents.device)
    sees = (columns[:, None] == columns[None, :]).expand(B, K, K).clone()
    cur = parents
    for _ in range(max_depth):
        up = cur >= 0
        # (a comparison, not F.one_hot: one_hot checks its input's range on the host, a read on CUDA)
        sees |= (cur[..., None] == columns) & up[..., None]
        cur = torch.where(up, parents.gather(1, cur.clamp(min=0)), -1)
    return sees


def defer_trees(tok: torch.Tensor, score: torch.Tensor, parent: torch.Tensor, raw_depth: list[int],
                budgets: list[int], chains: list[list[int]]) -> list:
    """EAGLE trees grown on the device ([B, R] raw nodes as graft_lookup takes them; raw_depth [R]),
    chosen there (graft_lookup, select_tree) and left there: a Draft per row with `deferred` set."""
    from rayspec.proposers.base import Draft

    B = tok.shape[0]
    (depth,) = to_device(np.asarray(raw_depth, dtype=np.int64), device=tok.device)
    tok, score, parent, depth = graft_lookup(tok, score, parent, depth.expand(B, -1), chains)
    max_depth = max(raw_depth, default=0) + max((len(c) for c in chains), default=0)
    tokens, parents, kept, depths, sees = select_tree(tok, score, parent, depth, budgets, max_depth)

    def finish(arrays: list[np.ndarray]) -> list:
        t, p, k = arrays
        return [Draft(t[b, : int(k[b].sum())].tolist(), None, p[b, : int(k[b].sum())].tolist()) for b in range(B)]

    batch = DeferredBatch([tokens, parents, kept], finish)
    rows = [min(n, tokens.shape[1]) for n in budgets]
    return [Draft([], deferred=DeferredRow(batch, b, n, tokens[b, :n], depths[b, :n], sees[b, :n, :n], parents[b, :n],
                                           kept[b, :n]))
            for b, n in enumerate(rows)]


def defer_chains(tok: torch.Tensor, budgets: list[int], read: list[torch.Tensor],
                 finish: Callable[[list[np.ndarray]], list], probs: list | None = None) -> list:
    """Chains drafted on the device (tok [B, K] target ids), left there: a Draft per row with
    `deferred` set; `finish(arrays of read)` builds the host drafts after the engine's read (each
    row's draft its first min(budget, K) tokens). probs[b]: row b's q rows ([>= its tokens, vocab]:
    the distributions a sampled row drew from) or None."""
    from rayspec.proposers.base import Draft

    batch = DeferredBatch(read, finish)
    rows = [min(n, tok.shape[1]) for n in budgets]
    probs = probs or [None] * len(rows)
    return [Draft([], deferred=DeferredRow(batch, b, n, tok[b, :n], probs=q[:n] if q is not None and n else None))
            for b, (n, q) in enumerate(zip(rows, probs))]
