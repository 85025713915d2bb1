"""The rejection rule's own law, with power 0.99 at total variation 0.02 for the bias that is
hardest to see (issue #53, item 3).

rayspec.sampling.rejection is the one piece every topology shares: whatever the topology hands it
(the target rows p, the drafts and their q: held exact by tests/engine/test_lossless_grid.py's audit),
what it emits must follow the law the rule defines. Here that law, computed in numpy from p, q and
the drafts (tests/audit.py `rule_blocks`, not rayspec's code), is tested outcome by outcome: an
outcome is the accepted path and the token drawn after it (recovered or bonus), so a category of
Pearson's test is one (path, token); categories expected fewer than 5 times are pooled
(stat_utils.Bins).

Cases (a 5-token vocabulary, so every outcome is seen often): a sampled chain of 2 drafts with
their q, one of them with q(x) > p(x) and one with mass where p has none; a point-mass chain (n-gram
drafts); a token tree with 3 live siblings at the root and a path 3 deep.

Power, derived per case (`sample_size`), for two bias shapes of TV exactly 0.02 on the outcome law:
- chain-shaped: the rule accepting every draft with min(1, B p / q) (point masses: B R(x) / R's
  mass), B solved for TV 0.02;
- proportional: pi (1 + eps s), s = +1 on the likeliest outcomes holding half the mass and -1 on the
  rest, eps solved for TV 0.02: a change in proportion to every probability, the shape with the
  least chi-square divergence for its TV (4 TV^2 = 0.0016: Cauchy-Schwarz), so the power it is
  given holds for any bias of that TV that the pooling does not hide.
The sample size is the smallest (in thousands) at which Pearson's test at LAW_ALPHA has power >= 0.99
against both (noncentral chi-square, stat_utils.power): 28,000 draws for the sampled chain (6
outcomes), 38,000 for the point-mass chain (12), 46,000 for the tree (25), printed.
Run at that size, the rule passes; the same test rejects the chain-shaped bias injected into the
rule's code (`boosted_rule`) and draws from the proportional alternative (both at TV 0.02).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import stat_utils
from audit import Block, Draw, rule_blocks, usable
from rayspec.proposers.base import Draft
from rayspec.device_io import to_host
from rayspec.sampling.rejection import SampledBatch

V = 5
LAW_ALPHA = 1e-4  # per test: 3 cases + 2 injected biases
TV = 0.02


def _rows(*rows) -> np.ndarray:
    out = np.array(rows, dtype=np.float64)
    return out / out.sum(-1, keepdims=True)


# (id, kind, target rows [1 + nodes, V] (the context's, then each node's), q [nodes, V] or None, tokens, parents)
LAW_CASES = [
    ("sampled-chain", "chain", _rows([0.30, 0.25, 0.20, 0.15, 0.10], [0.10, 0.40, 0.0, 0.30, 0.20],
                                     [0.25, 0.25, 0.20, 0.20, 0.10]),
     _rows([0.50, 0.10, 0.20, 0.0, 0.20], [0.10, 0.20, 0.30, 0.30, 0.10]), [0, 2], [-1, 0]),
    ("point-mass-chain", "chain", _rows([0.30, 0.25, 0.20, 0.15, 0.10], [0.10, 0.40, 0.0, 0.30, 0.20],
                                        [0.25, 0.25, 0.20, 0.20, 0.10]), None, [1, 3], [-1, 0]),
    # root: nodes 0, 1, 2 (tokens 0, 1, 2); node 3 under node 0, node 4 under node 3: a path 3 deep
    ("tree", "tree", _rows([0.30, 0.25, 0.20, 0.15, 0.10], [0.20, 0.20, 0.20, 0.20, 0.20], [0.10, 0.40, 0.30, 0.10, 0.10],
                           [0.40, 0.10, 0.20, 0.10, 0.20], [0.30, 0.30, 0.10, 0.20, 0.10], [0.25, 0.25, 0.20, 0.20, 0.10]),
     None, [0, 1, 2, 3, 4], [-1, -1, -1, 0, 3]),
]


def _draw(case) -> Draw:
    _, kind, p, q, tokens, parents = case
    return Draw("rule", (), 0, None, kind, p, list(tokens), list(parents), q)


def law(blocks: list[Block]) -> dict[tuple, float]:
    """(path, token) -> probability."""
    return {(b.path, y): b.mass * float(b.row[y]) for b in blocks for y in range(V) if b.mass * b.row[y] > 0}


def proportional(exact: dict, tv: float) -> dict:
    """exact (1 + eps s) renormalised, s = +1 on the likeliest outcomes holding half the mass, eps
    solved so that the total variation is `tv`."""
    order = sorted(exact, key=lambda c: -exact[c])
    mass = np.array([exact[c] for c in order])
    sign = np.where(np.cumsum(mass) - mass < 0.5, 1.0, -1.0)

    def moved(eps):
        w = mass * (1 + eps * sign)
        return dict(zip(order, w / w.sum()))

    low, high = 0.0, 1.0
    for _ in range(60):
        mid = (low + high) / 2
        low, high = (mid, high) if stat_utils.tv(exact, moved(mid)) < tv else (low, mid)
    return moved(high)


def boost_for(draw: Draw, exact: dict, tv: float) -> float:
    """B with the boosted rule's law at total variation `tv` from the rule's."""
    low, high = 1.0, 4.0
    for _ in range(60):
        mid = (low + high) / 2
        low, high = (mid, high) if stat_utils.tv(exact, law(rule_blocks(draw, boost=mid))) < tv else (low, mid)
    return high


def sample_size(exact: dict, alternatives: list[dict], alpha: float) -> int:
    """The smallest n (in thousands) at which the test has power >= 0.99 against every alternative
    (power grows with n: doubled, then bisected)."""
    def enough(k: int) -> bool:
        return min(stat_utils.power(exact, alt, 1000 * k, alpha) for alt in alternatives) >= 0.99

    high = 1
    while not enough(high):
        high *= 2
    low = high // 2  # not enough (or 0)
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (low, mid) if enough(mid) else (mid, high)
    return 1000 * high


def run_rule(case, n: int, seed: int, chain_rule=None) -> list[tuple]:
    """n outcomes (path, token) of the rule on the case (fixed drafts; rows as torch float32, as the
    engine hands them over): the engine's batched rule over n sequences of the case in one batch, or
    a per-sequence chain rule in its place (an injected bias)."""
    return run_batch([case] * n, seed, chain_rule)


def run_batch(cases: list, seed: int, chain_rule=None) -> list[tuple]:
    """The outcome (path, token) of each case, all verified in one batch (`SampledBatch`: a batch of
    mixed shapes, one random stream); with chain_rule, chains by that rule one at a time instead."""
    gen = torch.Generator().manual_seed(seed)
    rows = torch.tensor(np.concatenate([c[2] for c in cases]), dtype=torch.float32)
    drafts = [Draft(list(c[4]), parents=list(c[5])) for c in cases]
    qs = [None if c[3] is None else torch.tensor(c[3], dtype=torch.float32) for c in cases]
    if chain_rule is not None:
        out, start = [], 0
        for c, q in zip(cases, qs):
            emitted = chain_rule(rows[start: start + len(c[4]) + 1], list(c[4]), q, gen)
            out.append((tuple(range(len(emitted) - 1)), emitted[-1]))
            start += len(c[4]) + 1
        return out
    batch = SampledBatch(rows, None, None, drafts, qs, [gen] * len(cases))
    return [(tuple(path), emitted[-1]) for emitted, path in batch.finish(to_host(*batch.tensors))]


def boosted_rule(boost: float):
    """verify_sampled accepting each draft with min(1, boost p / q): the chain-shaped bias, in the
    rule's place."""
    def rule(target_probs, draft_tokens, draft_probs, generator):
        for j, x in enumerate(draft_tokens):
            p = float(target_probs[j, x])
            q = 1.0 if draft_probs is None else float(draft_probs[j, x])
            if float(torch.rand((), generator=generator)) * q < boost * p:
                continue
            residual = (target_probs[j] - draft_probs[j]).clamp_min(0) if draft_probs is not None else \
                target_probs[j].clone().index_fill_(0, torch.tensor([x]), 0.0)
            return list(draft_tokens[:j]) + [int(torch.multinomial(residual, 1, generator=generator))]
        return list(draft_tokens) + [int(torch.multinomial(target_probs[len(draft_tokens)], 1, generator=generator))]

    return rule


