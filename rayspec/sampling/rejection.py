"""Verification: which draft tokens a sequence keeps, and the token that follows them.

Vocabulary (as in vLLM): of k draft tokens, the first m are *accepted*; then one more token
is emitted: the *recovered* token at the first rejected position, or the *bonus* token
sampled from the target after all k were accepted. So every step emits m + 1 tokens.

Greedy: a draft is accepted iff it equals the target's argmax.
Sampled: draft x at a position is accepted with probability min(1, p(x) / q(x)); on rejection
the recovered token is drawn from normalise(max(0, p - q)). p and q are the processed
(temperature / top-k / top-p) target and draft distributions. A proposer without
probabilities (n-gram) is a point mass q = one_hot(x), so acceptance is p(x) and the
residual is p with x removed. The emitted tokens are then distributed exactly as p.
q may come from another process (deployments.transport.remote_proposer), so it is checked before use
(`SampledBatch`): finite, non-negative, each row summing to 1, q(x) > 0 for the drafted
token. A q that fails is ignored and the draft is verified as a point mass, which is lossless
whatever tokens were drafted (acceptance p(x), residual p without x): a broken or forged q can
cost acceptance, never put a token outside the target's distribution.
Token trees are verified greedily (`verify_tree_greedy`) or, when sampled, by applying the
point-mass rule to siblings in turn. `verify` takes a whole batch's verification rows and picks the
rule per sequence (chain or tree, greedy or sampled); its sampled sequences go through one batched
rule on the device (`SampledBatch`, called as `sample_verdicts`), read with the greedy choices in
one host read per verification. `verify_sampled` and `verify_tree_sampled` are that rule for one
sequence.

Seeded sampled requests are verified *coupled* (rayspec.sampling.sampler, "Two kinds of draw"): at each row
the target's choice is its coupled draw at the position the row predicts (`coupled_choices`), and
the greedy rule runs over those choices instead of the argmax. Every emitted token is then the
target's own coupled draw: lossless whatever was drafted (a forged draft or q can only cost
acceptance), and the same tokens as target-only decoding with that seed.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from rayspec.device_io import to_device, to_host
from rayspec.sampling.sampler import coupled_keys_at, coupled_sample, probs_of_rows


def verify_greedy(target_argmax, draft_tokens: list[list[int]]) -> list[list[int]]:
    """target_argmax: [B, Q] target argmax at each verified position (Q >= 1 + len(row's drafts)),
    host lists (or a tensor, read here).

    Returns for each row the emitted tokens: accepted drafts + the bonus/recovered token.
    """
    rows = target_argmax.tolist() if isinstance(target_argmax, torch.Tensor) else target_argmax
    out = []
    for target, drafts in zip(rows, draft_tokens):
        m = 0
        while m < len(drafts) and drafts[m] == target[m]:
            m += 1
        out.append(drafts[:m] + [target[m]])
    return out


# how far a q row's sum may be from 1: float32 softmax over a large vocabulary is within 1e-5;
# half-precision rows round each entry to 2**-11 (float16) or 2**-8 (bfloat16) relative
_SUM_ATOL = {torch.float16: 1e-2, torch.bfloat16: 2e-2}


class _Nodes(NamedTuple):
    """A draft's shape as the batch rule reads it: tokens, and parents (None: a chain)."""

    tokens: list[int]
    parents: list[int] | None


def num_nodes(draft) -> int:
    """The verification rows a draft takes after its context row: its tokens, or a draft still on the
    device (rayspec.proposers.deferred.DeferredRow) its budget of rows."""
    row = getattr(draft, "deferred", None)
    return row.num_nodes if row is not None else len(draft.tokens)


def is_chain(draft) -> bool:
    """Whether a draft is a chain (host drafts: Draft.is_chain; a deferred one: it has no ancestry)."""
    row = getattr(draft, "deferred", None)
    if row is not None:
        return row.sees is None  # (as the verification's layout reads it: rayspec.engine.deferred_verify)
    return draft.parents is None or list(draft.parents) == list(range(-1, len(draft.tokens) - 1))


class SampledBatch:
    """Rejection sampling of a batch's sampled (unseeded) sequences on the device, finished by the
    host after one read (`tensors`, then `finish`): one set of kernels for the batch, no read per
    sequence or per tree node.

    Every row's verdict is drawn at once, visited or not: at a row with children (tree nodes, or a
    chain's next draft), the first child accepted by the rule, or none. Point-mass children (trees,
    chains without a usable q) are tried in node order against what is left of the row R: child x
    is accepted with probability R(x) / R's mass and removed when rejected (a sibling repeating an
    earlier token has mass 0 by then). A chain with a usable q accepts its draft x with min(1, p(x) /
    q(x)). Following the accepted children from the context's row (a pointer chase, depth steps on
    the device) reaches the row where the walk ends; its final token is drawn from the residual:
    p less the rejected children (point masses) or max(0, p - q) (a sampled chain), p itself at a
    leaf or when the residual has no mass. Only the visited rows' draws decide the outcome and each
    row's are independent of the others', so the outcome's law is the sequential walk's:
    the target's distribution (module docstring).

    A draft may still be on the device (`Draft.deferred`, rayspec.proposers.deferred: the engine's
    one read of the cycle brings it back with these verdicts): its tokens, a tree's parents and which
    of its rows hold kept nodes are device tensors, so the layout is dense where it depends on them:
    each row tries every node of its sequence, in node order, as a child (those whose parent it is
    and that are kept count). A host draft takes the same layout, so both draw alike."""

    def __init__(self, logits: torch.Tensor, index: torch.Tensor | None, settings: list | None, drafts: list,
                 draft_probs: list, generators: list):
        """The sequences' rows, in order, are logits[index] (index None: every row of logits), each
        sequence's 1 + nodes rows (the row of its last pending token, then one per draft node,
        `num_nodes`): logits, made probabilities under settings[r] = (temperature, top_k, top_p)
        (probs_of_rows) only where the rule reads them (the rows that may have children, and the row
        each walk ends at), or probabilities already (settings None). drafts[i]: its tokens and parents
        (None or a chain's: a chain), on the host or deferred; draft_probs[i]: a chain's q [k, vocab] or
        None; generators[i]: its random stream. A deferred draft's host tokens are read at `finish`."""
        device, vocab = logits.device, logits.shape[-1]
        self._rows = (logits, index, settings)
        self.drafts = drafts
        sizes = [num_nodes(d) for d in drafts]
        S, N = len(drafts), sum(sizes)
        self.offsets = np.cumsum([0] + [n + 1 for n in sizes])[:-1].tolist()  # each sequence's context row
        self.node_base = np.cumsum([0] + sizes)[:-1].tolist()  # each sequence's first node
        R = N + S
        W = max(sizes, default=0)
        node_seq = np.repeat(np.arange(S), sizes).astype(np.int64)
        node_j = np.arange(N, dtype=np.int64) - np.asarray(self.node_base, dtype=np.int64)[node_seq]
        node_row = np.asarray(self.offsets, dtype=np.int64)[node_seq] + 1 + node_j
        self.node_row = node_row.tolist()
        # host parts of the layout; a deferred draft's tokens, parents and kept rows are placed on the device
        token = np.zeros(N, dtype=np.int64)
        parent = np.zeros(N, dtype=np.int64)  # index among its sequence's nodes, -1: the context row
        live = np.ones(N, dtype=bool)
        placed: list[tuple[int, int, torch.Tensor, torch.Tensor | None, torch.Tensor | None]] = []
        chains, needed = [], np.zeros(R, dtype=bool)  # needed: rows that may have children
        q_rows, q_seq, q_atol, node_q = [], [], [], np.full(N, -1, dtype=np.int64)
        row_child_q = np.full(R, 0, dtype=np.int64)  # filled below: nq marks "no sampled child"
        child_q: dict[int, int] = {}
        nq = 0
        for s, (d, q, n) in enumerate(zip(drafts, draft_probs, sizes)):
            base, ctx = self.node_base[s], self.offsets[s]
            chain = is_chain(d)
            chains.append(chain)
            row = getattr(d, "deferred", None)
            if row is None:
                token[base: base + n] = d.tokens
                parent[base: base + n] = range(-1, n - 1) if chain else d.parents
                for j in set(parent[base: base + n].tolist()):
                    needed[ctx + 1 + j] = True
            else:
                if not chain and (row.parents is None or row.live is None):
                    raise ValueError("a deferred tree needs its parents and kept nodes on the device")
                parent[base: base + n] = np.arange(-1, n - 1)
                placed.append((base, n, row.tokens, None if chain else row.parents, None if chain else row.live))
                needed[ctx: ctx + (n if chain else n + 1)] = True
            if chain and n and q is not None and tuple(q.shape) == (n, vocab):  # a usable shape
                q_rows.append(q.float())
                q_seq += [s] * n
                q_atol += [_SUM_ATOL.get(q.dtype, 1e-3)] * n
                node_q[base: base + n] = nq + np.arange(n)
                for j in range(n):
                    child_q[ctx + j] = nq + j
                nq += n
        row_child_q[:] = nq
        for r, qi in child_q.items():
            row_child_q[r] = qi
        counts = [n + 1 for n in sizes]
        u_base = np.cumsum([0] + counts)[:-1]
        node_u = (u_base[node_seq] + node_j).astype(np.int64)
        final_u = (u_base + np.asarray(sizes, dtype=np.int64)).astype(np.int64)
        # each row tries its sequence's nodes in order (N: padding); likewise each node its siblings' candidates
        sib = np.full((R, max(W, 1)), N, dtype=np.int64)
        for s, n in enumerate(sizes):
            sib[self.offsets[s]: self.offsets[s] + n + 1, :n] = self.node_base[s] + np.arange(n)
        need_rows = np.flatnonzero(needed)
        slot = np.full(R + 1, len(need_rows), dtype=np.int64)  # row -> its place among the needed rows
        slot[need_rows] = np.arange(len(need_rows))
        (t_token, t_parent, t_live, t_seq, t_sib, t_node_u, t_final_u, t_node_q, t_row_q, t_node_row, t_ctx,
         t_q_seq, t_q_atol, t_need, t_slot, t_j) = to_device(
            token, parent, live, node_seq, sib, node_u, final_u, node_q, row_child_q,
            np.append(node_row, 0), np.asarray(self.offsets, dtype=np.int64), np.asarray(q_seq, dtype=np.int64),
            np.asarray(q_atol, dtype=np.float32), need_rows.astype(np.int64), slot, node_j, device=device)
        for base, n, tokens, parents, kept in placed:  # the deferred drafts, where they are
            t_token[base: base + n] = tokens[:n].to(t_token.dtype)
            if parents is not None:
                t_parent[base: base + n] = parents[:n].to(t_parent.dtype)
                t_live[base: base + n] = kept[:n]
        # every uniform of the batch: per sequence one per node, then one for its final token
        u = torch.cat([torch.rand(c, generator=gen, device=device) for c, gen in zip(counts, generators)])
        # a sampled chain's q: used where all of it is usable (finite, >= 0, rows summing to 1, q(x) > 0)
        if nq:
            q_all = torch.cat(q_rows + [torch.zeros((1, vocab), device=device)])  # [nq + 1, vocab]
            q = q_all[:nq]
            bad = (~torch.isfinite(q)).any(-1) | (q < 0).any(-1) | ((q.sum(-1) - 1).abs() > t_q_atol)
            usable = torch.zeros(S, dtype=torch.bool, device=device)
            usable[t_q_seq] = True
            usable &= _none_of(S, t_q_seq, bad)
        self.tensors: list[torch.Tensor] = []
        if N:
            parent_row = t_ctx[t_seq] + torch.where(t_parent < 0, 0, t_parent + 1)  # [N]
            parent_x = torch.cat([parent_row, parent_row.new_full((1,), -1)])  # (index N: padding)
            live_x = torch.cat([t_live, t_live.new_zeros(1)])
            token_x = torch.cat([t_token, t_token.new_full((1,), -1)])
            probs_n = self._probs(t_need, need_rows.tolist())  # [rows that may have children, vocab]
            p_node = probs_n[t_slot[parent_row], t_token]  # [N] p(x) at each node's parent row
            # a node repeating the token of an earlier kept sibling: mass 0 (its token is gone by then)
            cand = t_sib[t_node_row[:N]]  # [N, W] the nodes of each node's sequence
            earlier = cand < torch.arange(N, device=device)[:, None]
            dup = (earlier & live_x[cand] & (parent_x[cand] == parent_row[:, None])
                   & (token_x[cand] == t_token[:, None])).any(1)
            mass = torch.where(dup | ~t_live, 0.0, p_node)
            # point masses: each row's children tried in turn, each against the mass its earlier ones left
            valid = (parent_x[t_sib] == torch.arange(R, device=device)[:, None]) & live_x[t_sib]  # [R, W]
            pad = torch.where(valid, torch.cat([mass, mass.new_zeros(1)])[t_sib], 0.0)
            before = pad.cumsum(1) - pad  # (a row's mass is 1: processed rows are normalised)
            u_node = u[t_node_u]
            u_sib = torch.cat([u_node, u.new_ones(1)])[t_sib]
            taken = (u_sib * (1 - before) < pad) & valid  # [R, W]
            if nq:  # a sampled chain's draft: accepted with min(1, p / q) (its row has no other child)
                has_q = t_node_q >= 0
                q_node = q_all[t_node_q.clamp(min=0), t_token]
                usable &= _none_of(S, t_seq, has_q & (q_node <= 0))  # a drafted token of q = 0: unusable
                sampled_chain = has_q & usable[t_seq]
                accept = taken[parent_row, t_j]  # [N] each node's point-mass verdict
                accept = torch.where(sampled_chain, u_node * q_node < p_node, accept) & t_live
                taken = torch.cat([accept, accept.new_zeros(1)])[t_sib] & valid
            any_taken = taken.any(1)
            child = t_sib.gather(1, taken.to(torch.uint8).argmax(1, keepdim=True))[:, 0]
            chosen = torch.where(any_taken, child, -1)  # per row: the accepted child, or -1
            chase = torch.where(any_taken, t_node_row[child], torch.arange(R, device=device))
            self.tensors.append(chosen)
        end = t_ctx
        for _ in range(W):  # a walk is at most a sequence's nodes deep
            end = chase[end]
        p_end = self._probs(end, self.offsets)  # [S, vocab]
        residual = p_end
        if N:
            residual = p_end - q_all.index_select(0, t_row_q[end]) * usable[:, None] if nq else p_end.clone()
            # a point-mass walk's rejected children leave the residual (repeats: clamped at 0)
            rejected = (end[t_seq] == parent_row) & t_live
            if nq:
                rejected &= ~sampled_chain
            at = p_end[t_seq, t_token]
            residual.index_put_((t_seq, t_token), torch.where(rejected, -at, 0.0), accumulate=True)
            residual = residual.clamp_min_(0)
            residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p_end)
        cumulative = residual.cumsum(-1)
        draw = u[t_final_u] * cumulative[:, -1]
        self.tensors.append(torch.searchsorted(cumulative, draw[:, None], right=True)[:, 0].clamp_(max=vocab - 1))

    def _probs(self, which: torch.Tensor, like: list[int]) -> torch.Tensor:
        """The probabilities of the sequences' rows `which`, each under the settings of the host row at
        the same place in `like` (its sequence's: one setting a sequence)."""
        logits, index, settings = self._rows
        picked = logits.index_select(0, which if index is None else index[which])
        return picked.float() if settings is None else probs_of_rows(picked, [settings[r] for r in like]).float()

    def finish(self, arrays: list) -> list[tuple[list[int], list[int]]]:
        """arrays: `tensors` read to the host. Per sequence: (emitted tokens, accepted node indices in
        path order). The drafts' tokens are read now (a deferred draft's are on the host by then)."""
        final = arrays[-1].tolist()
        chosen = arrays[0].tolist() if len(arrays) > 1 else []
        out = []
        for s, d in enumerate(self.drafts):
            row, path = self.offsets[s], []
            while chosen and chosen[row] >= 0:
                g = chosen[row]
                path.append(g - self.node_base[s])
                row = self.node_row[g]
            tokens = d.tokens
            out.append(([int(tokens[j]) for j in path] + [final[s]], path))
        return out


def sample_verdicts(logits: torch.Tensor, index: torch.Tensor | None, settings: list | None, drafts: list,
                    draft_probs: list, generators: list) -> SampledBatch:
    """The rule `verify` applies to its sampled sequences (by this module's name: a test wraps it to
    record draws, or replaces it to inject a fault; `rows_probs` gives every row it may read)."""
    return SampledBatch(logits, index, settings, drafts, draft_probs, generators)


def rows_probs(logits: torch.Tensor, index: torch.Tensor | None, settings: list | None) -> torch.Tensor:
    """[R, vocab]: every row of a SampledBatch's sequences as probabilities (what its rule reads)."""
    rows = logits if index is None else logits.index_select(0, index)
    return rows.float() if settings is None else probs_of_rows(rows, settings).float()


def _none_of(size: int, index: torch.Tensor, flags: torch.Tensor) -> torch.Tensor:
    """[size] bool: True where no flag scattered to it (index[i] -> flags[i]) is set."""
    hits = torch.zeros(size, dtype=torch.int32, device=flags.device).index_add_(0, index, flags.to(torch.int32))
    return hits == 0


def verify_sampled(
    target_probs: torch.Tensor,
    draft_tokens: list[int],
    draft_probs: torch.Tensor | None,
    generator: torch.Generator,
) -> list[int]:
    """One sequence's chain (the batch rule, `SampledBatch`, for one sequence; reads the device).
    target_probs: [k + 1, vocab]; draft_probs: [k, vocab] or None (point mass). A draft_probs of
    another shape, or one that is not usable (module docstring), counts as None."""
    batch = SampledBatch(target_probs, None, None, [_Nodes(list(draft_tokens), None)], [draft_probs], [generator])
    return batch.finish(to_host(*batch.tensors))[0][0]


def verify_tree_parents(num_pending: int, draft) -> list[int]:
    """Parents for a verification row: the pending tokens as a chain, the draft tree under the last."""
    chain = list(range(-1, num_pending - 1))
    # a chain draft (parents None: sampled, or no draft at all) can share a batch with trees
    parents = draft.parents if draft.parents is not None else list(range(-1, len(draft.tokens) - 1))
    return chain + [num_pending - 1 if p < 0 else num_pending + p for p in parents]


def verify_tree_greedy(target_argmax: list[int], num_pending: int, draft) -> tuple[list[int], list[int]]:
    """Greedy acceptance over a token tree: follow the child that matches the target's argmax.

    target_argmax[r]: the target's choice after row r of the verification row (pending tokens,
    then the tree nodes). Returns (emitted tokens: the accepted path plus the target's next
    token, accepted node indices in path order).
    """
    children: dict[int, list[int]] = {}
    for j, p in enumerate(draft.parents):
        children.setdefault(p, []).append(j)
    node, row, path = -1, num_pending - 1, []
    while True:
        want = target_argmax[row]
        match = next((c for c in children.get(node, ()) if draft.tokens[c] == want), None)
        if match is None:
            return [draft.tokens[j] for j in path] + [want], path
        path.append(match)
        node, row = match, num_pending + match


def verify_tree_sampled(probs_at, num_pending: int, draft, generator: torch.Generator) -> tuple[list[int], list[int]]:
    """One sequence's token tree (the batch rule, `SampledBatch`, for one sequence; reads the device).
    probs_at(row) -> [vocab] processed target probabilities after row `row` of the verification row
    (pending tokens, then the tree nodes). Returns (emitted tokens, accepted node indices in path
    order), like verify_tree_greedy."""
    rows = torch.stack([probs_at(num_pending - 1)] + [probs_at(num_pending + j) for j in range(len(draft.tokens))])
    batch = SampledBatch(rows, None, None, [_Nodes(list(draft.tokens), list(draft.parents))], [None], [generator])
    return batch.finish(to_host(*batch.tensors))[0]


def coupled(params) -> bool:
    """Whether a request draws coupled (seeded and sampled: rayspec.sampling.sampler)."""
    return not params.greedy and params.seed is not None


def draft_depths(draft) -> list[int]:
    """Per draft token, its depth (1: a child of the last committed token): chains 1..k."""
    if draft.parents is None:
        return list(range(1, len(draft.tokens) + 1))
    depths: list[int] = []
    for p in draft.parents:
        depths.append(1 if p < 0 else depths[p] + 1)
    return depths


def coupled_choices(logits: torch.Tensor, choice: torch.Tensor, starts: list[int], num_pending: list[int],
                    drafts: list, params: list, positions: list[int]) -> torch.Tensor:
    """choice: [N] the target's per-row choice (its argmax); at the rows a coupled (seeded sampled)
    sequence's verification reads, the target's coupled draw there instead (in place, no host read).
    Sequence i's last pending row predicts position positions[i] (its token count); a draft
    token's row predicts the position past its depth (a deferred tree's depths are on the device:
    its keys are made there, `coupled_keys_at`)."""
    rows, seeds, at, settings, spread = [], [], [], [], []
    for start, pending, draft, p, pos in zip(starts, num_pending, drafts, params, positions):
        if not coupled(p):
            continue
        first = start + pending - 1  # the last pending token's row: depth 0
        row = getattr(draft, "deferred", None)
        n = num_nodes(draft)
        if row is not None and row.sees is not None:  # a deferred tree: depths added on the device
            depths = [0] * (n + 1)
            spread.append((len(rows) + 1, n, row.depth))
        else:
            depths = [0] + (list(range(1, n + 1)) if row is not None else draft_depths(draft))
        rows += range(first, first + n + 1)
        seeds += [p.seed] * (n + 1)
        at += [pos + d for d in depths]
        settings += [(p.temperature, p.top_k, p.top_p)] * (n + 1)
    if rows:
        index, at_t = to_device(np.asarray(rows, dtype=np.int64), np.asarray(at, dtype=np.int64), device=logits.device)
        for offset, n, depth in spread:
            at_t[offset: offset + n] += depth[:n].to(at_t.dtype)
        draws = coupled_sample(probs_of_rows(logits.index_select(0, index), settings), coupled_keys_at(seeds, at_t))
        choice.index_copy_(0, index, draws.to(choice.dtype))
    return choice


def verify(logits: torch.Tensor, target_choice, starts: list[int], num_pending: list[int],
           drafts: list, params: list, generators: list) -> tuple[list[list[int]], list[list[int]]]:
    """The verdicts of one verification forward over a batch: chains and trees, greedy and sampled
    (`Verification`, read here in one read).

    logits: [N, vocab] processed target logits of the packed verification rows. Sequence i's rows
    start at starts[i]: its num_pending[i] tokens without KV yet (the last of them predicts the
    first draft token), then its draft's tokens (drafts[i]: a chain, or a tree with parents).
    target_choice: [N] logits.argmax(-1), and at a coupled sequence's rows its coupled draws
    (`coupled_choices`): a device tensor (read here, in one read with the sampled sequences'
    verdicts) or a host list; None when no sequence is greedy or coupled.
    params[i]: sequence i's SamplingParams (greedy, or its temperature / top-k / top-p, and seed);
    generators[i]: its random stream (sampled without a seed only).
    Returns per sequence (emitted tokens: the accepted drafts + the recovered/bonus token; kept rows:
    the rows whose KV stays, the pending tokens' and then the accepted drafts' in path order).
    """
    plan = Verification(logits, target_choice, starts, num_pending, drafts, params, generators)
    return plan.finish(to_host(*plan.tensors) if plan.tensors else [])


class Verification:
    """`verify` in two halves around its read: built, it has queued the sampled sequences' rule on the
    device (`tensors`: what to read, the target's choices first when they are a device tensor);
    `finish(arrays)` gives (emitted, kept) as `verify` does. Drafts still on the device (deferred)
    are verified where they are; the engine reads `tensors` with them (rayspec.engine.deferred_verify),
    and they are host drafts by `finish`."""

    def __init__(self, logits: torch.Tensor, target_choice, starts: list[int], num_pending: list[int],
                 drafts: list, params: list, generators: list):
        self.sampled = [i for i, p in enumerate(params) if not (p.greedy or coupled(p))]
        self.batch = None
        if self.sampled:  # rejection sampling: one rule for every sampled sequence, its rows processed where read
            index, settings = [], []
            for i in self.sampled:
                n = num_nodes(drafts[i]) + 1
                first = starts[i] + num_pending[i] - 1
                index.append(np.arange(first, first + n))
                p = params[i]
                settings += [(p.temperature, p.top_k, p.top_p)] * n
            (rows,) = to_device(np.concatenate(index), device=logits.device)
            self.batch = sample_verdicts(logits, rows, settings, [drafts[i] for i in self.sampled],
                                         [_chain_q(drafts[i]) for i in self.sampled],
                                         [generators[i] for i in self.sampled])
        self.on_device = isinstance(target_choice, torch.Tensor)
        self.tensors = ([target_choice] if self.on_device else []) + (self.batch.tensors if self.batch else [])
        self._args = (target_choice, starts, num_pending, drafts)

    def finish(self, arrays: list) -> tuple[list[list[int]], list[list[int]]]:
        target_choice, starts, num_pending, drafts = self._args
        arrays = list(arrays)
        if self.on_device:
            target_choice = arrays.pop(0).tolist()
        verdicts = dict(zip(self.sampled, self.batch.finish(arrays))) if self.batch is not None else {}
        emitted, kept = [], []
        for i, (start, pending, draft) in enumerate(zip(starts, num_pending, drafts)):
            rows = slice(start, start + pending + len(draft.tokens))
            if i in verdicts:
                tokens, path = verdicts[i]
            elif draft.is_chain:  # the greedy rule over the target's choices (greedy, or coupled draws)
                tokens = verify_greedy([target_choice[rows][pending - 1:]], [draft.tokens])[0]
                path = list(range(len(tokens) - 1))
            else:
                tokens, path = verify_tree_greedy(target_choice[rows], pending, draft)
            kept.append(list(range(pending)) + [pending + j for j in path])
            emitted.append(tokens)
        return emitted, kept


def _chain_q(draft) -> torch.Tensor | None:
    """A chain's q (the probabilities its tokens were drawn from), None for a tree or a point mass."""
    row = getattr(draft, "deferred", None)
    if row is not None:
        return row.probs if row.sees is None else None
    return draft.probs if draft.is_chain else None
