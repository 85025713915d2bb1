"""A draft tree grown in one call of tensors and ints (issue #50, item 2b): every depth's head forward,
its top-k, the path scores, the next frontier and the visibility, with nothing between the depths that
waits for the host.

`EagleProposer._draft_trees` grows a tree depth by depth in Python: per depth a head forward (prepared
once per cycle by rayspec.model.tree_steps) and a dozen small device ops, each a launch from the
host. On a GPU that loop was host-bound: 18-19 ms a cycle for a 16-node tree 8 deep at batch 1 on an
H200, against 8.5 ms for the target's verification (benchmarks/results/gpu_engine_h200_run2.json).
`grow_tree` is the same loop as one function of tensors and Python ints, so `torch.compile` makes one
graph of it per (batch bucket, width, depth) (`TreeGraph`): on CUDA a CUDA graph (mode
"reduce-overhead"), so a cycle's drafting is one replay; on CPU inductor's fused kernels, or the
traced graph (aot_eager) in tests. The keys' length is a dynamic dimension (one graph for every
context length). Not inside it: the host's preparation (TreeSteps, once per cycle), the stop callback
(checked before the call) and the early exit of the stop rule (it reads the device after each depth:
the graph runs every depth, and rows with too little chance of being reached are masked as the loop
masks them).

Rows are padded to the batch bucket `Bp` on entry (their depth 0: nothing of them is kept) and the
outputs cut back to B, so the tree of every real row is the loop's, node for node.
"""

from __future__ import annotations

import torch

from rayspec.model.batch_layout import additive_mask, spread_tree_visible
from rayspec.model.kv_cache import ForwardBatch
from rayspec.sampling.sampler import top_logprobs


def grow_tree(head, cache, write: torch.Tensor, read: torch.Tensor, starts: torch.Tensor, cache_pos: torch.Tensor,
              last: torch.Tensor, row_depth: torch.Tensor, depth: int, width: int, stop_prob: float,
              dtype: torch.dtype):
    """The draft tree of each row, grown `depth` levels from the head state `last`.

    head: the EAGLE head (its forward, draft_logits, to_target); cache: its KV pools (written in place);
    write, cache_pos: [depth - 1, Bp, width] each fed node's cache row and position (TreeSteps);
    read: [Bp, kv_len] every key's pool row; starts: [Bp] the prefix lengths; last: [Bp, H] the head's
    output at each row's last token; row_depth: [Bp] how deep each row may grow (0: padding); dtype: the
    attention mask's (the runner's compute dtype).
    -> tokens, path log-probabilities and parents, each [Bp, width + (depth - 1) * width^2] in node order
    (the root's children, then each depth's width^2 children; -inf: a node not grown)."""
    Bp, w, dev = last.shape[0], width, last.device
    n = (depth - 1) * w  # fed node slots
    kv_len = read.shape[1]
    logp, top = top_logprobs(head.draft_logits(last), w)  # [Bp, w]
    f_tok = head.to_target(top)
    f_score = logp.masked_fill((row_depth < 1)[:, None], float("-inf"))
    f_node = torch.arange(w, device=dev).expand(Bp, w)
    f_hidden = last[:, None].expand(Bp, w, last.shape[-1])
    toks, scores, parents = [f_tok], [f_score], [torch.full((Bp, w), -1, dtype=torch.long, device=dev)]
    stopped = _stopped(f_score, stop_prob) if stop_prob > 0 else torch.zeros(Bp, dtype=torch.bool, device=dev)
    sees = torch.zeros(Bp, n, n, dtype=torch.bool, device=dev)  # fed node -> the fed nodes it sees
    eye = torch.eye(w, dtype=torch.bool, device=dev)
    f_fed_parent = None
    num_nodes = w
    for d in range(2, depth + 1):
        lo = (d - 2) * w
        if f_fed_parent is not None:
            sees[:, lo: lo + w] = sees.gather(1, f_fed_parent[..., None].expand(Bp, w, n))
        sees[:, lo: lo + w, lo: lo + w] = eye
        visible = spread_tree_visible(sees[:, None, lo: lo + w], starts, kv_len)  # prefix + ancestry
        batch = ForwardBatch(write_index=write[d - 2], read_index=read,
                             positions=(starts + (d - 2))[:, None].expand(Bp, w), kv_len=kv_len,
                             mask=additive_mask(visible, dtype), cache_positions=cache_pos[d - 2])
        hidden = head(f_tok, cache, batch, features=f_hidden.contiguous())  # [Bp, w, H]
        logp, top = top_logprobs(head.draft_logits(hidden), w)  # [Bp, w, w]
        children, frontier = expand_frontier(f_score, f_node, logp, head.to_target(top), hidden,
                                             stopped | (row_depth < d), num_nodes, lo)
        for out, x in zip((toks, scores, parents), children):
            out.append(x)
        f_tok, f_score, f_node, f_hidden, f_fed_parent = frontier
        if stop_prob > 0:
            stopped = stopped | _stopped(f_score, stop_prob)
        num_nodes += w * w
    return torch.cat(toks, 1), torch.cat(scores, 1), torch.cat(parents, 1)


