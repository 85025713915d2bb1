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
(`usable_draft_probs`): finite, non-negative, each row summing to 1, q(x) > 0 for the drafted
token. A q that fails is ignored and the draft is verified as a point mass, which is lossless
whatever tokens were drafted (acceptance p(x), residual p without x): a broken or forged q can
cost acceptance, never put a token outside the target's distribution.
Token trees are verified greedily (`verify_tree_greedy`) or, when sampled, by applying the
point-mass rule to siblings in turn (`verify_tree_sampled`). `verify` takes a whole batch's
verification rows and picks the rule per sequence (chain or tree, greedy or sampled).

Seeded sampled requests are verified *coupled* (rayspec.sampling.sampler, "Two kinds of draw"): at each row
the target's choice is its coupled draw at the position the row predicts (`coupled_choices`), and
the greedy rule runs over those choices instead of the argmax. Every emitted token is then the
target's own coupled draw: lossless whatever was drafted (a forged draft or q can only cost
acceptance), and the same tokens as target-only decoding with that seed.
"""

from __future__ import annotations

import torch

import numpy as np

from rayspec.device_io import to_device
from rayspec.sampling.sampler import coupled_key, coupled_sample, logits_to_probs, probs_of_rows, sample


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


def usable_draft_probs(draft_probs: torch.Tensor, draft_tokens: torch.Tensor) -> torch.Tensor:
    """draft_probs: [k, vocab]; draft_tokens: [k]. A 0-d bool tensor (on the probs' device, not
    read here): is every entry finite and >= 0, every row's sum 1, and q(x) > 0 at each drafted x?"""
    q = draft_probs.float()
    atol = _SUM_ATOL.get(draft_probs.dtype, 1e-3)
    return (torch.isfinite(q).all() & (q >= 0).all()
            & (q[torch.arange(len(draft_tokens), device=q.device), draft_tokens] > 0).all()
            & ((q.sum(-1) - 1).abs() <= atol).all())


def verify_sampled(
    target_probs: torch.Tensor,
    draft_tokens: list[int],
    draft_probs: torch.Tensor | None,
    generator: torch.Generator,
) -> list[int]:
    """One sequence. target_probs: [k + 1, vocab]; draft_probs: [k, vocab] or None (point mass).
    A draft_probs of another shape, or one that fails `usable_draft_probs`, counts as None."""
    k = len(draft_tokens)
    if draft_probs is not None and tuple(draft_probs.shape) != (k, target_probs.shape[-1]):
        draft_probs = None
    if k:
        idx = torch.arange(k, device=target_probs.device)
        drafts = torch.tensor(draft_tokens, device=target_probs.device)
        p = target_probs[idx, drafts]  # [k]
        u = torch.rand(k, generator=generator, device=target_probs.device)
        rejected_point_mass = u >= p  # [k]: q = one_hot(x)
        if draft_probs is None:
            rejected = rejected_point_mass.tolist()
        else:
            # accept iff u < p/q, written without dividing (q > 0 once usable); one host read for
            # both verdicts and q's check, the same random numbers whichever is used
            q = draft_probs[idx, drafts].to(p.dtype)
            flags = torch.cat([u * q >= p, rejected_point_mass, usable_draft_probs(draft_probs, drafts)[None]]).tolist()
            rejected = flags[:k] if flags[-1] else flags[k:2 * k]
            if not flags[-1]:
                draft_probs = None
    else:
        rejected = []
    for j in range(k):
        if rejected[j]:
            if draft_probs is not None:
                residual = (target_probs[j] - draft_probs[j]).clamp_min(0)
            else:
                residual = target_probs[j].clone()
                residual[draft_tokens[j]] = 0
            total = residual.sum()
            if total <= 0:  # p == q exactly: rejection had probability 0; fall back to p
                residual = target_probs[j]
            recovered = sample(residual, generator)
            return draft_tokens[:j] + [recovered]
    bonus = sample(target_probs[k], generator)
    return list(draft_tokens) + [bonus]


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
    """Lossless acceptance over a token tree at temperature > 0 (multi-round, over siblings).

    The tree's tokens were chosen deterministically (the head's top candidates), so each
    child is a point-mass draft: at a node with target distribution p, the first child x is
    accepted with probability p(x); on rejection p loses x (renormalised) and the next
    sibling is tried against that residual, and so on. When every child is rejected, the
    emitted token is sampled from what is left of p. By induction each round emits exactly
    the distribution it was handed, so the whole walk emits tokens distributed as the target.

    probs_at(row) -> [vocab] processed target probabilities after row `row` of the
    verification row (pending tokens, then the tree nodes). Returns (emitted tokens, accepted
    node indices in path order), like verify_tree_greedy.
    """
    children: dict[int, list[int]] = {}
    for j, p in enumerate(draft.parents):
        children.setdefault(p, []).append(j)
    node, row, path = -1, num_pending - 1, []
    while True:
        p = probs_at(row).clone()  # [vocab]
        accepted = None
        for c in children.get(node, ()):
            token = draft.tokens[c]
            total = p.sum()
            u = torch.rand((), generator=generator, device=p.device)
            if u * total < p[token]:  # accept with probability p(token) / total
                accepted = c
                break
            p[token] = 0
        if accepted is None:
            if p.sum() <= 0:  # every token with mass was a rejected sibling: cannot happen
                p = probs_at(row)  # unless rounding left none; fall back to the target row
            token = sample(p, generator)
            return [draft.tokens[j] for j in path] + [token], path
        path.append(accepted)
        node, row = accepted, num_pending + accepted


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
    token's row predicts the position past its depth."""
    rows, keys, settings = [], [], []
    for start, pending, draft, p, pos in zip(starts, num_pending, drafts, params, positions):
        if not coupled(p):
            continue
        first = start + pending - 1  # the last pending token's row: depth 0
        for r, depth in [(first, 0)] + [(first + 1 + j, d) for j, d in enumerate(draft_depths(draft))]:
            rows.append(r)
            keys.append(coupled_key(p.seed, pos + depth))
            settings.append((p.temperature, p.top_k, p.top_p))
    if rows:
        (index,) = to_device(np.asarray(rows, dtype=np.int64), device=logits.device)
        draws = coupled_sample(probs_of_rows(logits.index_select(0, index), settings), keys)
        choice.index_copy_(0, index, draws.to(choice.dtype))
    return choice


