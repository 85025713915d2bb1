"""Speculative sampling at temperature > 0 is lossless: emitted tokens follow the target's
processed (temperature / top-k / top-p) distribution, whatever the proposer drafts.

(a) the rejection rule alone (rayspec.sampling.rejection's SampledBatch: each check's trials are one
    batch of sequences) on hand-made distributions:
    each emitted token's frequencies against the row it must follow, by Pearson's chi-square test
    at ALPHA_RULE (`assert_follows`). Power, stated per check (`detected_tv`, printed): a bias of
    the proportional shape (every probability moved in proportion: the least chi-square for its
    total variation, so the figure holds for any shape the pooling does not hide) is detected with
    probability 0.99 from TV sqrt(lambda / 4 n), lambda the noncentrality that test needs: 0.020-0.025
    at the 20,000-30,000 draws of the first-token checks, ~0.035 at the forged-q checks' 10,000, up to
    0.05 for the tokens after an accepted draft (a few thousand draws). The rule's whole outcome law, with
    power 0.99 at TV 0.02 for every case: tests/unit/test_rule_law.py.
(b) end to end through LLMEngine on a 16-token model, against exact marginals computed
    from the target alone with Hugging Face transformers (tests/marginals.py; power: SHIFT there).
"""

from __future__ import annotations

import pytest
import torch

import stat_utils
from engine_utils import binomial_interval, make_engine
from rayspec.proposers.base import Draft
from rayspec.device_io import to_host
from rayspec.sampling.rejection import SampledBatch, verify, verify_greedy, verify_sampled, verify_tree_sampled
from rayspec.sampling.sampler import SamplingParams

V = 7
ALPHA_RULE = 1e-4  # per chi-square check of part (a)


def detected_tv(row, n: int, alpha: float = ALPHA_RULE, power: float = 0.99) -> float:
    """The TV of a proportional bias (|q - p| = eps p) that Pearson's test of n draws against `row`
    rejects with `power`: its noncentrality is n eps^2 = 4 n TV^2, solved for the one `power` needs."""
    probs = {t: float(v) for t, v in enumerate(row) if v > 0}
    df = stat_utils.Bins(probs, n).num_bins - 1
    crit = stat_utils.chi2_isf(alpha, df)
    low, high = 0.0, 10.0 * n
    for _ in range(60):
        mid = (low + high) / 2
        low, high = (mid, high) if stat_utils.ncx2_sf(crit, df, mid) < power else (low, mid)
    return (high / (4 * n)) ** 0.5


def assert_follows(samples: list[int], row, label) -> None:
    """The samples (token ids) follow `row` [V]: no token outside its support, and Pearson's test
    at ALPHA_RULE passes (its power: detected_tv)."""
    probs = {t: float(v) for t, v in enumerate(row) if v > 0}
    if len(probs) == 1:  # a point mass: every sample is its token
        assert set(samples) == set(probs), (label, set(samples))
        return
    result = stat_utils.chi_square_test(samples, probs)
    print(f"{label}: {result}; a proportional bias detected with power 0.99 from TV "
          f"{detected_tv(row, len(samples)):.3f}")
    assert result.impossible == 0 and result.p_value > ALPHA_RULE, (label, result)


def run_chains(target: torch.Tensor, drafts: list[list[int]], draft_probs, gen) -> list[list[int]]:
    """The emitted tokens of one chain per entry of `drafts` (each over the rows `target` [k + 1, V],
    with q `draft_probs`), all verified in one batch by the engine's rule (`SampledBatch`)."""
    rows = target.repeat(len(drafts), 1)
    batch = SampledBatch(rows, None, None, [Draft(list(d)) for d in drafts], [draft_probs] * len(drafts), [gen] * len(drafts))
    return [emitted for emitted, _ in batch.finish(to_host(*batch.tensors))]


def _dist(*weights) -> torch.Tensor:
    w = torch.tensor(weights, dtype=torch.float32)
    return w / w.sum()


P0 = _dist(0.30, 0.05, 0.20, 0.0, 0.15, 0.10, 0.20)
P1 = _dist(0.05, 0.40, 0.0, 0.25, 0.10, 0.10, 0.10)
P2 = _dist(0.14, 0.14, 0.14, 0.14, 0.14, 0.15, 0.15)
Q0 = _dist(0.05, 0.40, 0.20, 0.10, 0.05, 0.0, 0.20)  # puts mass where P0 has none (token 3)
Q1 = _dist(0.30, 0.10, 0.30, 0.0, 0.10, 0.10, 0.10)
ONE_HOT_1 = _dist(0, 1, 0, 0, 0, 0, 0)