@pytest.mark.parametrize("case", LAW_CASES, ids=[c[0] for c in LAW_CASES])
def test_rule_follows_its_law_with_power(case):
    draw = _draw(case)
    exact = law(rule_blocks(draw))
    assert abs(sum(exact.values()) - 1) < 1e-12
    boost = boost_for(draw, exact, TV)
    chain, prop = law(rule_blocks(draw, boost=boost)), proportional(exact, TV)
    n = sample_size(exact, [chain, prop], LAW_ALPHA)
    powers = {name: stat_utils.power(exact, alt, n, LAW_ALPHA) for name, alt in (("chain", chain), ("proportional", prop))}
    result = stat_utils.chi_square_test(run_rule(case, n, seed=1), exact)
    print(f"{case[0]}: {len(exact)} outcomes, n = {n}: power at TV {TV} {powers} (boost {boost:.4f}); {result}")
    assert n <= 50_000, n  # the cost this module was sized for
    assert result.impossible == 0 and result.p_value > LAW_ALPHA, result


def test_injected_biases_at_tv_002_are_rejected():
    """On the sampled chain at its derived sample size: the rule with the chain-shaped bias in its
    place, and draws from the proportional alternative, both at TV 0.02, fail the same test."""
    case = LAW_CASES[0]
    draw = _draw(case)
    exact = law(rule_blocks(draw))
    boost = boost_for(draw, exact, TV)
    prop = proportional(exact, TV)
    n = sample_size(exact, [law(rule_blocks(draw, boost=boost)), prop], LAW_ALPHA)
    biased = stat_utils.chi_square_test(run_rule(case, n, seed=2, chain_rule=boosted_rule(boost)), exact)
    keys = list(prop)
    picks = np.random.default_rng(3).choice(len(keys), size=n, p=np.array([prop[k] for k in keys]))
    spread = stat_utils.chi_square_test([keys[i] for i in picks], exact)
    print(f"chain-shaped (boost {boost:.4f}): {biased}; proportional: {spread}")
    assert biased.p_value < LAW_ALPHA, biased
    assert spread.p_value < LAW_ALPHA, spread