def expand_frontier(f_score, f_node, logp, child_tok, hidden, dead, num_nodes: int, lo: int):
    """One depth of a tree (grow_tree's and EagleProposer._draft_trees' loops): the `w` frontier nodes' `w`
    children each (log-probabilities logp, target tokens child_tok: [B, w, w]; rows `dead` [B] grow none:
    -inf) -> ((their tokens, path scores, parents) [B, w * w], the next frontier: the best w children by path
    score as (tokens, scores, node numbers, the head states that predicted them [B, w, H], their parents'
    fed slots))."""
    B, w = f_score.shape
    c_score = (f_score[..., None] + logp).masked_fill(dead[:, None, None], float("-inf")).reshape(B, w * w)
    c_tok = child_tok.reshape(B, w * w)
    parents = f_node[..., None].expand(B, w, w).reshape(B, w * w)
    best = torch.topk(c_score, w)
    slot = best.indices // w  # which frontier node each one hangs from
    frontier = (c_tok.gather(1, best.indices), best.values, num_nodes + best.indices,
                hidden.gather(1, slot[..., None].expand(B, w, hidden.shape[-1])), lo + slot)
    return (c_tok, c_score, parents), frontier


def _stopped(scores: torch.Tensor, stop_prob: float) -> torch.Tensor:
    """[B, w] frontier path scores -> [B] bool: too little chance to be reached (EagleProposer._stopped)."""
    return scores.exp().sum(-1) < stop_prob


class TreeGraph:
    """grow_tree compiled: one graph per (batch bucket, width, depth), the keys' length dynamic (a cycle
    whose budget is under the configured depth grows fewer levels: a graph per depth, at most `num_steps`
    of them, rather than every level grown and masked); on CUDA
    a CUDA graph (the head's pools marked as static addresses, the outputs copied out of the graph's
    buffers before the next replay reuses them)."""

    def __init__(self, backend: str, mode: str | None):
        import torch._dynamo

        torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
        self.mode = mode
        self.fn = (torch.compile(grow_tree, dynamic=False, mode=mode) if backend == "inductor"
                   else torch.compile(grow_tree, dynamic=False, backend=backend))
        self.shapes: set[tuple[int, int, int]] = set()  # (batch bucket, width, depth) called
        self._static: set[int] = set()

    def __call__(self, head, cache, steps, last: torch.Tensor, row_depth: torch.Tensor, depth: int,
                 stop_prob: float, dtype: torch.dtype):
        """steps: the cycle's TreeSteps (compiled: rows padded to its bucket); last [B, H], row_depth [B]
        -> (tokens, scores, parents) [B, nodes]."""
        B, Bp = last.shape[0], steps.Bp
        if self.mode == "reduce-overhead" and id(cache) not in self._static:
            for pool in cache.tensors():
                torch._dynamo.mark_static_address(pool)
            self._static.add(id(cache))
        if Bp > B:
            last = torch.cat([last, last.new_zeros(Bp - B, last.shape[1])])
            row_depth = torch.cat([row_depth, row_depth.new_zeros(Bp - B)])
        torch._dynamo.mark_dynamic(steps.read, 1)
        self.shapes.add((Bp, steps.width, depth))
        out = self.fn(head, cache, steps.write, steps.read, steps.starts, steps.cache_pos, last, row_depth,
                      depth, steps.width, stop_prob, dtype)
        return tuple((o[:B].clone() if self.mode == "reduce-overhead" else o[:B]) for o in out)