# (id, target rows [k+1, V], draft rows [k, V] or None, fixed point-mass drafts)
RULE_CASES = [
    ("draft-probs", torch.stack([P0, P1, P2]), torch.stack([Q0, Q1]), None),
    ("draft-equals-target", torch.stack([P0, P1, P2]), torch.stack([P0, P1]), None),
    ("point-mass-likely", torch.stack([P0, P1, P2]), None, [0, 1]),
    ("point-mass-impossible", torch.stack([P0, P1, P2]), None, [3, 2]),  # p(draft) = 0: always rejected
    ("point-mass-certain", torch.stack([ONE_HOT_1, P1]), None, [1]),  # always accepted, then bonus ~ P1
    ("no-draft", torch.stack([P0]), None, []),
]


@pytest.mark.parametrize("name,target,draft_probs,fixed", RULE_CASES, ids=[c[0] for c in RULE_CASES])
def test_verify_sampled_first_token_follows_target(name, target, draft_probs, fixed):
    trials = 20_000
    gen = torch.Generator().manual_seed(1234)
    k = target.shape[0] - 1
    if draft_probs is not None:  # drafts really sampled from the draft distribution
        all_drafts = torch.stack([torch.multinomial(draft_probs[j], trials, replacement=True, generator=gen)
                                  for j in range(k)], dim=1).tolist()
    firsts, seconds, accepted, lengths = [], [], 0, []
    every = [all_drafts[t] if draft_probs is not None else fixed for t in range(trials)]
    one = verify_sampled(target, every[0], draft_probs, gen)  # (the one-sequence form: the same rule)
    assert one[:-1] == list(every[0][:len(one) - 1])
    for drafts, out in zip(every, run_chains(target, every, draft_probs, gen)):
        assert 1 <= len(out) <= k + 1 and out[:-1] == list(drafts[:len(out) - 1])
        lengths.append(len(out))
        firsts.append(out[0])
        if k >= 1 and out[0] == drafts[0]:
            accepted += 1
            if len(out) > 1:
                seconds.append(out[1])  # the target row 1 is conditioned on drafts[0]
    assert_follows(firsts, target[0], name)
    if k >= 1 and len(seconds) > 2000:  # enough accepted first drafts to look at the next token
        assert_follows(seconds, target[1], f"{name}, the token after an accepted first draft")
    if name == "draft-equals-target":
        assert all(n == k + 1 for n in lengths)  # p == q: nothing is ever rejected
    if name == "point-mass-impossible":
        assert accepted == 0
    if name == "point-mass-certain":
        assert all(n == 2 for n in lengths)


def test_verify_sampled_acceptance_rate_is_min_p_over_q():
    """The acceptance probability of the first draft is sum_x min(p(x), q(x)): the frequency lies in
    the interval it leaves with probability 1e-4 (engine_utils.binomial_interval, Chernoff), +-0.013
    here; an acceptance off by twice that is caught with probability > 0.99."""
    trials = 20_000
    gen = torch.Generator().manual_seed(7)
    target, draft = torch.stack([P0, P1]), Q0[None]
    drafts = torch.multinomial(Q0, trials, replacement=True, generator=gen).tolist()
    accepted = sum(len(out) == 2 for out in run_chains(target, [[d] for d in drafts], draft, gen))
    expected = float(torch.minimum(P0, Q0).sum())
    low, high = binomial_interval(expected, trials)
    assert low <= accepted / trials <= high, (accepted / trials, expected, (low, high))


def _forged(row: torch.Tensor, **at) -> torch.Tensor:
    """row with the given entries overwritten ({"t3": -0.5}: token 3 set to -0.5), then as [1, V]."""
    row = row.clone()
    for key, value in at.items():
        row[int(key[1:])] = value
    return row[None]


# A proposer that chooses the drafted token and then sends a q it did not sample from: q(x) = 0
# (accepted whenever p(x) > 0), negative or NaN (accepted even where p(x) = 0: outside top-k/top-p),
# and rows that do not sum to 1. The verifier must ignore such a q
# and verify the token as a point mass: the first token then still follows the target.
FORGED_Q = [
    ("q-zero-at-draft", 1, _forged(Q0, t1=0.0) / _forged(Q0, t1=0.0).sum()),  # P0(1) = 0.05
    ("q-negative", 3, _forged(Q0, t3=-0.5, t1=0.9)),  # P0(3) = 0: never a possible token
    ("q-nan", 3, _forged(Q0, t3=float("nan"))),
    ("q-inf", 3, _forged(Q0, t3=float("inf"))),
    ("q-not-normalised", 1, Q0[None] * 0.5),
]