# cases the batch must also get right beside the others: a chain whose q is unusable (a row not summing
# to 1: verified as point masses), an empty draft (the bonus alone), a tree whose root repeats a token
MIXED_EXTRA = [
    ("unusable-q", "chain", LAW_CASES[0][2], LAW_CASES[0][3] * np.array([[1.0], [0.5]]), [0, 2], [-1, 0]),
    ("empty", "chain", LAW_CASES[0][2][:1], None, [], []),
    ("repeat", "tree", LAW_CASES[2][2][:4], None, [1, 1, 3], [-1, -1, 0]),
]


def test_mixed_batch_each_sequence_follows_its_law():
    """One batch of every case interleaved (sampled and point-mass chains, a 3-sibling tree, an
    unusable q, an empty draft, a repeated sibling): each sequence's outcome follows its own case's
    law (a layout error, one sequence's rows or verdicts read for another's, fails here). 6,000 of
    each; Pearson's test per case at LAW_ALPHA."""
    cases = LAW_CASES + MIXED_EXTRA
    n = 6000
    order = [i for _ in range(n) for i in range(len(cases))]
    outcomes = run_batch([cases[i] for i in order], seed=4)
    for i, case in enumerate(cases):
        draw = _draw(case)
        if case[0] == "unusable-q":  # the rule ignores a q that is not a distribution
            assert not usable(draw.q, draw.tokens, V)
        exact = law(rule_blocks(draw))
        result = stat_utils.chi_square_test([o for o, c in zip(outcomes, order) if c == i], exact)
        print(f"{case[0]}: {len(exact)} outcomes; {result}")
        assert result.impossible == 0 and result.p_value > LAW_ALPHA, (case[0], result)


def test_deferred_drafts_follow_their_law():
    """The same interleaved batch with every draft still on the device (rayspec.proposers.deferred: the
    engine's one read brings the drafts back with these verdicts): each tree takes two more rows than
    it keeps, as a deferred tree past its stop rule does (not kept, hanging from the root, one
    repeating a kept root child's token), chains carry their q there. Each sequence's outcome follows
    its host case's law: a row not kept is never accepted, takes no mass from its siblings and leaves
    the residual alone. 6,000 of each; Pearson's test per case at LAW_ALPHA."""
    from rayspec.proposers.deferred import DeferredRow, ancestry

    cases = LAW_CASES + MIXED_EXTRA
    n = 6000
    order = [i for _ in range(n) for i in range(len(cases))]
    gen = torch.Generator().manual_seed(5)
    rows, drafts, qs, hosts = [], [], [], []
    for i in order:
        _, kind, p, q, tokens, parents = cases[i]
        extra = 2 if kind == "tree" else 0
        rows.append(np.concatenate([p, np.full((extra, V), 1.0 / V)]))
        ids = torch.tensor(list(tokens) + ([tokens[0], 4] if extra else []), dtype=torch.long)
        qt = None if q is None else torch.tensor(q, dtype=torch.float32)
        row = DeferredRow(None, 0, len(tokens) + extra, ids)
        if kind == "tree":
            row.parents = torch.tensor(list(parents) + [-1] * extra)
            row.live = torch.tensor([True] * len(tokens) + [False] * extra)
            row.sees = ancestry(row.parents[None], len(tokens))[0]  # (a tree: its ancestry on the device)
        else:
            row.probs = qt
        drafts.append(Draft([], deferred=row))
        qs.append(qt if kind == "chain" else None)
        hosts.append(Draft(list(tokens), parents=list(parents)))
    batch = SampledBatch(torch.tensor(np.concatenate(rows), dtype=torch.float32), None, None, drafts, qs,
                         [gen] * len(order))
    arrays = to_host(*batch.tensors)
    for d, host in zip(drafts, hosts):  # what the engine's read does to them (deferred_verify.read_verdict)
        d.tokens, d.parents, d.deferred = host.tokens, host.parents, None
    outcomes = [(tuple(path), emitted[-1]) for emitted, path in batch.finish(arrays)]
    for i, case in enumerate(cases):
        exact = law(rule_blocks(_draw(case)))
        result = stat_utils.chi_square_test([o for o, c in zip(outcomes, order) if c == i], exact)
        print(f"{case[0]} (deferred): {len(exact)} outcomes; {result}")
        assert result.impossible == 0 and result.p_value > LAW_ALPHA, (case[0], result)