def verify(logits: torch.Tensor, target_choice: list[int] | None, starts: list[int], num_pending: list[int],
           drafts: list, params: list, generators: list) -> tuple[list[list[int]], list[list[int]]]:
    """The verdicts of one verification forward over a batch: chains and trees, greedy and sampled.

    logits: [N, vocab] processed target logits of the packed verification rows. Sequence i's rows
    start at starts[i]: its num_pending[i] tokens without KV yet (the last of them predicts the
    first draft token), then its draft's tokens (drafts[i]: a chain, or a tree with parents).
    target_choice: [N] read to the host: logits.argmax(-1), and at a coupled sequence's rows its
    coupled draws (`coupled_choices`); None when no sequence is greedy or coupled.
    params[i]: sequence i's SamplingParams (greedy, or its temperature / top-k / top-p, and seed);
    generators[i]: its random stream (sampled without a seed only).
    Returns per sequence (emitted tokens: the accepted drafts + the recovered/bonus token; kept rows:
    the rows whose KV stays, the pending tokens' and then the accepted drafts' in path order).
    """
    chain_probs = _sampled_chain_probs(logits, starts, num_pending, drafts, params)
    emitted, kept = [], []
    for i, (start, pending, draft, p, generator) in enumerate(zip(starts, num_pending, drafts, params, generators)):
        rows = slice(start, start + pending + len(draft.tokens))
        by_choice = p.greedy or coupled(p)  # the greedy rule over the target's choices
        if draft.is_chain:
            if by_choice:
                tokens = verify_greedy([target_choice[rows][pending - 1:]], [draft.tokens])[0]
            else:
                tokens = verify_sampled(chain_probs[i], draft.tokens, draft.probs, generator)
            kept.append(list(range(pending + len(tokens) - 1)))
        else:
            tokens, path = (verify_tree_greedy(target_choice[rows], pending, draft) if by_choice else
                            verify_tree_sampled(_probs_at(logits[rows], p), pending, draft, generator))
            kept.append(list(range(pending)) + [pending + j for j in path])
        emitted.append(tokens)
    return emitted, kept


def _sampled_chain_probs(logits: torch.Tensor, starts: list[int], num_pending: list[int], drafts: list,
                         params: list) -> dict[int, torch.Tensor]:
    """Sequence i -> its chain's processed target rows [k + 1, vocab] (the last pending token's, then the
    drafts'), for the sequences verified by rejection sampling: every row in one probs_of_rows call
    (one set of kernels for the batch, not one per sequence; each row as logits_to_probs gives it)."""
    which, index, settings, counts = [], [], [], []
    for i, (start, pending, draft, p) in enumerate(zip(starts, num_pending, drafts, params)):
        if draft.is_chain and not (p.greedy or coupled(p)):
            n = len(draft.tokens) + 1
            which.append(i)
            index.append(np.arange(start + pending - 1, start + pending - 1 + n))
            settings += [(p.temperature, p.top_k, p.top_p)] * n
            counts.append(n)
    if not which:
        return {}
    (rows,) = to_device(np.concatenate(index), device=logits.device)
    probs = probs_of_rows(logits.index_select(0, rows), settings)
    return dict(zip(which, probs.split(counts)))


def _probs_at(logits: torch.Tensor, params):
    """row -> the processed target distribution there (computed only for rows a tree walk visits)."""
    return lambda r: logits_to_probs(logits[r][None], params.temperature, params.top_k, params.top_p)[0]