@pytest.mark.parametrize("name,token,q", FORGED_Q, ids=[c[0] for c in FORGED_Q])
def test_forged_draft_probs_cannot_steer_sampling(name, token, q):
    trials = 10_000
    gen = torch.Generator().manual_seed(5)
    target = torch.stack([P0, P1])
    firsts = [out[0] for out in run_chains(target, [[token]] * trials, q, gen)]
    assert firsts.count(3) == 0, name  # outside the target's support: never emitted
    assert_follows(firsts, P0, name)


# A tree under the last pending token: root children 0 (token 0), 1 (token 2), 2 (token 3: p = 0
# there), and under node 0 the children 3 (token 1) and 4 (token 6).
TREE = Draft(tokens=[0, 2, 3, 1, 6], parents=[-1, -1, -1, 0, 0])
# target rows of the verification row: 2 pending tokens, then the 5 nodes
TREE_ROWS = torch.stack([P2, P0, P1, P2, P2, P0, P1])


def test_verify_tree_sampled_follows_target():
    """Multi-round rejection over siblings: the first token ~ the root row, and the token after an
    accepted node ~ that node's row, whichever sibling got accepted."""
    trials = 30_000
    gen = torch.Generator().manual_seed(99)
    firsts, after = [], {0: [], 2: []}
    rows = TREE_ROWS[1:]  # the last pending token's row, then the nodes'
    batch = SampledBatch(rows.repeat(trials, 1), None, None, [TREE] * trials, [None] * trials, [gen] * trials)
    assert len(verify_tree_sampled(lambda r: TREE_ROWS[r], 2, TREE, gen)[0]) >= 1  # (the one-sequence form)
    for out, path in batch.finish(to_host(*batch.tensors)):
        assert len(out) == len(path) + 1 and [TREE.tokens[j] for j in path] == out[:-1]
        assert all(TREE.parents[b] == a for a, b in zip([-1] + path, path))  # a path down the tree
        firsts.append(out[0])
        if path and out[0] in after:
            after[out[0]].append(out[1])
    assert 3 not in firsts  # p = 0 at the root for token 3
    assert_follows(firsts, P0, "the first token")
    # after token 0 (node 0: its children are drafts too) the next token follows node 0's row;
    # after token 2 (node 1, a leaf) the bonus token follows node 1's row
    for token, row in ((0, TREE_ROWS[2 + 0]), (2, TREE_ROWS[2 + 1])):
        assert_follows(after[token], row, f"after token {token}")


@pytest.mark.parametrize("argmax,drafts,expected", [
    ([[4, 5, 6]], [[4, 5]], [[4, 5, 6]]),  # all accepted + bonus
    ([[4, 5, 6]], [[4, 9]], [[4, 5]]),  # second rejected: recovered = target argmax
    ([[4, 5, 6]], [[9, 5]], [[4]]),  # first rejected
    ([[4, 5, 6]], [[]], [[4]]),  # no drafts
    ([[1, 2, 3], [7, 8, 9]], [[1, 2], [7]], [[1, 2, 3], [7, 8]]),  # rows of different draft lengths
])
def test_verify_greedy(argmax, drafts, expected):
    assert verify_greedy(torch.tensor(argmax), drafts) == expected



