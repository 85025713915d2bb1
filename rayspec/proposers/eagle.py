"""EAGLE-3 and EAGLE-1 proposers: a draft head fed with the target's hidden states.

(Over 500 lines: one class (EagleProposer) whose catch-up, chain and tree drafting share the head's state.)

Per sequence the head keeps its own KV cache over "pairs": head position i reads the target
features at i with token i+1. The engine hands over the features of every token the target
has committed (`ProposeRequest.features`), the head catches up on them in one batched
forward, then drafts:
- where the engine asks for a tree (small batches, `eagle_topk` > 1), a tree (EAGLE-2 style):
  each depth expands the `eagle_topk` best frontier nodes by path probability into their
  `eagle_topk` best children, and the `num_tokens` best nodes overall are sent for
  verification. The nodes are chosen, not sampled, also for sampled requests: the engine
  verifies those with multi-round rejection over siblings, each node a point-mass draft
  (rayspec.sampling.rejection.SampledBatch), so temperature > 0 stays exact;
- otherwise a chain: the top token per depth (greedy), or for sampled requests a chain
  sampled from the head's distribution, with the probabilities, for the rejection rule.
Drafted positions are dropped from the head cache afterwards (only committed pairs stay).

Asynchronous drafting (rayspec.proposers.pre_draft): with `num_candidates` set, each draft also
leaves its best path (the top child at each depth, within the tree sent), the head states that
predicted each path token and the top candidates at each path position (`paths`, `candidates`).
A hypothesised verdict (the first j path tokens accepted, then a bonus token) is drafted before
the target's features of those positions exist: `propose(..., standins=)` feeds the head its own
states there instead (stand-in features, as inside a draft tree), drafts, and drops those pairs
again; the true features, when they come, are caught up as usual.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import torch

from rayspec.device_io import to_device, to_host
from rayspec.eagle.head import EagleHead
from rayspec.model.batch_layout import TreeQuery, catch_up_pieces, last_rows
from rayspec.kv.kv_space import DEFAULT_BLOCK_SIZE, KVSpace, proposer_num_blocks
from rayspec.model.runner import ModelRunner
from rayspec.proposers.base import Draft, PreDraftable, ProposeRequest
from rayspec.proposers.tree_graph import TreeGraph, expand_frontier
from rayspec.proposers.deferred import defer_chains, defer_trees
from rayspec.proposers.ngram import NgramIndex
from rayspec.proposers.recorded_paths import gather_states, tree_path
from rayspec.sampling.sampler import DraftSources, argmax, draw_rows, probs_of_rows, top_logprobs

_UNKNOWN = object()  # a sequence whose cache_salt the head was not told


class _Pairs:
    """The head's pair tokens (_pair_tokens) of token_ids[:num_pairs + 1] as a read-only sequence
    whose slices are computed when read: the prefix cache reads only the blocks it has not hashed."""

    __slots__ = ("token_ids", "num_pairs")

    def __init__(self, token_ids: list[int], num_pairs: int):
        self.token_ids, self.num_pairs = token_ids, max(0, min(num_pairs, len(token_ids) - 1))

    def __len__(self) -> int:
        return self.num_pairs

    def __getitem__(self, index: slice) -> list[int]:
        start, stop, _ = index.indices(self.num_pairs)
        t = self.token_ids
        return [(a << 32) | b for a, b in zip(t[start:stop], t[start + 1: stop + 1])]


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

    from rayspec.model.loader import load_model
    from rayspec.model.weights.hub import load_hf_config, resolve_model_dir

    num_layers = load_hf_config(resolve_model_dir(context.target_model)).num_hidden_layers
    target, _ = load_model(context.target_model, device=context.device, dtype=context.dtype, num_layers=0)
    target.args = dataclasses.replace(target.args, num_layers=num_layers)
    return target


def draft_dtype(name: str | None, context) -> torch.dtype:
    """The head's dtype (`draft_dtype`; default the target's). Drafts only steer speed: the
    verifier keeps the output exact whatever the head's precision. On CPU, bfloat16 measured no
    faster for the SmolLM2 head (its forwards are small; Python, not the matmuls, bounds them)."""
    from rayspec.model.loader import parse_dtype

    return parse_dtype(name or context.dtype, context.device)


class EagleProposer(PreDraftable):
    name = "eagle3"
    kind = "eagle3"
    drafts_from_states = True  # hypotheses from the head's own states (paths), see PreDraftable

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
        proposer.set_compile(context.compile)
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
        # the head's own pool: its books (kv) here, its tensors in the runner
        self.kv = KVSpace(max_model_len, num_slots, slack, num_blocks, block_size, enable_prefix_caching)
        self.runner = ModelRunner(head, self.kv)
        self._features: dict[str, list[torch.Tensor]] = {}  # handed over, not yet in the head cache
        self._sources = DraftSources(self.runner.device, salt=0x5EED)  # sampled drafts' draws
        self._d2t_ids: tuple = (None, None)  # ((device, draft vocab), the target id of each draft id)
        self._salts: dict[str, str | None] = {}  # seq id -> its cache_salt, for the head's prefix cache
        self._last_used: dict[str, int] = {}  # seq id -> call clock (evicts the stalest when slots run out)
        self._clock = itertools.count()
        # the stop rule's early exit reads the device after each depth: only where that is free
        self.early_exit_reads = self.runner.device.type == "cpu" and self.stop_prob > 0
        # a tree's depth forwards prepared once per cycle on the host, device work per depth
        # (rayspec.model.tree_steps); False: each depth through forward_hidden (the path before it)
        self.prepared_depths = True
        # with the compiled step: a tree's depth loop captured whole (TreeGraph; set_compile makes it)
        self.captured_trees = True
        self.tree_graph: TreeGraph | None = None
        # asynchronous drafting: > 0 records each draft's best path and its top candidates
        super().__init__()  # (PreDraftable: candidates, path position -> top tokens, probs)
        self.paths: dict[str, tuple[list[int], torch.Tensor]] = {}  # path tokens, [len, H] states predicting them
        self._ngrams: dict[str, NgramIndex] = {}  # seq id -> its n-gram index (the prompt-lookup branch)

    # what the engine must hand over: inputs of these target layers, or () for the final hidden state
    @property
    def feature_layers(self) -> tuple[int, ...]:
        return self.head.config.aux_layers if self.head.config.kind == "eagle3" else ()

    def set_compile(self, on: bool) -> None:
        self.runner.set_compile(on)
        compiled = self.runner.compiled
        # a tree's whole depth loop as one compiled graph (rayspec.proposers.tree_graph) where the
        # head's step is compiled; None: the loop in Python, a compiled head forward per depth
        self.tree_graph = (TreeGraph(compiled.backend, compiled.mode) if compiled is not None and self.captured_trees
                           else None)

    def models(self) -> list[torch.nn.Module]:
        return [self.head]

    def kv_usage(self) -> dict[str, float]:
        return {"num_slots": self.kv.num_slots, "num_free_slots": self.kv.num_free_slots,
                "kv_cache_usage": self.kv.kv_cache_usage()}

    def release(self, seq_id: str) -> None:
        self.kv.free(seq_id)
        self._features.pop(seq_id, None)
        self._sources.release(seq_id)
        self._salts.pop(seq_id, None)
        self._last_used.pop(seq_id, None)
        self.candidates.pop(seq_id, None)
        self.paths.pop(seq_id, None)
        self._ngrams.pop(seq_id, None)

    def _draft_to_target(self, draft_vocab: int, device) -> torch.Tensor:
        """[draft_vocab] the target id of each draft id (made once per device)."""
        key = (str(device), draft_vocab)
        if self._d2t_ids[0] != key:
            self._d2t_ids = (key, self.head.to_target(torch.arange(draft_vocab, device=device)))
        return self._d2t_ids[1]

    # ---- prefix caching ----------------------------------------------------------------
    # Head position i holds the pair (target feature i, token i + 1), and feature i is a function of
    # tokens 0..i: so position i's keys and values depend on tokens 0..i + 1 alone. The head's blocks
    # are hashed over the pairs (token i, token i + 1), one int each (`_pair_tokens`): a chain over
    # pairs 0..i covers tokens 0..i + 1, the same rule as the target's, one token later.
    @staticmethod
    def _pair_tokens(token_ids: list[int]) -> list[int]:
        return [(a << 32) | b for a, b in zip(token_ids, token_ids[1:])]

    def _commit_pairs(self, seq_id: str, token_ids: list[int], num_tokens: int) -> None:
        """Register the verified pairs of token_ids[:num_tokens + 1] in the head's prefix cache; only
        the blocks not registered yet are read (_Pairs), so a step costs what it adds."""
        self.kv.commit(seq_id, _Pairs(token_ids, num_tokens))

    # Salted like the target's (cache_salt, one hash-chain root per salt): a tenant finds only its
    # salt's pairs in the head's cache too. A sequence the head starts without being told its salt
    # (the engine asks cached_prefix only of requests that may reuse a prefix: not those asking
    # prompt logprobs) registers its pairs unsalted; nobody can find them through the head alone,
    # since a new sequence's cached prefix is the shorter of the head's and the target's (salted)
    # lookups (LLMEngine._admit).
    def cached_prefix(self, seq_id: str, token_ids: list[int], cache_salt: str | None = None) -> int | None:
        if not self.kv.prefix_caching:
            return None
        if self.kv.has(seq_id):
            self.release(seq_id)
        if self.kv.num_free_slots == 0:
            return 0
        cached = self.kv.allocate(seq_id, self._pair_tokens(token_ids), cache_salt=cache_salt)
        self._salts[seq_id] = cache_salt
        self._features[seq_id] = []
        self._last_used[seq_id] = next(self._clock)
        return cached

    def trim_prefix(self, seq_id: str, num_tokens: int) -> None:
        if self.kv.has(seq_id) and self.kv.cached_len(seq_id) > num_tokens:
            self.kv.set_cached_len(seq_id, num_tokens)

    @torch.inference_mode()
    def commit_finished(self, requests: list[ProposeRequest]) -> None:
        """Catch up on the finishing sequences' last features and commit their pairs, so a later
        prompt sharing the prefix finds it in the head's cache too (without this, a request that
        ends at its prefill leaves the head nothing, and the target's cached prefix is cut to the
        head's: none). A sequence the head holds no place for is left alone (no eviction)."""
        if not self.kv.prefix_caching:
            return
        ids, toks, feats, reqs = [], [], [], []
        for req in requests:
            if not self.kv.has(req.seq_id) and self.kv.num_free_slots == 0:
                continue
            if not self._take_features(req):
                continue
            f = torch.cat(self._features[req.seq_id]) if self._features[req.seq_id] else None
            self._features[req.seq_id] = []
            start = self.kv.cached_len(req.seq_id)
            # features past the last kept token (a stop inside the accepted run) pair with nothing
            n = 0 if f is None else min(len(f), len(req.token_ids) - 1 - start)
            if n <= 0:
                continue
            ids.append(req.seq_id)
            toks.append(req.token_ids[start + 1: start + 1 + n])
            feats.append(f[:n])
            reqs.append(req)
        if ids:
            self._catch_up(ids, toks, feats, outputs=False)
            for s, req in zip(ids, reqs):
                self._commit_pairs(s, req.token_ids, self.kv.cached_len(s))

    # ---- catch-up --------------------------------------------------------------------
    def _allocate(self, seq_id: str) -> None:
        if self.kv.num_free_slots == 0:  # sequences left behind by another verifier's routing
            stale = min((s for s in self._last_used if s in self._features), key=self._last_used.get)
            self.release(stale)  # if it comes back, it is caught up through resend_features_from
        self.kv.allocate(seq_id, cache_salt=self._salts.get(seq_id))
        self._features[seq_id] = []

    def accept_features(self, req: ProposeRequest) -> bool:
        """Buffer a request's features without drafting (a pre-drafter answered it from its cache);
        the next propose catches up on them."""
        return self._take_features(req)

    def _take_features(self, req: ProposeRequest) -> bool:
        """Buffer the request's features; False when they do not continue what this proposer holds."""
        if self.kv.has(req.seq_id) and req.features_start == 0 and req.features is not None:
            salt = self._salts.get(req.seq_id, _UNKNOWN)
            self.release(req.seq_id)  # features from the start again (a resend): rebuild from scratch
            if salt is not _UNKNOWN:  # (the same sequence: its salt stays)
                self._salts[req.seq_id] = salt
        if not self.kv.has(req.seq_id):
            if req.features_start > 0:  # a sequence that started elsewhere
                return False
            if req.seq_id not in self._salts and req.cache_salt is not None:
                self._salts[req.seq_id] = req.cache_salt  # (a remote head is told it with each request)
            self._allocate(req.seq_id)
        self._last_used[req.seq_id] = next(self._clock)
        if req.features is not None and len(req.features):
            buffered = sum(len(f) for f in self._features[req.seq_id])
            expected = self.kv.cached_len(req.seq_id) + buffered
            if not buffered and req.features_start < expected:
                # features from an earlier position again (the step that sent them failed and is
                # retried): rewind; the catch-up rewrites those positions
                self.kv.set_cached_len(req.seq_id, req.features_start)
            elif req.features_start != expected:
                self.release(req.seq_id)
                return False
            self._features[req.seq_id].append(req.features.to(self.runner.device, self.runner.dtype))
        return True

    @torch.inference_mode()
    def propose(self, requests: list[ProposeRequest],
                standins: list[torch.Tensor | None] | None = None) -> list[Draft]:
        """standins (pre-drafting): per request [m, H] head states standing in for the target
        features of its last m positions before the last token (None: none); those pairs are
        dropped again after the draft. A pre-draft that does not fit the head's state gets no draft
        (and leaves the state alone)."""
        if standins is not None:
            missing = {r.seq_id for r in requests if not self.kv.has(r.seq_id)}
        else:
            missing = {r.seq_id for r in requests if not self._take_features(r)}
        skipped = set()
        # catch up: pairs (features at i, token i+1) for every committed position not yet cached
        active, feats, toks, stand = [], [], [], []
        for i, req in enumerate(requests):
            if req.num_tokens <= 0 or req.seq_id in missing:
                continue
            f = torch.cat(self._features[req.seq_id]) if self._features[req.seq_id] else None
            h = standins[i] if standins is not None else None
            start = self.kv.cached_len(req.seq_id)
            n_true, n_stand = (0 if f is None else len(f)), (0 if h is None else len(h))
            if n_true + n_stand == 0 or start + n_true + n_stand != len(req.token_ids) - 1:
                if standins is not None:
                    skipped.add(req.seq_id)
                else:  # features short of the last token
                    self.release(req.seq_id)
                    missing.add(req.seq_id)
                continue
            active.append(req)
            feats.append(f)
            toks.append(req.token_ids[start + 1: start + 1 + n_true])
            stand.append((h, req.token_ids[start + 1 + n_true: start + 1 + n_true + n_stand]))
            self._features[req.seq_id] = []
        by_id: dict[str, Draft] = {s: Draft([], resend_features_from=0) for s in missing}
        by_id.update((s, Draft([])) for s in skipped)
        if active:
            ids = [r.seq_id for r in active]
            last: list[torch.Tensor | None] = [None] * len(active)
            true_rows = [i for i, f in enumerate(feats) if f is not None]
            if true_rows:
                rows = self._catch_up([ids[i] for i in true_rows], [toks[i] for i in true_rows],
                                      [feats[i] for i in true_rows])
                for i, row in zip(true_rows, rows):
                    last[i] = row
            committed = [self.kv.cached_len(s) for s in ids]
            stand_rows = [i for i, (h, _) in enumerate(stand) if h is not None]
            if stand_rows and not self._stop():
                rows = self._catch_up([ids[i] for i in stand_rows], [stand[i][1] for i in stand_rows],
                                      [stand[i][0].to(self.runner.device, self.runner.dtype) for i in stand_rows])
                for i, row in zip(stand_rows, rows):
                    last[i] = row
            drafts = self._draft(active, torch.stack(last)) if not self._stop() else [Draft([])] * len(active)
            for s, n, req in zip(ids, committed, active):
                self.kv.set_cached_len(s, n)
                self._commit_pairs(s, req.token_ids, n)  # positions < n: verified pairs
            by_id.update(zip(ids, drafts))
        return [by_id.get(r.seq_id, Draft([])) for r in requests]

    def _stop(self) -> bool:
        return self.should_stop is not None and self.should_stop()

    def _catch_up(self, ids: list[str], toks: list[list[int]], feats: list[torch.Tensor],
                  outputs: bool = True) -> torch.Tensor | None:
        """The head over every committed position not yet cached; [B, H] the last hidden row of
        each (None without `outputs`: positions cached for a later prompt). feats[i]:
        [len(toks[i]), F]. Split into batches that fit the cache (ModelRunner.padded_groups: a new
        long prompt beside a sequence near its end) and the chunk budget (catch_up_pieces: a long
        prompt's first catch-up). A one-layer head (writes_kv_alone) runs only the rows whose
        outputs are read through the layer: the others' keys and values are written alone (8 prompts
        of 1,600 tokens: 0.17 s instead of 1.04 s on a 2-core AMD EPYC)."""
        out: list[torch.Tensor | None] = [None] * len(ids)
        alone = self.head.writes_kv_alone
        for pieces in catch_up_pieces([len(t) for t in toks], self.runner.max_chunk_tokens):
            p_ids = [ids[i] for i, _, _ in pieces]
            p_toks = [toks[i][lo:hi] for i, lo, hi in pieces]
            p_feats = [feats[i][lo:hi] for i, lo, hi in pieces]
            ends = [outputs and hi == len(toks[i]) for i, _, hi in pieces]  # whose last row is read
            if alone:  # keys and values alone, then the read rows through the layer
                cut = [len(t) - 1 if end else len(t) for t, end in zip(p_toks, ends)]
                kv = [j for j, n in enumerate(cut) if n > 0]
                self._run_rows([p_ids[j] for j in kv], [p_toks[j][: cut[j]] for j in kv],
                               [p_feats[j][: cut[j]] for j in kv], kv_only=True)
                read = [j for j, end in enumerate(ends) if end]
                rows = self._run_rows([p_ids[j] for j in read], [p_toks[j][-1:] for j in read],
                                      [p_feats[j][-1:] for j in read])
            else:
                read = list(range(len(pieces)))
                rows = self._run_rows(p_ids, p_toks, p_feats)
            for j, row in zip(read, rows):
                if ends[j]:
                    out[pieces[j][0]] = row
        return torch.stack(out) if outputs else None

    def _run_rows(self, ids: list[str], toks: list[list[int]], feats: list[torch.Tensor],
                  kv_only: bool = False) -> list[torch.Tensor]:
        """The head over toks (each extending its sequence) with their features, in padded batches
        that fit the cache; the last hidden row of each ([] with kv_only: keys and values only)."""
        rows: list[torch.Tensor | None] = [None] * len(ids)
        if not ids:
            return []
        for idx in self.runner.padded_groups(ids, [len(t) for t in toks]):
            q = max(len(toks[j]) for j in idx)
            f0 = feats[idx[0]]
            padded = torch.zeros(len(idx), q, f0.shape[-1], dtype=f0.dtype, device=f0.device)  # [b, q, F]
            for r, j in enumerate(idx):
                padded[r, : len(feats[j])] = feats[j]
            if kv_only:
                self.runner.write_kv([ids[j] for j in idx], [toks[j] for j in idx], features=padded)
                continue
            hidden, lengths = self.runner.forward_hidden([ids[j] for j in idx], [toks[j] for j in idx],
                                                         features=padded)
            for j, row in zip(idx, last_rows(hidden, lengths)):
                rows[j] = row
        return [] if kv_only else rows

    # ---- drafting --------------------------------------------------------------------
    # Drafts grow on the device: every depth's choices (top-k children, the best frontier, sampled
    # tokens) stay there, and one read (rayspec.device_io.to_host) brings the finished trees and
    # chains to the host, whatever the batch and the depth. On CPU, where a read costs nothing, the
    # head's stop rule (eagle_stop_prob) also reads whether any row is still worth growing after
    # each depth and stops early; elsewhere every row grows to its depth, and the nodes past a stop
    # are dropped on the host (the same drafts, a few head rows more).
    def _draft(self, reqs: list[ProposeRequest], last: torch.Tensor) -> list[Draft]:
        """One tree (or chain) per request, one head forward per depth."""
        tree = [r.tree and self.topk > 1 for r in reqs]
        out: list[Draft | None] = [None] * len(reqs)
        for want_tree, grow in ((True, self._draft_trees), (False, self._draft_chains)):
            idx = [i for i in range(len(reqs)) if tree[i] == want_tree]
            if idx:
                rows = last if len(idx) == len(reqs) else last.index_select(
                    0, to_device(np.asarray(idx, dtype=np.int64), device=last.device)[0])
                for i, d in zip(idx, grow([reqs[i] for i in idx], rows)):
                    out[i] = d
        return out

    def _stopped(self, scores: torch.Tensor) -> torch.Tensor:
        """[B, w] path scores of each row's frontier -> [B] bool: too little chance to be reached."""
        return scores.exp().sum(-1) < self.stop_prob

    def _draft_trees(self, reqs: list[ProposeRequest], last: torch.Tensor) -> list[Draft]:
        """EAGLE-2 trees: each depth expands the `topk` best frontier nodes by path score into their
        `topk` best children; the num_tokens best nodes overall are sent."""
        B, w, dev = len(reqs), self.topk, last.device
        defer = self._defers(reqs)
        depth = [min(self.depth, r.num_tokens) for r in reqs]
        D = max(depth)
        ids = [r.seq_id for r in reqs]
        (row_depth,) = to_device(np.asarray(depth, dtype=np.int64), device=dev)
        # per state (root, then each fed node): its top tokens [B, 1, c]; w more than asked, as the
        # node's children in the tree are no bonus candidates (the verifier would accept them)
        c = w + max(self.num_candidates, 0)
        logp, top = top_logprobs(self.head.draft_logits(last), c)  # [B, c]: the best w first
        f_tok = self.head.to_target(top[:, :w])  # the frontier: [B, w] tokens (target ids)
        f_score = logp[:, :w]  # [B, w] path log-probabilities
        f_node = torch.arange(w, device=dev).expand(B, w)  # their node numbers
        f_hidden = last[:, None].expand(B, w, last.shape[-1])  # the head output that predicted each
        toks, scores, parents = [f_tok], [f_score], [torch.full((B, w), -1, dtype=torch.long, device=dev)]
        stopped = self._stopped(f_score) if self.stop_prob > 0 else torch.zeros(B, dtype=torch.bool, device=dev)
        sees = torch.zeros(B, (D - 1) * w, (D - 1) * w, dtype=torch.bool, device=dev)  # fed node -> what it sees
        f_fed_parent = None  # [B, w] the fed slot of each frontier node's parent (None: the prefix)
        eye = torch.eye(w, dtype=torch.bool, device=dev)
        num_nodes = w
        steps = self.runner.tree_steps(ids, w, D - 1) if D > 1 and self.prepared_depths else None
        if (steps is not None and steps.compiled and self.tree_graph is not None and self.num_candidates <= 0):
            if self._stop():
                return [Draft([]) for _ in reqs]
            # the whole depth loop, one graph (rayspec.proposers.tree_graph): every depth runs, no early exit
            tok_d, score_d, parent_d = self.tree_graph(self.head, self.runner.cache, steps, last, row_depth, D,
                                                       self.stop_prob, self.runner.dtype)
            return self._trees_out(reqs, defer, tok_d, score_d, parent_d, w + (D - 1) * w * w, D, None)
        fed_nodes, fed_hidden = [], []  # per depth: the frontier fed [B, w] and its head outputs [B, w, H]
        if self.num_candidates > 0:
            cand_tok, cand_logp = [self.head.to_target(top)[:, None]], [logp[:, None]]
        for d in range(2, D + 1):
            if self.early_exit_reads and not defer and bool(to_host(stopped | (row_depth < d))[0].all()):
                break
            if self._stop():
                return [Draft([]) for _ in reqs]
            lo = (d - 2) * w  # the fed slots of this depth's frontier
            if f_fed_parent is not None:
                sees[:, lo: lo + w] = sees.gather(1, f_fed_parent[..., None].expand(B, w, sees.shape[2]))
            sees[:, lo: lo + w, lo: lo + w] = eye
            if steps is not None:  # device work only (rayspec.model.tree_steps)
                hidden = steps.forward(d - 2, f_tok, f_hidden.contiguous(), sees[:, lo: lo + w])  # [B, w, H]
            else:
                depths = [j // w for j in range(lo + w)]
                trees = [TreeQuery(None, first=lo, depths=depths, sees=sees[b, lo: lo + w, : lo + w]) for b in range(B)]
                hidden, _ = self.runner.forward_hidden(ids, f_tok, trees=trees, features=f_hidden.contiguous(),
                                                       static=True)  # [B, w, H]
            fed_nodes.append(f_node)
            fed_hidden.append(hidden)
            logp, top = top_logprobs(self.head.draft_logits(hidden), c)  # [B, w, c]: children first
            if self.num_candidates > 0:
                cand_tok.append(self.head.to_target(top))
                cand_logp.append(logp)
            children, frontier = expand_frontier(f_score, f_node, logp[..., :w], self.head.to_target(top[..., :w]),
                                                 hidden, stopped | (row_depth < d), num_nodes, lo)
            for out, x in zip((toks, scores, parents), children):
                out.append(x)
            f_tok, f_score, f_node, f_hidden, f_fed_parent = frontier
            if self.stop_prob > 0:
                stopped = stopped | self._stopped(f_score)
            num_nodes += w * w
        record = None
        if self.num_candidates > 0:  # the fed nodes, their head states and their candidates
            record = (torch.cat(fed_nodes, 1) if fed_nodes else torch.zeros(B, 0, dtype=torch.long, device=dev),
                      torch.cat(fed_hidden, 1) if fed_hidden else None, torch.cat(cand_tok, 1), torch.cat(cand_logp, 1))
        return self._trees_out(reqs, defer, torch.cat(toks, 1), torch.cat(scores, 1), torch.cat(parents, 1),
                               num_nodes, D, record, last)

    def _trees_out(self, reqs, defer: bool, tok_d, score_d, parent_d, num_nodes: int, D: int, record,
                   last: torch.Tensor | None = None) -> list[Draft]:
        """The grown trees (tokens, path scores, parents [B, nodes] on the device) -> each request's Draft:
        deferred (chosen on the device), or read once and chosen here. record: (fed nodes, their head
        states, candidates' tokens and log-probabilities) where a pre-drafter wants the best paths."""
        w, B, dev = self.topk, len(reqs), tok_d.device
        if defer:  # chosen on the device and read with the verdict (rayspec.proposers.deferred)
            chains = [self._lookup_chain(r) for r in reqs]
            node_depth = [1] * w + [d for d in range(2, D + 1) for _ in range(w * w)]
            return defer_trees(tok_d, score_d, parent_d, node_depth[: num_nodes], [r.num_tokens for r in reqs], chains)
        fed_h = record[0] if record else torch.zeros(B, 0, dtype=torch.long, device=dev)
        ctok_h, clogp_h = (record[2], record[3]) if record else (fed_h, fed_h)
        tok_h, score_h, parent_h, fed_h, ctok_h, clogp_h = to_host(tok_d, score_d, parent_d, fed_h, ctok_h, clogp_h)
        fed_all = record[1] if record else None  # [B, F, H]
        # Python lists once (indexing arrays element by element cost more than the head's forwards
        # at batch 256 on CPU)
        tok_h, score_h, parent_h, fed_h, ctok_h, clogp_h = (
            a.tolist() for a in (tok_h, score_h, parent_h, fed_h, ctok_h, clogp_h))
        node_depth = [1] * w + [d for d in range(2, D + 1) for _ in range(w * w)]
        drafts, recorded = [], []
        for b, req in enumerate(reqs):
            nodes, number = [], {}
            for n, (t, s, p) in enumerate(zip(tok_h[b], score_h[b], parent_h[b])):
                if s == float("-inf"):
                    continue
                number[n] = len(nodes)
                nodes.append(_Node(t, number[p] if p >= 0 else -1, s, node_depth[n], None))
            if self.lookup_tokens:
                self._add_lookup_branch(req, nodes)
            keep = self._keep(nodes, req.num_tokens)
            drafts.append(self._tree_draft(nodes, keep))
            if self.num_candidates > 0:  # the best path and its candidates, for a pre-drafter
                path, rows, self.candidates[req.seq_id] = tree_path(keep, number, tok_h[b], score_h[b], parent_h[b],
                                                                   fed_h[b], ctok_h[b], clogp_h[b], self.num_candidates)
                recorded.append((req.seq_id, b, path, rows))
        if recorded:  # the head states along each path, in one gather
            states = gather_states(last, fed_all, [(b, rows) for _, b, _, rows in recorded])
            self.paths.update({seq_id: (path, s) for (seq_id, _, path, _), s in zip(recorded, states)})
        return drafts

    def _draft_chains(self, reqs: list[ProposeRequest], last: torch.Tensor) -> list[Draft]:
        """A chain per request: the head's top token per depth, or for a sampled request a token
        sampled from the head's distribution (its probabilities kept for the rejection rule)."""
        B, dev = len(reqs), last.device
        defer = self._defers(reqs)
        K = max(r.num_tokens for r in reqs)
        ids = [r.seq_id for r in reqs]
        sampled = [i for i, r in enumerate(reqs) if r.temperature > 0]
        # the sampled rows' indices, sent without a blocking copy (none when all are greedy)
        rows = to_device(np.asarray(sampled, dtype=np.int64), device=dev)[0] if sampled else None
        settings = [(reqs[i].temperature, reqs[i].top_k, reqs[i].top_p) for i in sampled]
        greedy_rows = len(sampled) < B and self.stop_prob > 0  # the stop rule reads greedy path scores
        V = self.head.args.vocab_size
        probs: list[list[torch.Tensor]] = [[] for _ in range(B)]
        toks, scores = [], []
        score = torch.zeros(B, device=dev)
        hidden = last  # [B, H]: predicts the next token
        c = max(self.num_candidates, 1)
        states, cand_tok, cand_logp = [], [], []  # per depth, pre-drafting only: [B, H], [B, c], [B, c]
        # a chain is a tree of width 1 (node j at cache row start + j, position start + j, seeing the
        # nodes before it): its depth forwards prepared once (rayspec.model.tree_steps)
        steps = self.runner.tree_steps(ids, 1, K - 1) if K > 1 and self.prepared_depths else None
        if steps is not None:
            sees = torch.ones(K - 1, K - 1, dtype=torch.bool, device=dev).tril()
        for d in range(1, K + 1):
            if d > 1:
                if (self.early_exit_reads and greedy_rows and not sampled and not defer
                        and bool(to_host(score.exp() < self.stop_prob)[0].all())):
                    break
                if self._stop():
                    return [Draft([]) for _ in reqs]
                if steps is not None:
                    out = steps.forward(d - 2, toks[-1][:, None], hidden[:, None],
                                        sees[None, d - 2: d - 1].expand(B, 1, K - 1))
                else:
                    out, _ = self.runner.forward_hidden(ids, toks[-1][:, None], features=hidden[:, None],
                                                        static=True)  # [B, 1, H]
                hidden = out[:, 0]
            logits = self.head.draft_logits(hidden)  # [B, Vd]
            logp = torch.log_softmax(logits, dim=-1)
            if self.num_candidates > 0:
                top = torch.topk(logp, min(c, logp.shape[-1]))
                states.append(hidden)
                cand_tok.append(self.head.to_target(top.indices))
                cand_logp.append(top.values)
            choice = argmax(logp)  # [B] draft ids
            if sampled:  # one batch of kernels for all sampled rows, no host read
                p = probs_of_rows(logits.index_select(0, rows), settings)  # [S, Vd]
                sources = [self._sources.source(reqs[i].seq_id, reqs[i].seed, reqs[i].stream_seed,
                                                len(reqs[i].token_ids) + d - 1) for i in sampled]
                choice.index_copy_(0, rows, draw_rows(p, sources, self._draft_to_target(p.shape[-1], dev)))
                full = torch.zeros(len(sampled), V, dtype=p.dtype, device=dev)
                full[:, self._draft_to_target(p.shape[-1], dev)] = p  # draft -> target ids
                for j, i in enumerate(sampled):
                    probs[i].append(full[j])
            score = score + logp.gather(1, choice[:, None])[:, 0]
            toks.append(self.head.to_target(choice))
            scores.append(score)
        record = self.num_candidates > 0
        read = [torch.stack(toks, 1), torch.stack(scores, 1)]
        if defer:  # read with the verdict (rayspec.proposers.deferred)
            return defer_chains(read[0], [r.num_tokens for r in reqs], read,
                                lambda arrays: self._chains_read(reqs, arrays, probs, sampled, [], False),
                                [torch.stack(probs[i]) if probs[i] else None for i in range(B)])
        return self._chains_read(reqs, to_host(*read, torch.stack(cand_tok, 1) if record else score,
                                               torch.stack(cand_logp, 1) if record else score), probs, sampled,
                                 states, record)

    def _chains_read(self, reqs, arrays, probs, sampled, states, record: bool) -> list[Draft]:
        """The host drafts of _draft_chains from its read arrays (tokens, path scores[, candidates])."""
        tok_h, score_h, *cands = (a.tolist() for a in arrays)  # lists: no per-element array indexing
        ctok_h, clogp_h = cands if record else (None, None)
        sampled = set(sampled)
        drafts = []
        for i, r in enumerate(reqs):
            n = min(r.num_tokens, len(tok_h[i]))
            if i not in sampled and self.stop_prob > 0:  # depth d + 1 only while the path to d is likely enough
                m = 1
                while m < n and math.exp(score_h[i][m - 1]) >= self.stop_prob:
                    m += 1
                n = m
            tokens = tok_h[i][:n]
            drafts.append(Draft(tokens, torch.stack(probs[i][:n]) if i in sampled and n else None))
            if record:  # the chain is the path; state d predicted token d
                self.paths[r.seq_id] = (tokens, torch.stack([h[i] for h in states[:n]]))
                self.candidates[r.seq_id] = [(ctok_h[i][d], [math.exp(x) for x in clogp_h[i][d]]) for d in range(n)]
        return drafts

    def _add_lookup_branch(self, req: ProposeRequest, nodes: list[_Node]) -> None:
        """Graft the n-gram prompt-lookup continuation onto the tree as a sure branch: its nodes
        (shared with the head's where the tokens agree) get path score 0, so _keep keeps them
        first and their head-drafted children stay below them."""
        chain = self._lookup_chain(req)
        parent = -1
        for depth, token in enumerate(chain, start=1):
            match = next((n for n, nd in enumerate(nodes) if nd.parent == parent and nd.token == token), None)
            if match is None:
                nodes.append(_Node(token, parent, 0.0, depth, None))
                match = len(nodes) - 1
            nodes[match].score = 0.0
            parent = match

    def _lookup_chain(self, req: ProposeRequest) -> list[int]:
        """The n-gram prompt-lookup continuation a tree grafts on (none without eagle_prompt_lookup)."""
        if not self.lookup_tokens:
            return []
        index = self._ngrams.get(req.seq_id)  # (kept per sequence: a step's lookup costs what it adds)
        if index is None:
            index = self._ngrams[req.seq_id] = NgramIndex(self.lookup_min, self.lookup_max)
        index.sync(req.token_ids)
        return [int(t) for t in index.lookup(min(self.lookup_tokens, req.num_tokens))]

    def _defers(self, reqs: list[ProposeRequest]) -> bool:
        """Leave these drafts on the device for the engine's one read (ProposeRequest.defer_read): not
        while a pre-drafter records paths (it reads them at once)."""
        return self.num_candidates == 0 and all(r.defer_read for r in reqs)

    @staticmethod
    def _keep(nodes: list[_Node], budget: int) -> list[int]:
        """The budget best nodes by path score; shallower first on ties so every kept node's parent
        is kept; parents before children."""
        keep = sorted(range(len(nodes)), key=lambda n: (-nodes[n].score, nodes[n].depth))[:budget]
        keep.sort(key=lambda n: (nodes[n].depth, n))
        return keep

    @staticmethod
    def _tree_draft(nodes: list[_Node], keep: list[int]) -> Draft:
        index = {n: j for j, n in enumerate(keep)}
        parents = [index[nodes[n].parent] if nodes[n].parent >= 0 else -1 for n in keep]
        return Draft([nodes[n].token for n in keep], None, parents)


class Eagle1Proposer(EagleProposer):
    name = "eagle"
    kind = "eagle"
