"""EAGLE-3 and EAGLE-1 proposers: a draft head fed with the target's hidden states.

Per sequence the head keeps its own KV cache over "pairs": head position i reads the target
features at i with token i+1. The engine hands over the features of every token the target
has committed (`ProposeRequest.features`), the head catches up on them in one batched
forward, then drafts:
- where the engine asks for a tree (small batches, `eagle_topk` > 1), a tree (EAGLE-2 style):
  each depth expands the `eagle_topk` best frontier nodes by path probability into their
  `eagle_topk` best children, and the `num_tokens` best nodes overall are sent for
  verification. The nodes are chosen, not sampled, also for sampled requests: the engine
  verifies those with multi-round rejection over siblings, each node a point-mass draft
  (rayspec.rejection.verify_tree_sampled), so temperature > 0 stays exact;
- otherwise a chain: the top token per depth (greedy), or for sampled requests a chain
  sampled from the head's distribution, with the probabilities, for the rejection rule.
Drafted positions are dropped from the head cache afterwards (only committed pairs stay).
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import torch

from rayspec.eagle.head import EagleHead
from rayspec.proposers.base import Draft, Proposer, ProposeRequest
from rayspec.proposers.ngram import find_ngram_continuation
from rayspec.runner import (DEFAULT_BLOCK_SIZE, ModelRunner, TreeQuery, catch_up_pieces, last_rows,
                            proposer_num_blocks)
from rayspec.sampling import logits_to_probs, make_generator


class _Node:
    __slots__ = ("token", "parent", "score", "depth", "hidden", "fed")

    def __init__(self, token: int, parent: int, score: float, depth: int, hidden: torch.Tensor):
        self.token, self.parent, self.score, self.depth = token, parent, score, depth
        self.hidden = hidden  # [H] head output that predicted this node (its input feature)
        self.fed = -1  # head-cache tree index once fed


def _load_target_io(context):
    """The target without its decoder layers: the embedding (and LM head) a head shares with it.

    args.num_layers stays the full count (EAGLE-3 picks its default feature layers from it)."""
    import dataclasses

    from rayspec.loader import load_hf_config, load_model, resolve_model_dir

    num_layers = load_hf_config(resolve_model_dir(context.target_model)).num_hidden_layers
    target, _ = load_model(context.target_model, device=context.device, dtype=context.dtype, num_layers=0)
    target.args = dataclasses.replace(target.args, num_layers=num_layers)
    return target


def draft_dtype(name: str | None, context) -> torch.dtype:
    """The head's dtype (`draft_dtype`; default the target's). Drafts only steer speed: the
    verifier keeps the output exact whatever the head's precision. On CPU, bfloat16 measured no
    faster for the SmolLM2 head (its forwards are small; Python, not the matmuls, bounds them)."""
    from rayspec.loader import parse_dtype

    return parse_dtype(name or context.dtype, context.device)


class EagleProposer(Proposer):
    name = "eagle3"
    kind = "eagle3"

    @classmethod
    def create(cls, config, context) -> "EagleProposer":
        from rayspec.eagle.checkpoint import load_eagle_head

        if not config.draft_model:
            raise ValueError(f"method {cls.name!r} needs the head's location in `draft_model`")
        target = context.target
        # a proposer deployment (disaggregated), or a tensor-parallel target (rank 0 holds a slice of its
        # vocabulary): load what the head shares, whole. The features need nothing: the layer inputs
        # (the residual stream) are whole on every rank after each block's all-reduce.
        if target is None or getattr(getattr(target, "tp", None), "size", 1) > 1:
            target = _load_target_io(context)
        head = load_eagle_head(config.draft_model, target, kind=cls.kind, device=context.device,
                               dtype=draft_dtype(config.draft_dtype, context))
        proposer = cls(head, context.max_model_len, context.num_slots, config.num_speculative_tokens,
                       topk=config.eagle_topk, depth=config.num_steps, stop_prob=config.eagle_stop_prob,
                       lookup=(config.eagle_prompt_lookup, config.prompt_lookup_min, config.prompt_lookup_max),
                       target_blocks=context.num_blocks, block_size=context.block_size,
                       enable_prefix_caching=context.enable_prefix_caching)
        proposer.runner.max_chunk_tokens = context.max_num_batched_tokens
        return proposer

    def __init__(self, head: EagleHead, max_model_len: int, num_slots: int, max_draft_tokens: int,
                 topk: int = 1, depth: int | None = None, stop_prob: float = 0.0,
                 lookup: tuple[int, int, int] = (0, 2, 5), target_blocks: int | None = None,
                 block_size: int = DEFAULT_BLOCK_SIZE, enable_prefix_caching: bool = False):
        self.head = head
        self.stop_prob = stop_prob
        self.lookup_tokens, self.lookup_min, self.lookup_max = lookup  # n-gram branch (0: none)
        self.topk = max(1, topk)
        self.depth = depth or max_draft_tokens
        slack = self.topk * self.depth + max_draft_tokens + 2
        num_blocks = proposer_num_blocks(target_blocks, num_slots, max_model_len + slack, slack, block_size)
        self.runner = ModelRunner(head, max_model_len, num_slots, slack=slack, num_blocks=num_blocks,
                                  block_size=block_size, enable_prefix_caching=enable_prefix_caching)
        self._features: dict[str, list[torch.Tensor]] = {}  # handed over, not yet in the head cache
        self._generators: dict[str, torch.Generator] = {}
        self._last_used: dict[str, int] = {}  # seq id -> call clock (evicts the stalest when slots run out)
        self._clock = itertools.count()

    # what the engine must hand over: inputs of these target layers, or () for the final hidden state
    @property
    def feature_layers(self) -> tuple[int, ...]:
        return self.head.config.aux_layers if self.head.config.kind == "eagle3" else ()

    def release(self, seq_id: str) -> None:
        self.runner.free(seq_id)
        self._features.pop(seq_id, None)
        self._generators.pop(seq_id, None)
        self._last_used.pop(seq_id, None)

    def _generator(self, req: ProposeRequest) -> torch.Generator:
        if req.seq_id not in self._generators:
            seed = None if req.seed is None else req.seed + 0x5EED
            self._generators[req.seq_id] = make_generator(seed, self.runner.device)
        return self._generators[req.seq_id]

    # ---- prefix caching ----------------------------------------------------------------
    # Head position i holds the pair (target feature i, token i + 1), and feature i is a function of
    # tokens 0..i: so position i's keys and values depend on tokens 0..i + 1 alone. The head's blocks
    # are hashed over the pairs (token i, token i + 1), one int each (`_pair_tokens`): a chain over
    # pairs 0..i covers tokens 0..i + 1, the same rule as the target's, one token later.
    @staticmethod
    def _pair_tokens(token_ids: list[int]) -> list[int]:
        return [(a << 32) | b for a, b in zip(token_ids, token_ids[1:])]

    def cached_prefix(self, seq_id: str, token_ids: list[int]) -> int | None:
        if not self.runner.prefix_caching:
            return None
        if self.runner.has(seq_id):
            self.release(seq_id)
        if self.runner.num_free_slots == 0:
            return 0
        cached = self.runner.allocate(seq_id, self._pair_tokens(token_ids))
        self._features[seq_id] = []
        self._last_used[seq_id] = next(self._clock)
        return cached

    def trim_prefix(self, seq_id: str, num_tokens: int) -> None:
        if self.runner.has(seq_id) and self.runner.cached_len(seq_id) > num_tokens:
            self.runner.set_cached_len(seq_id, num_tokens)

    # ---- catch-up --------------------------------------------------------------------
    def _allocate(self, seq_id: str) -> None:
        if self.runner.num_free_slots == 0:  # sequences left behind by another verifier's routing
            stale = min((s for s in self._last_used if s in self._features), key=self._last_used.get)
            self.release(stale)  # if it comes back, it is caught up through resend_features_from
        self.runner.allocate(seq_id)
        self._features[seq_id] = []

    def _take_features(self, req: ProposeRequest) -> bool:
        """Buffer the request's features; False when they do not continue what this proposer holds."""
        if self.runner.has(req.seq_id) and req.features_start == 0 and req.features is not None:
            self.release(req.seq_id)  # features from the start again (a resend): rebuild from scratch
        if not self.runner.has(req.seq_id):
            if req.features_start > 0:  # a sequence that started elsewhere
                return False
            self._allocate(req.seq_id)
        self._last_used[req.seq_id] = next(self._clock)
        if req.features is not None and len(req.features):
            buffered = sum(len(f) for f in self._features[req.seq_id])
            expected = self.runner.cached_len(req.seq_id) + buffered
            if not buffered and req.features_start < expected:
                # features from an earlier position again (the step that sent them failed and is
                # retried): rewind; the catch-up rewrites those positions
                self.runner.set_cached_len(req.seq_id, req.features_start)
            elif req.features_start != expected:
                self.release(req.seq_id)
                return False
            self._features[req.seq_id].append(req.features.to(self.runner.device, self.runner.dtype))
        return True

    @torch.inference_mode()
    def propose(self, requests: list[ProposeRequest]) -> list[Draft]:
        missing = {r.seq_id for r in requests if not self._take_features(r)}
        # catch up: pairs (features at i, token i+1) for every committed position not yet cached
        active, feats, toks = [], [], []
        for req in requests:
            if req.num_tokens <= 0 or req.seq_id in missing:
                continue
            f = torch.cat(self._features[req.seq_id]) if self._features[req.seq_id] else None
            start = self.runner.cached_len(req.seq_id)
            if f is None or start + len(f) != len(req.token_ids) - 1:  # features short of the last token
                self.release(req.seq_id)
                missing.add(req.seq_id)
                continue
            active.append(req)
            feats.append(f)
            toks.append(req.token_ids[start + 1: start + 1 + len(f)])
            self._features[req.seq_id] = []
        by_id: dict[str, Draft] = {s: Draft([], resend_features_from=0) for s in missing}
        if active:
            ids = [r.seq_id for r in active]
            last = self._catch_up(ids, toks, feats)  # [B, H]: predicts the first draft token
            committed = [self.runner.cached_len(s) for s in ids]
            drafts = self._draft(active, last)
            for s, n, req in zip(ids, committed, active):
                self.runner.set_cached_len(s, n)
                self.runner.commit(s, self._pair_tokens(req.token_ids))  # positions < n: verified pairs
            by_id.update(zip(ids, drafts))
        return [by_id.get(r.seq_id, Draft([])) for r in requests]

    def _catch_up(self, ids: list[str], toks: list[list[int]], feats: list[torch.Tensor]) -> torch.Tensor:
        """The head over every committed position not yet cached; [B, H] the last hidden row of
        each. feats[i]: [len(toks[i]), F]. Split into batches that fit the cache
        (ModelRunner.padded_groups: a new long prompt beside a sequence near its end) and the
        chunk budget (catch_up_pieces: a long prompt's first catch-up)."""
        out: list[torch.Tensor | None] = [None] * len(ids)
        for pieces in catch_up_pieces([len(t) for t in toks], self.runner.max_chunk_tokens):
            p_ids = [ids[i] for i, _, _ in pieces]
            p_toks = [toks[i][lo:hi] for i, lo, hi in pieces]
            p_feats = [feats[i][lo:hi] for i, lo, hi in pieces]
            for idx in self.runner.padded_groups(p_ids, [len(t) for t in p_toks]):
                q = max(len(p_toks[j]) for j in idx)
                f0 = p_feats[idx[0]]
                padded = torch.zeros(len(idx), q, f0.shape[-1], dtype=f0.dtype, device=f0.device)  # [b, q, F]
                for r, j in enumerate(idx):
                    padded[r, : len(p_feats[j])] = p_feats[j]
                hidden, lengths = self.runner.forward_hidden([p_ids[j] for j in idx], [p_toks[j] for j in idx],
                                                             features=padded)
                for j, row in zip(idx, last_rows(hidden, lengths)):
                    i, _, hi = pieces[j]
                    if hi == len(toks[i]):
                        out[i] = row
        return torch.stack(out)

    # ---- drafting --------------------------------------------------------------------
    def _draft(self, reqs: list[ProposeRequest], last: torch.Tensor) -> list[Draft]:
        """Grow one tree (or chain) per request, one head forward per depth."""
        B = len(reqs)
        tree = [r.tree and self.topk > 1 for r in reqs]
        sampled = [r.temperature > 0 and not tree[i] for i, r in enumerate(reqs)]  # a sampled chain
        width = [self.topk if tree[i] else 1 for i in range(B)]
        depth = [min(self.depth, r.num_tokens) if tree[i] else r.num_tokens for i, r in enumerate(reqs)]
        nodes: list[list[_Node]] = [[] for _ in range(B)]
        probs: list[list[torch.Tensor]] = [[] for _ in range(B)]
        fed_parents: list[list[int]] = [[] for _ in range(B)]  # head-cache tree of fed nodes
        logits = self.head.draft_logits(last)  # [B, draft_vocab]
        frontier = [self._expand(reqs[i], sampled[i], logits[i], -1, 0.0, 1, last[i], width[i], nodes[i], probs[i])
                    for i in range(B)]
        frontier = [self._worth_growing(frontier[i], nodes[i], sampled[i]) for i in range(B)]
        for d in range(2, max(depth) + 1):
            rows = [i for i in range(B) if d <= depth[i] and frontier[i]]
            if not rows:
                break
            ids, toks, inputs, trees = [], [], [], []
            for i in rows:
                chosen = frontier[i]
                for n in chosen:
                    node = nodes[i][n]
                    parent_fed = nodes[i][node.parent].fed if node.parent >= 0 else -1
                    node.fed = len(fed_parents[i])
                    fed_parents[i].append(parent_fed)
                ids.append(reqs[i].seq_id)
                toks.append([nodes[i][n].token for n in chosen])
                inputs.append(torch.stack([nodes[i][n].hidden for n in chosen]))
                trees.append(TreeQuery(list(fed_parents[i]), first=len(fed_parents[i]) - len(chosen)))
            q = max(len(t) for t in toks)
            feats = torch.zeros(len(rows), q, inputs[0].shape[-1], dtype=inputs[0].dtype, device=inputs[0].device)
            for j, x in enumerate(inputs):
                feats[j, : len(x)] = x
            out, _ = self.runner.forward_hidden(ids, toks, trees=trees, features=feats)  # [R, q, H]
            logits = self.head.draft_logits(out)  # [R, q, draft_vocab]
            for j, i in enumerate(rows):
                children = []
                for c, n in enumerate(frontier[i]):
                    node = nodes[i][n]
                    children += self._expand(reqs[i], sampled[i], logits[j, c], n, node.score, d, out[j, c],
                                             width[i], nodes[i], probs[i])
                # the next frontier: the best `width` new nodes by path score
                frontier[i] = sorted(children, key=lambda n: -nodes[i][n].score)[: width[i]]
                frontier[i] = self._worth_growing(frontier[i], nodes[i], sampled[i])
        for i in range(B):
            if tree[i] and self.lookup_tokens:
                self._add_lookup_branch(reqs[i], nodes[i])
        return [self._select(nodes[i], probs[i], reqs[i].num_tokens, sampled[i]) for i in range(B)]

    def _add_lookup_branch(self, req: ProposeRequest, nodes: list[_Node]) -> None:
        """Graft the n-gram prompt-lookup continuation onto the tree as a sure branch: its nodes
        (shared with the head's where the tokens agree) get path score 0, so _select keeps them
        first and their head-drafted children stay below them."""
        chain = find_ngram_continuation(np.asarray(req.token_ids, dtype=np.int64), self.lookup_min,
                                        self.lookup_max, min(self.lookup_tokens, req.num_tokens))
        parent = -1
        for depth, token in enumerate(chain, start=1):
            match = next((n for n, nd in enumerate(nodes) if nd.parent == parent and nd.token == token), None)
            if match is None:
                nodes.append(_Node(token, parent, 0.0, depth, None))
                match = len(nodes) - 1
            nodes[match].score = 0.0
            parent = match

    def _worth_growing(self, frontier: list[int], nodes: list[_Node], sampled: bool) -> list[int]:
        """The frontier, or [] when the head itself gives it too little chance to be reached."""
        if sampled or self.stop_prob <= 0 or not frontier:
            return frontier
        reach = sum(math.exp(nodes[n].score) for n in frontier)
        return frontier if reach >= self.stop_prob else []

    def _expand(self, req, sample, logits, parent, score, depth, hidden, width, nodes, probs) -> list[int]:
        """Add the children of one node: the top `width` tokens, or one sampled token."""
        if sample:
            p = logits_to_probs(logits[None], req.temperature, req.top_k, req.top_p)[0]  # [draft_vocab]
            d = int(torch.multinomial(p, 1, generator=self._generator(req)))
            full = torch.zeros(self.head.args.vocab_size, dtype=p.dtype, device=p.device)
            full[self.head.to_target(torch.arange(len(p), device=p.device))] = p  # draft -> target ids
            probs.append(full)
            token = int(self.head.to_target(torch.tensor(d, device=p.device)))
            nodes.append(_Node(token, parent, 0.0, depth, hidden))
            return [len(nodes) - 1]
        logp = torch.log_softmax(logits, dim=-1)
        top = torch.topk(logp, width)
        tokens = self.head.to_target(top.indices).tolist()
        added = []
        for t, lp in zip(tokens, top.values.tolist()):
            nodes.append(_Node(t, parent, score + lp, depth, hidden))
            added.append(len(nodes) - 1)
        return added

    @staticmethod
    def _select(nodes: list[_Node], probs: list[torch.Tensor], budget: int, sampled: bool) -> Draft:
        if sampled:  # a chain, in order
            n = min(budget, len(nodes))
            return Draft([nd.token for nd in nodes[:n]], torch.stack(probs[:n]) if n else None)
        # best nodes by path score; shallower first on ties so every kept node's parent is kept
        keep = sorted(range(len(nodes)), key=lambda n: (-nodes[n].score, nodes[n].depth))[:budget]
        keep.sort(key=lambda n: (nodes[n].depth, n))  # parents before children
        index = {n: j for j, n in enumerate(keep)}
        parents = [index[nodes[n].parent] if nodes[n].parent >= 0 else -1 for n in keep]
        return Draft([nodes[n].token for n in keep], None, parents)


class Eagle1Proposer(EagleProposer):
    name = "eagle"
    kind = "eagle"