def test_verify_takes_a_batch_of_chains_and_trees_greedy_and_sampled():
    """rayspec.sampling.rejection.verify over one packed batch: (emitted tokens, kept rows) per sequence, each
    row's rule picked by its draft (chain or tree) and its params (greedy or sampled). The sampled
    rows are one-hot, so their verdicts are certain."""
    greedy, sampled = SamplingParams(temperature=0.0), SamplingParams(temperature=1.0)
    one_hot = lambda t: torch.nn.functional.one_hot(torch.tensor(t), V).float().log()  # noqa: E731
    tree = Draft([5, 4, 6], parents=[-1, -1, 1])  # two siblings at the root, a child under the second
    seqs = [  # (pending tokens, draft, params, the target's choice after each row)
        ([1], Draft([4, 5]), greedy, [4, 3, 6]),  # chain: 4 accepted, 5 rejected, 3 recovered
        ([1, 2], tree, greedy, [0, 4, 0, 6, 3]),  # tree: node 1 (4), then its child node 2 (6), then bonus 3
        ([3], Draft([2, 1]), sampled, [2, 1, 0]),  # sampled chain (point mass): both accepted, bonus 0
        ([3], tree, sampled, [5, 0, 0, 0]),  # sampled tree: the first sibling (5) accepted, a leaf: bonus 0
        ([6], Draft([]), greedy, [2]),  # no draft: the target's token
    ]
    choices = [c for *_, c in seqs]
    logits = torch.cat([one_hot(c) for c in choices])  # [N, V]
    lengths = [len(c) for c in choices]
    starts = [sum(lengths[:i]) for i in range(len(seqs))]
    argmax = [t for c in choices for t in c]
    gen = torch.Generator().manual_seed(0)
    emitted, kept = verify(logits, argmax, starts, [len(p) for p, *_ in seqs], [d for _, d, _, _ in seqs],
                           [p for *_, p, _ in seqs], [gen] * len(seqs))
    assert emitted == [[4, 3], [4, 6, 3], [2, 1, 0], [5, 0], [2]]
    assert kept == [[0, 1], [0, 1, 3, 4], [0, 1, 2], [0, 1], [0]]


# ---- end to end on a 16-token model ------------------------------------------------------

from marginals import (ALPHA, NUM_REQUESTS, PENALIZED, PROMPT, SHIFT, TEMPERATURE, TOP_K, TOP_P, VOCAB,
                       assert_marginals, marginals, shifted)


@pytest.fixture(scope="module")
def v16_dirs(tmp_path_factory):
    from conftest import make_tiny_model_dir

    root = tmp_path_factory.mktemp("v16")
    target = make_tiny_model_dir(root / "target", seed=11, vocab_size=VOCAB, with_tokenizer=False)
    draft = make_tiny_model_dir(root / "draft", seed=12, num_layers=1, vocab_size=VOCAB, with_tokenizer=False)
    return target, draft


@pytest.fixture(scope="module")
def exact_marginals(v16_dirs):
    return marginals(v16_dirs[0], None)


@pytest.fixture(scope="module")
def exact_penalized_marginals(v16_dirs):
    return marginals(v16_dirs[0], PENALIZED)


# (id, speculative config): both draft flavours, point masses (ngram) and sampled drafts with probs.
# adaptive=False but in the -costaware case: these runs must verify drafts (asserted below), and at
# batch 64 the planner on the tests' modelled costs (make_engine's default) made none; the -costaware
# case runs the planner on costs where drafts pay.
E2E_METHODS = [
    ("none", dict(method="none")),
    ("ngram", dict(method="ngram", k=3, prompt_lookup_min=1, prompt_lookup_max=3, adaptive=False)),
    ("draft_model", dict(method="draft_model", k=3, adaptive=False)),
    # asynchronous drafting (rayspec.proposers.pre_draft): drafts from the speculation cache
    ("draft_model-async", dict(method="draft_model", k=3, adaptive=False)),
    # cost-aware drafting (rayspec.engine.drafting) under modelled costs: each request's budget (0 to 3)
    # follows its own acceptance from step to step (rows cheap enough that drafts pay in a batch of 64)
    ("draft_model-costaware", dict(method="draft_model", k=3, adaptive=True,
                                   draft_costs={"step_s": 0.010, "row_s": 0.00002, "propose_s": 0.0002,
                                                "propose_depth_s": 0.00005})),
]


# Plain sampling under ngram and draft_model drafts is checked with more power, on whole
# continuations, in test_lossless_sampled.py; here the target-only sampler and penalties.
E2E_CASES = [(name, spec, penalized) for name, spec in E2E_METHODS for penalized in (False, True)
             if penalized or name in ("none", "draft_model-async", "draft_model-costaware")]


@pytest.mark.parametrize("name,spec,penalized", E2E_CASES,
                         ids=[f"{n}-{'penalties' if pen else 'plain'}" for n, _, pen in E2E_CASES])
def test_engine_sampling_matches_target_marginals(v16_dirs, exact_marginals, exact_penalized_marginals, name, spec,
                                                  penalized):
    """With penalties and logit bias too: each verification row processed in its path's context.
    Power (tests/marginals.py): a two-token shift of TV 0.05 at a position is caught with probability
    >= 0.99 (test_marginal_check_has_power); a proportional bias from TV 0.07."""
    if penalized:
        exact_marginals = exact_penalized_marginals
    target_dir, draft_dir = v16_dirs
    spec = dict(spec)
    if spec["method"] == "draft_model":
        spec["draft_model"] = str(draft_dir)
    # target-only: seeded requests (coupled draws, rayspec.sampling.sampler); speculative: unseeded ones on a
    # seeded engine (their own streams, reproducible), which go through rejection sampling
    seeded = spec["method"] == "none"
    engine = make_engine(target_dir, max_model_len=40, max_num_seqs=64, engine_seed=None if seeded else 4321, **spec)
    if name.endswith("-async"):
        from rayspec.proposers.pre_draft import PreDraftingProposer

        engine.proposer = PreDraftingProposer(engine.proposer, 4, max_model_len=40)  # every hypothesis drafted
    assert engine.tokenizer is None
    budgets, propose = [], engine.proposer.propose

    def recording(requests):
        budgets.extend(r.num_tokens for r in requests)
        return propose(requests)

    engine.proposer.propose = recording
    params = [SamplingParams(temperature=TEMPERATURE, top_k=TOP_K, top_p=TOP_P, max_tokens=5,
                             ignore_eos=True, seed=i if seeded else None, **(PENALIZED if penalized else {}))
              for i in range(NUM_REQUESTS)]
    outs = engine.generate([PROMPT] * NUM_REQUESTS, params)
    assert all(len(o.token_ids) == 5 and o.finish_reason == "length" for o in outs)
    assert_marginals(outs, exact_marginals, name)
    repeats = sum(o.token_ids[1] == o.token_ids[2] for o in outs) / NUM_REQUESTS
    low, high = binomial_interval(exact_marginals[3], NUM_REQUESTS)
    assert low <= repeats <= high, f"{name}: P(token 3 == token 2) {repeats:.4f}, exact {exact_marginals[3]:.4f}"
    stats = engine.stats
    if name.endswith("-costaware"):  # the budgets did vary
        assert len(set(budgets) - {0}) >= 2 and budgets.count(3) < len(budgets), sorted(set(budgets))
    if name.endswith("-async"):
        cache = engine.proposer.pre_drafter.stats
        assert cache.num_hits > 0, cache.as_dict()  # (5 tokens a request: most calls are a sequence's first)
    if spec["method"] == "none":
        assert stats.num_draft_tokens == 0
    else:
        # tokens 2 and 3 went through verification; both outcomes happened many times (the cost-aware
        # engine drafts less once its estimates are calibrated against the few accepted: ~2,100 drafts)
        assert stats.num_drafts >= NUM_REQUESTS // 2
        assert 0.05 * stats.num_draft_tokens < stats.num_accepted_tokens < 0.95 * stats.num_draft_tokens, \
            stats.as_dict()


def test_marginal_check_has_power(exact_marginals, exact_penalized_marginals):
    """The check above (marginals.assert_marginals) rejects a shift of SHIFT = 0.05 TV between a
    position's two likeliest tokens with probability >= 0.99 at NUM_REQUESTS samples, at every
    position, plain and penalized (noncentral chi-square); and on a seeded draw of samples so
    shifted at position 1 it does fail, while the same number drawn from the exact marginals passes."""
    import stat_utils

    for marginals_ in (exact_marginals, exact_penalized_marginals):
        for pos in range(3):
            exact = {t: float(v) for t, v in enumerate(marginals_[pos]) if v > 0}
            assert stat_utils.power(exact, shifted(marginals_[pos], SHIFT), NUM_REQUESTS, ALPHA) >= 0.99, pos
    gen = torch.Generator().manual_seed(5)

    class Out:  # a RequestOutput's token_ids, all three positions drawn independently
        def __init__(self, token_ids):
            self.token_ids = token_ids

    def draw(rows):  # [3, VOCAB] -> NUM_REQUESTS outputs
        return [Out(t) for t in torch.multinomial(rows, NUM_REQUESTS, replacement=True, generator=gen).T.tolist()]

    exact = torch.stack([m.float() for m in exact_penalized_marginals[:3]])
    assert_marginals(draw(exact), exact_penalized_marginals, "exact draws")
    biased = exact.clone()
    biased[0] = torch.tensor([shifted(exact_penalized_marginals[0], SHIFT).get(t, 0.0) for t in range(VOCAB)])
    with pytest.raises(AssertionError, match="token 1"):
        assert_marginals(draw(biased), exact_penalized_marginals, "shifted draws")
