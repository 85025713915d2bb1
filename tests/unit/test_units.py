"""Unit tests: n-gram lookup, the logits -> probabilities transform, cost-aware drafting,
and the speculation counters."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch

from rayspec.config import SpeculativeConfig
from rayspec.engine.drafting import (DepthCounts, DraftPlanner, MeasuredCosts, ModelledCosts, PlanInput, SeqDraftState,
                                     expected_accepted)
from rayspec.engine.metrics import SpecDecodeStats
from rayspec.proposers import PROPOSERS, build_proposer
from rayspec.proposers.base import ProposeRequest
from rayspec.proposers.ngram import NgramProposer, find_ngram_continuation
from rayspec.sampling.sampler import (coupled_key, coupled_noise, coupled_sample, draw_rows, logits_to_probs, make_generator,
                                      probs_of_rows, sample, sample_rows)

# ---- n-gram lookup ------------------------------------------------------------------------


@pytest.mark.parametrize("tokens,min_n,max_n,k,expected", [
    ([1, 2, 3, 4, 1, 2], 1, 3, 3, [3, 4, 1]),  # suffix [1, 2] seen at the start
    ([1, 2, 9, 1, 2, 7, 1, 2], 1, 2, 2, [7, 1]),  # the most recent earlier match wins
    ([7, 1, 2, 8, 9, 1, 2, 5, 7, 1, 2], 1, 3, 2, [8, 9]),  # the longest n wins over a later shorter match
    ([7, 1, 2, 8, 9, 1, 2, 5, 7, 1, 2], 1, 2, 2, [5, 7]),  # ... unless max_n forbids it
    ([1, 2, 3, 1, 2], 2, 3, 5, [3, 1, 2]),  # fewer than k tokens follow the match
    ([1, 2, 3, 4, 5], 1, 3, 3, []),  # nothing repeats
    ([1, 2, 3, 9, 3], 2, 3, 3, []),  # only a 1-gram repeats, below min_n
    ([1, 2, 3, 9, 3], 1, 3, 3, [9, 3]),  # ... which min_n = 1 accepts
    ([4, 4, 4], 1, 3, 2, [4]),  # overlapping match; the suffix never matches itself
    ([5], 1, 3, 3, []),
    ([6, 6], 1, 1, 4, [6]),
])
def test_find_ngram_continuation(tokens, min_n, max_n, k, expected):
    assert find_ngram_continuation(np.array(tokens, dtype=np.int64), min_n, max_n, k) == expected


def test_ngram_proposer_batch_and_limits():
    prop = NgramProposer(prompt_lookup_min=1, prompt_lookup_max=3)
    drafts = prop.propose([
        ProposeRequest("a", [1, 2, 3, 1, 2], num_tokens=2),
        ProposeRequest("b", [1, 2, 3, 1, 2], num_tokens=0),
        ProposeRequest("c", [8, 9], num_tokens=4),
    ])
    assert [d.tokens for d in drafts] == [[3, 1], [], []]
    assert all(d.probs is None for d in drafts)  # point masses
    with pytest.raises(ValueError):
        NgramProposer(prompt_lookup_min=0)
    with pytest.raises(ValueError):
        NgramProposer(prompt_lookup_min=3, prompt_lookup_max=2)


def test_proposer_registry():
    from rayspec.methods import FEATURE_METHODS, METHODS
    from rayspec.proposers.eagle import EagleProposer

    assert {"none", "ngram", "draft_model", "eagle3", "eagle"} <= set(PROPOSERS)
    # the table of names (checked without torch) and the classes agree
    assert list(PROPOSERS) == list(METHODS) and all(cls.name == method for method, cls in PROPOSERS.items())
    assert FEATURE_METHODS == {m for m, cls in PROPOSERS.items() if issubclass(cls, EagleProposer)}
    with pytest.raises(ValueError, match="unknown speculative method"):
        from rayspec.config import SpeculativeConfig

        build_proposer(SpeculativeConfig(method="medusa"), context=None)


# ---- logits_to_probs ----------------------------------------------------------------------

PROBS = torch.tensor([[0.1, 0.4, 0.05, 0.3, 0.15]])  # sorted: 1 (.4), 3 (.3), 4 (.15), 0 (.1), 2 (.05)
LOGITS = PROBS.log()


def _renorm(mask_keep: list[int]) -> torch.Tensor:
    out = torch.zeros_like(PROBS)
    out[0, mask_keep] = PROBS[0, mask_keep]
    return out / out.sum()


@pytest.mark.parametrize("top_k,top_p,keep", [
    (0, 1.0, [0, 1, 2, 3, 4]),  # nothing filtered
    (-1, 1.0, [0, 1, 2, 3, 4]),
    (5, 1.0, [0, 1, 2, 3, 4]),
    (9, 1.0, [0, 1, 2, 3, 4]),  # k above the vocabulary
    (1, 1.0, [1]),
    (2, 1.0, [1, 3]),
    (3, 1.0, [1, 3, 4]),
    (0, 0.3, [1]),  # the top token always stays
    (0, 0.6, [1, 3]),  # mass before token 3 is .4 < .6 -> kept; before token 4 .7 >= .6 -> dropped
    (0, 0.75, [1, 3, 4]),
    (0, 0.9, [1, 3, 4, 0]),
    (2, 0.5, [1]),  # top-p applies to the top-k renormalised distribution: [.57, .43]
    (3, 0.9, [1, 3, 4]),
])
def test_logits_to_probs_masks(top_k, top_p, keep):
    got = logits_to_probs(LOGITS, 1.0, top_k, top_p)
    assert torch.allclose(got, _renorm(keep), atol=1e-6)
    assert torch.allclose(got.sum(-1), torch.ones(1))


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_logits_to_probs_temperature(temperature):
    logits = torch.tensor([[1.0, -0.5, 2.0, 0.0], [3.0, 3.0, -1.0, 0.5]])
    assert torch.allclose(logits_to_probs(logits, temperature), (logits / temperature).softmax(-1), atol=1e-6)


def test_logits_to_probs_rows_independent():
    logits = torch.tensor([[1.0, 2.0, 3.0, 4.0], [4.0, 3.0, 2.0, 1.0]])
    got = logits_to_probs(logits, 1.0, top_k=2)
    assert (got[0, :2] == 0).all() and (got[0, 2:] > 0).all()
    assert (got[1, 2:] == 0).all() and (got[1, :2] > 0).all()
    assert torch.allclose(got[0], got[1].flip(0))


# ---- cost-aware drafting (rayspec.engine.drafting) ------------------------------------------------

CPU_LIKE = {"step_s": 0.010, "row_s": 0.0025, "propose_s": 0.001, "propose_depth_s": 0.001}  # a row: 1/4 step
GPU_LIKE = {"step_s": 0.010, "row_s": 0.00002, "propose_s": 0.0002, "propose_depth_s": 0.0002}  # rows ~free


def _seq(state=None, greedy=True, context=100, cap=8, catch_up=0, remaining=0) -> PlanInput:
    return PlanInput(state if state is not None else SeqDraftState(), greedy, context, cap, catch_up, remaining)


def _observed(planner: DraftPlanner, rate: float, n: int = 40, tree: bool = False, depth: int = 4,
              seed: int = 0) -> SeqDraftState:
    """A sequence whose drafts were accepted token by token with probability `rate`."""
    rng = np.random.default_rng(seed)
    state = SeqDraftState()
    for _ in range(n):
        accepted = 0
        while accepted < depth and rng.random() < rate:
            accepted += 1
        planner.observe(state, tree, True, depth, accepted)
    return state


def _step_rate(planner: DraftPlanner, seqs, budgets, tree=False) -> float:
    """The planner's own objective for given budgets (what _climb maximises)."""
    shape = "tree" if tree else "chain"
    tokens = sum(1 + expected_accepted(planner.acceptance.rates(s.state.counts.get(shape), shape, s.greedy, 8),
                                       planner.depth(b, tree)) for s, b in zip(seqs, budgets))
    costs = planner.costs
    cost = costs.verify_s(len(seqs), sum(1 + b for b in budgets), sum((1 + b) * s.context for s, b in zip(seqs, budgets)))
    drafting = [b for b in budgets if b]
    if drafting:
        cost += costs.propose_s(max(planner.proposer_depth(b, tree) for b in drafting), len(drafting))
    return tokens / cost


def _reference_climb(planner: DraftPlanner, seqs, options, values, full, tree):
    """The climb written plainly: every candidate's rate from _step_cost over all sequences."""

    def rate(ch):
        return (sum(1 + v[c] for v, c in zip(values, ch))
                / max(planner._step_cost(seqs, [o[c] for o, c in zip(options, ch)], full, tree), 1e-9))

    choice = [0] * len(seqs)
    best, best_rate = list(choice), rate(choice)
    while True:
        moves = [i for i in range(len(seqs)) if choice[i] + 1 < len(options[i])]
        if not moves:
            return best
        scored = []
        for i in moves:
            choice[i] += 1
            scored.append((rate(choice), -i))
            choice[i] -= 1
        r, neg_i = max(scored)
        choice[-neg_i] += 1
        if r > best_rate * (1 + 1e-9):
            best, best_rate = list(choice), r


@pytest.mark.parametrize("tree", [False, True])
def test_incremental_climb_is_the_plain_climb(tree):
    """_climb keeps the step cost as running sums; on 300 random batches (acceptance, contexts,
    catch-ups, caps, modelled and measured costs) it picks exactly what the plain climb over
    _step_cost picks."""
    rng = np.random.default_rng(7)
    for trial in range(300):
        if trial % 2:
            costs = ModelledCosts({"step_s": 0.01, "multirow_s": float(rng.uniform(0, 0.005)),
                                   "row_s": float(rng.uniform(0, 0.003)), "row_context_s": float(rng.uniform(0, 1e-4)),
                                   "propose_s": float(rng.uniform(0, 0.002)), "propose_depth_s": float(rng.uniform(0, 0.002)),
                                   "propose_depth_batch_s": float(rng.uniform(0, 5e-4)),
                                   "propose_catch_up_s": float(rng.uniform(0, 0.05))})
        else:
            costs = MeasuredCosts()
            for _ in range(6):
                b = int(rng.integers(1, 9))
                rows = b + int(rng.integers(0, 20))
                costs.observe_verify(b, rows, rows * 300, 0.01 + 0.002 * rows + float(rng.uniform(0, 0.003)))
                costs.observe_propose(int(rng.integers(1, 5)), b, 0.004 * b, float(rng.uniform(0, 400)))
        planner = DraftPlanner(6, costs, topk=2 if tree else 1, max_depth=4 if tree else None)
        n = int(rng.integers(1, 9))
        seqs = [_seq(_observed(planner, float(rng.uniform(0, 1)), n=5, tree=tree, seed=trial * 10 + i),
                     greedy=bool(rng.integers(0, 2)), context=int(rng.integers(10, 3000)), cap=int(rng.integers(0, 7)),
                     catch_up=int(rng.integers(0, 3000)), remaining=int(rng.integers(0, 500))) for i in range(n)]
        shape = "tree" if tree else "chain"
        options, values = [], []
        for s in seqs:
            allowed = sorted({min(b, s.cap) for b in planner.budgets(tree)})
            rates = planner.acceptance.rates(s.state.counts.get(shape), shape, s.greedy, planner.depth(allowed[-1], tree))
            options.append(allowed)
            values.append([expected_accepted(rates, planner.depth(b, tree)) for b in allowed])
        full = [v[-1] for v in values]
        weights = rng.choice([1.0, 1.0, 0.0, 0.5], size=len(values))  # PlanInput.weight
        worth = [[x * float(w) for x in v] for v, w in zip(values, weights)]
        assert (planner._climb(seqs, options, worth, full, tree)
                == _reference_climb(planner, seqs, options, worth, full, tree)), trial


@pytest.mark.parametrize("rate,costs,want", [
    (0.05, CPU_LIKE, "zero"),  # drafts rejected, rows dear: nothing pays
    (0.05, GPU_LIKE, "zero"),  # ... nor where rows are free: the proposer call still costs
    (0.3, CPU_LIKE, "zero"),  # modest acceptance: on a CPU one row costs more than it returns
    (0.3, GPU_LIKE, "some"),  # the same acceptance where rows are nearly free: drafts pay
    (0.95, CPU_LIKE, "long"),  # high acceptance: long drafts, short of 8 where the 8th row costs more than it returns
    (0.95, GPU_LIKE, "full"),
])
def test_plan_drafts_what_pays(rate, costs, want):
    planner = DraftPlanner(8, ModelledCosts(costs))
    (budget,) = planner.plan([_seq(_observed(planner, rate, depth=8))], tree=False)
    assert {"zero": budget == 0, "some": 0 < budget < 8, "long": 6 <= budget < 8,
            "full": budget == 8}[want], budget


def test_planned_drafts_that_accept_less_than_expected_lower_the_estimates():
    """The planner checks what it expected of its planned drafts against what their verification
    accepted (DraftPlanner.calibration): drafts accepting less than expected scale every later
    estimate down, and the plan drafts less; drafts accepting more never scale it up; probes and
    another shape or sampling kind do not count."""
    costs = {"step_s": 0.010, "row_s": 0.0005, "propose_s": 0.001, "propose_depth_s": 0.0005}
    for accepted_share, want in ((0.3, "lower"), (1.5, "same")):
        planner = DraftPlanner(8, ModelledCosts(costs))
        state = _observed(planner, 0.8, depth=8)
        (before,) = planner.plan([_seq(state)], tree=False)
        assert before > 0 and planner.calibration("chain", True) == 1.0
        expected = expected_accepted(planner.acceptance.rates(state.counts["chain"], "chain", True, before), before)
        for _ in range(30):  # planned, verified: accepted_share of what was expected
            fresh = SeqDraftState(counts={k: DepthCounts(list(v.accepted), list(v.tried)) for k, v in state.counts.items()})
            (b,) = planner.plan([_seq(fresh)], tree=False)
            assert b > 0 and fresh.expected_rates is not None
            planner.observe(fresh, False, True, b, min(b, round(accepted_share * expected)))
        factor = planner.calibration("chain", True)
        assert planner.calibration("tree", True) == 1.0 and planner.calibration("chain", False) == 1.0
        if want == "lower":
            assert factor < 0.8
            # sequences of every acceptance: planned no longer (and some shorter) than unscaled
            states = [_observed(DraftPlanner(8, ModelledCosts(costs)), r, depth=8, seed=3) for r in np.linspace(0.2, 0.9, 15)]
            calibrated = [planner.plan([_seq(st)], tree=False)[0] for st in states]
            planner.calibration = lambda shape, greedy: 1.0  # the same estimates, unscaled
            uncalibrated = [planner.plan([_seq(st)], tree=False)[0] for st in states]
            assert all(c <= u for c, u in zip(calibrated, uncalibrated)) and calibrated != uncalibrated, \
                (calibrated, uncalibrated)
        else:
            assert factor == 1.0
    # a probe's outcome does not count
    planner = DraftPlanner(8, ModelledCosts(costs))
    probe = SeqDraftState(probing=True, expected_rates=[0.9] * 8)
    planner.observe(probe, False, True, 8, 0)
    assert planner.calibration("chain", True) == 1.0 and probe.expected_rates is None


def test_plan_jumps_over_dear_small_drafts():
    """Where verifying any draft at all costs a jump (a CPU's one-row kernels left for matrix-matrix
    ones), a short draft may lose where a long one wins: here half the drafts are wrong from their
    first token and the other half right to the end (repetitive text). The plan skips to the long
    one; with the first token rarely right, to none."""
    jump = {"step_s": 0.010, "multirow_s": 0.006, "row_s": 0.0002, "propose_s": 0.0005, "propose_depth_s": 0.0002}
    planner = DraftPlanner(8, ModelledCosts(jump))
    bimodal = SeqDraftState()
    for i in range(20):
        planner.observe(bimodal, False, True, 8, 8 * (i % 2))
    rates = [_step_rate(planner, [_seq(bimodal)], [b]) for b in range(9)]
    assert rates[1] < rates[0] < rates[8]  # one draft loses, eight win
    assert planner.plan([_seq(bimodal)], tree=False) == [8]
    assert planner.plan([_seq(_observed(planner, 0.15, depth=8, seed=1))], tree=False) == [0]


def _random_batch(planner: DraftPlanner, rng, trial: int, lowest_rate: float, n: int = 3) -> list[PlanInput]:
    """n sequences with acceptance rates drawn from [lowest_rate, 0.95) and contexts from [10, 1500)."""
    return [_seq(_observed(planner, float(r), seed=trial * 10 + i), context=int(c))
            for i, (r, c) in enumerate(zip(rng.uniform(lowest_rate, 0.95, n), rng.integers(10, 1500, n)))]


def test_plan_is_the_best_rate():
    """On batches of sequences with mixed acceptance, the plan is within 1% of the best rate over
    every combination of budgets (the climb is greedy; brute force checks it)."""
    import itertools

    planner = DraftPlanner(4, ModelledCosts({"step_s": 0.01, "row_s": 0.0015, "propose_s": 0.002,
                                             "propose_depth_s": 0.001, "propose_depth_batch_s": 0.0002}))
    rng = np.random.default_rng(1)
    for trial in range(6):
        seqs = _random_batch(planner, rng, trial, lowest_rate=0.1)
        plan = planner.plan(seqs, tree=False)
        best = max(_step_rate(planner, seqs, combo) for combo in itertools.product(range(5), repeat=3))
        assert _step_rate(planner, seqs, plan) >= 0.99 * best, (trial, plan)
    # mixed acceptance in one batch: the likely sequence drafts more than the unlikely one
    good, bad = _seq(_observed(planner, 0.9, seed=5)), _seq(_observed(planner, 0.1, seed=6))
    g, b = planner.plan([good, bad], tree=False)
    assert g > b == 0


def _closed_rate(planner: DraftPlanner, seqs, budgets) -> float:
    """A closed batch's worth per second (DraftPlanner._closed): n x (1 + the least E of the slowest)."""
    gains = [expected_accepted(planner.acceptance.rates(s.state.counts.get("chain"), "chain", s.greedy, 8), b)
             for s, b in zip(seqs, budgets) if s.weight > 0]
    return len(seqs) * (1 + min(gains)) / planner._step_cost(seqs, budgets, [0.0] * len(seqs), False)


def test_a_closed_batch_is_worth_its_least_advancing_slowest():
    """A closed batch ends with its slowest sequences (weight 1; those more than a draft ahead 0), so a
    step is worth n x (1 + the least E among them), not the sum of every sequence's tokens: the plan is
    within 1% of the best such rate over every combination of budgets; a slowest sequence the proposer
    can draft nothing for (capped at 0: no n-gram match) leaves the whole step without drafts, where
    the same batch open drafts for the other two; a sequence ahead drafts nothing."""
    import itertools

    planner = DraftPlanner(4, ModelledCosts({"step_s": 0.01, "multirow_s": 0.002, "row_s": 0.0004,
                                             "propose_s": 0.001, "propose_depth_s": 0.0005}))
    rng = np.random.default_rng(2)
    for trial in range(6):
        seqs = _random_batch(planner, rng, trial, lowest_rate=0.3)
        if trial % 2:
            seqs[trial % 3] = dataclasses.replace(seqs[trial % 3], weight=0.0)
        plan = planner.plan(seqs, tree=False, closed=True)
        best = max(_closed_rate(planner, seqs, combo) for combo in itertools.product(range(5), repeat=3))
        assert _closed_rate(planner, seqs, plan) >= 0.99 * best, (trial, plan)
    likely = [_seq(_observed(planner, 0.9, seed=i)) for i in range(3)]
    assert all(b > 0 for b in planner.plan(likely, tree=False, closed=True))
    unmatched = likely[:2] + [_seq(likely[2].state, cap=0)]
    assert planner.plan(unmatched, tree=False, closed=True) == [0, 0, 0]
    open_plan = planner.plan(unmatched, tree=False)
    assert open_plan[0] > 0 and open_plan[1] > 0 and open_plan[2] == 0
    ahead = planner.plan(likely[:2] + [dataclasses.replace(likely[2], weight=0.0)], tree=False, closed=True)
    assert ahead[0] > 0 and ahead[1] > 0 and ahead[2] == 0


def test_ngram_draftable_is_its_lookup():
    """NgramProposer.draftable: the continuation its lookup finds now (capped at k), 0 without a match;
    the draft then proposed is that lookup's."""
    ngram = NgramProposer(2, 3)
    tokens = [5, 6, 7, 8, 9, 5, 6]  # "5 6" seen before, followed by 7 8 9 5 6
    assert ngram.draftable("a", tokens, 4) == 4 and ngram.draftable("a", tokens, 2) == 2
    assert ngram.propose([ProposeRequest("a", tokens, 3)])[0].tokens == [7, 8, 9]
    assert ngram.draftable("b", [1, 2, 3, 4], 4) == 0  # no earlier match
    assert ngram.draftable("c", [1, 2, 3, 1, 2], 4) == 3  # what follows the match: 3 1 2
    ngram.release("a")
    assert "a" not in ngram._looked_up


def test_tree_budgets_and_zero():
    planner = DraftPlanner(8, ModelledCosts(CPU_LIKE), topk=2, max_depth=4)
    assert planner.budgets(tree=True) == [0, 2, 4, 6, 8]  # whole depths of topk nodes
    assert planner.budgets(tree=False) == list(range(9))
    assert [planner.depth(b, True) for b in (2, 3, 8)] == [1, 2, 4]
    good = _seq(_observed(planner, 0.97, tree=True))
    assert planner.plan([good], tree=True) == [8]
    bad = _seq(_observed(planner, 0.02, tree=True, seed=1))
    assert planner.plan([bad], tree=True) == [0]
    assert planner.plan([_seq(good.state, cap=3)], tree=True) == [3]  # capped (tokens left): at most 3


def test_probe_and_recovery():
    """A sequence left at zero drafts its full budget every probe_every steps (a probe); a probe
    that finds nothing doubles its interval; once drafts are accepted again the plan goes back up."""
    # (pacing alone here; the probe budget: test_probes_cost_at_most_their_share)
    planner = DraftPlanner(4, ModelledCosts(CPU_LIKE), probe_every=5, max_probe_every=20, max_probe_gap=20,
                           probe_share=None)
    state = _observed(planner, 0.0)
    plans = []
    for _ in range(60):
        (n,) = planner.plan([_seq(state)], tree=False)
        plans.append(n)
        if n:
            planner.observe(state, False, True, n, 0)  # the probe's draft rejected
    assert [i for i, n in enumerate(plans) if n] == [4, 14, 34, 54] and set(plans) == {0, 4}
    steps = 0
    while planner.plan([_seq(state)], tree=False)[0] < 4:
        planner.observe(state, False, True, 4, 4)  # whatever was drafted, all of it accepted
        steps += 1
        assert steps < 30, "acceptance returned but drafting did not"
    assert state.probe_every is None  # accepted drafts reset the interval


def test_probes_are_paced_engine_wide():
    """Eight sequences no draft helps: their probes come together, in one step, and the steps
    between probing steps double while probes find nothing (16, 32, ... up to max_probe_gap), so a
    long run spends a few steps in a thousand on probes, not one per sequence every 16-64 steps
    (what per-sequence intervals alone gave). An accepted draft halves the gap."""
    planner = DraftPlanner(4, ModelledCosts(CPU_LIKE), probe_every=16, max_probe_every=64, max_probe_gap=256,
                           probe_share=None)
    states = [_observed(planner, 0.0, seed=i) for i in range(8)]
    probing_steps = []
    for step in range(1200):
        plan = planner.plan([_seq(st) for st in states], tree=False)
        if any(plan):
            assert set(plan) == {4} and step not in probing_steps, (step, plan)  # all of them, together
            probing_steps.append(step)
            for st in states:
                planner.observe(st, False, True, 4, 0)  # every probe rejected
    gaps = [b - a for a, b in zip(probing_steps, probing_steps[1:])]
    assert gaps[:4] == [32, 64, 128, 256] and set(gaps[4:]) == {256}, probing_steps
    # per sequence alone, 8 x (1200 / 64) probes or more; here 8 sequences x 8 probing steps
    assert len(probing_steps) <= 8
    gap = planner.probe_gap
    planner.observe(states[0], False, True, 4, 2)  # a draft accepted somewhere
    assert planner.probe_gap == gap // 2


def _probe_run(share, costs, catch_up=0, steps=1200, num_seqs=8, probe_catch_up=None):
    """num_seqs sequences no draft helps, `steps` steps: (probes (a sequence drafting in a step), the
    planner's estimated seconds of the probing steps' extra cost, of all steps without probes)."""
    planner = DraftPlanner(4, ModelledCosts(costs), probe_share=share)
    states = [_observed(planner, 0.0, seed=i) for i in range(num_seqs)]
    probing, extra, plain = 0, 0.0, 0.0
    for _ in range(steps):
        seqs = [_seq(st, catch_up=catch_up, remaining=10_000) for st in states]
        for s in seqs:
            s.probe_catch_up = probe_catch_up
        plan = planner.plan(seqs, tree=False)
        if probe_catch_up is not None:  # a probe catches up on its window
            seqs = [dataclasses.replace(s, catch_up=probe_catch_up) for s in seqs]
        zero = planner._step_cost(seqs, [0] * num_seqs, [0.0] * num_seqs, False)
        plain += zero
        if any(plan):
            probing += sum(1 for n in plan if n)
            extra += planner._step_cost(seqs, plan, [0.0] * num_seqs, False, spread=False) - zero
            for st, n in zip(states, plan):
                if n:
                    planner.observe(st, False, True, n, 0)  # every probe rejected
    return probing, extra, plain


def test_probes_cost_at_most_their_share():
    """Traffic no draft can guess: the probes' estimated extra cost stays within probe_share (2%) of
    the steps' (one probing step's cost of slack), where pacing alone spends more; and a proposer
    whose probe must first catch up on the whole context (a draft model that skipped the steps in
    between) probes the rarer, the dearer that catch-up."""
    dear_catch_up = {**CPU_LIKE, "propose_catch_up_s": 0.02}  # 1,000 tokens caught up: two steps
    paced = _probe_run(None, dear_catch_up, catch_up=500)
    shared = _probe_run(0.02, dear_catch_up, catch_up=500)
    one_round = shared[1] / max(shared[0], 1)
    assert shared[1] <= 0.02 * shared[2] + one_round, shared
    assert paced[1] > 0.02 * paced[2] and shared[1] < paced[1], (paced, shared)
    cheap = _probe_run(0.02, dear_catch_up, catch_up=0)
    dearer = _probe_run(0.02, dear_catch_up, catch_up=2000)
    assert dearer[0] < shared[0] < cheap[0] and dearer[0] >= 8, (cheap, shared, dearer)


def test_a_probe_window_is_what_a_probe_is_charged():
    """A draft model whose probes catch up on at most a window (Proposer.probe_window, 64 tokens)
    of a 2,000-token context: the budget is charged the window's catch-up, so it probes as often as
    a proposer with 64 tokens to catch up on, more than one charged the whole context."""
    costs = {**CPU_LIKE, "propose_catch_up_s": 0.02}
    windowed = _probe_run(0.02, costs, catch_up=2000, probe_catch_up=64)
    assert windowed == _probe_run(0.02, costs, catch_up=64)
    assert windowed[0] > _probe_run(0.02, costs, catch_up=2000)[0]


def test_only_probes_that_catch_up_wait_for_the_budget():
    """A probe with no context to catch up on (n-gram, an EAGLE head) costs at most one multi-row
    step and comes due after probe_every steps at zero, budget or not (a fresh engine's first short
    requests must see one); one that must catch up on 500 tokens first waits until the budget
    (2% of the steps since) covers it."""
    costs = {**CPU_LIKE, "propose_catch_up_s": 0.02}
    first_probe = {}
    for catch_up in (0, 500):
        planner = DraftPlanner(4, ModelledCosts(costs), probe_share=0.02, probe_every=16)
        state = _observed(planner, 0.0)
        for step in range(1, 400):
            if any(planner.plan([_seq(state, catch_up=catch_up, remaining=10_000)], tree=False)):
                first_probe[catch_up] = step
                break
    assert first_probe[0] == 16 and first_probe[500] > 50, first_probe


def test_a_probe_dearer_than_the_bank_still_comes():
    """A probe whose estimated catch-up costs more than the budget ever banks (max_probe_gap steps'
    share: here 256 x 2% of a 10 ms step, 51 ms, against 500 tokens at 0.2 ms each) goes once the
    bank is full, and then waits for the bank to refill past what it cost: an estimate too high
    (one outlier timed) is re-measured now and then, never frozen; the probes stay rare."""
    dear = {**CPU_LIKE, "propose_catch_up_s": 0.2}
    probes, extra, plain = _probe_run(0.02, dear, catch_up=500, steps=3000, num_seqs=1)
    assert 2 <= probes <= 3000 // 256, (probes, extra, plain)
    assert extra <= 0.02 * plain + extra / probes, (probes, extra, plain)


def test_a_timing_far_off_the_fit_is_clipped_or_restarts_it():
    """Step times have one-sided noise: a shape's first timing (lazy CUDA kernels, a compile) is
    left out; later, one above OUTLIER x the prediction counts as OUTLIER x it. A proposer timing
    far below a fit seeded by an outlier restarts that fit (the proposer is timed only when it
    drafts: a fit too high would stop the drafts that could correct it); the verification fit,
    timed every step, is only clipped."""
    from rayspec.engine.drafting import OUTLIER

    costs = MeasuredCosts()
    for rows in (1, 2, 5):
        costs.observe_verify(1, rows, rows * 100, 0.010 + 0.001 * rows, warm=True)
    costs.observe_propose(4, 1, 2.0)  # the first of its shape: left out
    assert costs.num_first_seen == 1 and costs.propose.num_observed == 0
    costs.observe_propose(4, 1, 0.300)  # a cold call of a shape seen: the fit's first datum
    assert costs.propose_s(4, 1) == pytest.approx(0.300, rel=0.05)
    costs.observe_propose(4, 1, 0.005)  # the next probe: far below, the fit restarts from it
    assert costs.propose.num_restarts == 1 and costs.propose_s(4, 1) == pytest.approx(0.005, rel=0.05)
    for _ in range(20):
        costs.observe_propose(4, 1, 0.005)
    costs.observe_propose(4, 1, 1.0)  # a preempted call: counts as OUTLIER x the prediction
    assert costs.propose.num_clipped == 1 and costs.propose_s(4, 1) < 0.005 * OUTLIER
    before = costs.verify_s(1, 5, 500)
    costs.observe_verify(1, 5, 500, 1.0)
    assert costs.verify.num_clipped == 1 and costs.verify_s(1, 5, 500) < before * OUTLIER
    costs.observe_verify(1, 5, 500, before / 10)  # far below: the verification fit only moves
    assert costs.verify.num_restarts == 0 and costs.verify_s(1, 5, 500) > before / 10 * 2


def test_steps_without_planning_fill_the_probe_budget():
    """A stretch at disable_by_batch_size (the planner not asked) banks probe budget as planned steps
    do, so the sequences due probe once the batch shrinks; a planner without a budget banks nothing."""
    costs = {**CPU_LIKE, "propose_catch_up_s": 0.02}
    planner = DraftPlanner(4, ModelledCosts(costs), probe_share=0.02, probe_every=4, max_probe_gap=64)
    states = [_observed(planner, 0.0, seed=i) for i in range(4)]
    seqs = [_seq(st, catch_up=300, remaining=10_000) for st in states]
    plain = planner._step_cost(seqs, [0] * 4, [0.0] * 4, False)
    for _ in range(10):
        planner.skip(seqs)
    assert planner.probe_budget == pytest.approx(0.02 * plain * 10)
    for _ in range(200):
        planner.skip(seqs)
    assert planner.probe_budget == pytest.approx(0.02 * plain * 64)  # banked up to max_probe_gap steps
    plans = [planner.plan(seqs, tree=False) for _ in range(4)]
    assert plans[:3] == [[0] * 4] * 3 and any(plans[3]), plans  # due after 4 steps at zero: the bank pays
    unbudgeted = DraftPlanner(4, ModelledCosts(costs), probe_share=None)
    unbudgeted.skip(seqs)
    assert unbudgeted.probe_budget == 0.0


def test_a_sequence_worth_nothing_does_not_draft():
    """PlanInput.weight 0 (a closed batch's sequence ahead of the slowest): its drafts, however well
    accepted, add nothing to the step's worth, so it gets none and is not probed; beside it the same
    acceptance at weight 1 drafts."""
    planner = DraftPlanner(4, ModelledCosts(GPU_LIKE))
    ahead, slowest = _observed(planner, 0.9, seed=1), _observed(planner, 0.9, seed=2)
    for _ in range(40):
        plan = planner.plan([_seq(ahead, remaining=10), _seq(slowest, remaining=60)], tree=False)
        plan_weighted = planner.plan([PlanInput(ahead, True, 100, 8, remaining=10, weight=0.0),
                                      PlanInput(slowest, True, 100, 8, remaining=60)], tree=False)
        assert plan[0] >= 3 and plan[1] >= 3 and plan_weighted[0] == 0 and plan_weighted[1] >= 3, (plan, plan_weighted)
    assert ahead.steps_at_zero == 0  # no probe comes due


def test_catch_up_is_spread_over_the_tokens_left():
    """A draft model that has not seen a sequence's 2,000-token context catches up once, then drafts
    from it for the rest of the request: with drafts mostly accepted and many tokens left the
    catch-up pays (spread over the steps left); with a few tokens left it does not."""
    costs = {**CPU_LIKE, "propose_catch_up_s": 0.02}
    planner = DraftPlanner(4, ModelledCosts(costs))
    good = _observed(planner, 0.9)
    assert planner.plan([_seq(good, catch_up=2000, remaining=400)], tree=False)[0] >= 3
    assert planner.plan([_seq(good, catch_up=2000, remaining=6, cap=4)], tree=False) == [0]
    assert planner.plan([_seq(good, catch_up=5, remaining=6, cap=4)], tree=False)[0] >= 3  # caught up: drafts


def test_unmeasured_then_measured_and_sampled_alike():
    """Nothing timed yet: the full budget (so it gets timed); once measured, a losing draft stops,
    greedy or sampled, seeded or not (a seeded request's draws do not depend on its plan:
    rayspec.sampling.sampler), and the pool of sampled chains informs sampled sequences only."""
    planner = DraftPlanner(6, MeasuredCosts())
    bad = _observed(planner, 0.0)
    assert planner.plan([_seq(bad)], tree=False) == [6]  # nothing timed yet: the full budget, to be timed
    planner.costs.observe_verify(1, 1, 100, 0.010, warm=True)  # (synthetic timings: warm)
    planner.costs.observe_verify(1, 2, 200, 0.016, warm=True)
    planner.costs.observe_verify(1, 7, 700, 0.025, warm=True)
    assert planner.plan([_seq(bad), _seq(bad, greedy=False, cap=5)], tree=False) == [0, 0]
    planner = DraftPlanner(4, ModelledCosts(CPU_LIKE))
    new = planner.plan([_seq(greedy=False)], tree=False)[0]
    for _ in range(30):
        planner.observe(SeqDraftState(), False, False, 4, 0)  # the pool of sampled chains: all rejected
    assert new > 0 and planner.plan([_seq(greedy=False)], tree=False) == [0]
    assert planner.plan([_seq(greedy=True)], tree=False)[0] == new  # the greedy pool is another


def test_acceptance_counts_by_depth():
    planner = DraftPlanner(4, ModelledCosts(CPU_LIKE))
    state = SeqDraftState()
    planner.observe(state, False, True, 4, 2)  # depths 1, 2 accepted, 3 rejected, 4 unseen
    counts = state.counts["chain"]
    assert counts.accepted == [1, 1, 0, 0] and counts.tried == [1, 1, 1, 0]
    # the sequence's estimate leans on the pool of the same shape and kind, not on other kinds
    rates = planner.acceptance.rates(counts, "chain", True, 4)
    assert rates[0] > 0.5 > rates[2] and rates[3] == 0.5  # depth 4 unseen: the prior
    assert planner.acceptance.rates(None, "chain", False, 2) == [0.5, 0.5]  # sampled: nothing seen yet
    assert math.isclose(expected_accepted([0.5, 0.5, 1.0], 3), 0.5 + 0.25 + 0.25)
    assert expected_accepted([0.9, 0.9], 0) == 0


def test_measured_costs_fit_and_modelled_validation():
    """The online fit recovers a linear cost from noisy host timings; modelled costs are checked."""
    costs = MeasuredCosts()
    assert costs.propose_s(4, 1) == 0.0 and not costs.known  # optimistic until the proposer is timed
    rng = np.random.default_rng(0)
    for _ in range(200):  # batch 4; the first draft row costs 5 ms more (the CPU's matrix-matrix kernels)
        rows, ctx = int(rng.integers(4, 40)), int(rng.integers(10, 2000))
        costs.observe_verify(4, rows, rows * ctx, 0.008 + 0.005 * (rows > 4) + 0.001 * rows
                             + 0.0004 * rows * ctx / 1000 + rng.normal(0, 0.0003))
        depth, batch = int(rng.integers(1, 6)), int(rng.integers(1, 8))
        costs.observe_propose(depth, batch, 0.001 + 0.0005 * depth + 0.0001 * depth * batch)
    assert costs.verify_s(4, 9, 9 * 500) == pytest.approx(0.008 + 0.005 + 0.009 + 0.0004 * 4.5, rel=0.05)
    assert costs.verify_s(4, 4, 4 * 500) == pytest.approx(0.008 + 0.004 + 0.0004 * 2, rel=0.05)
    assert costs.propose_s(4, 2) == pytest.approx(0.001 + 0.002 + 0.0008, rel=0.05)
    with pytest.raises(ValueError, match="unknown keys"):
        SpeculativeConfig(method="ngram", draft_costs={"step_s": 0.01, "rows": 1})
    with pytest.raises(ValueError, match="step_s"):
        SpeculativeConfig(method="ngram", draft_costs={"row_s": 0.01})


def test_spec_decode_stats():
    stats = SpecDecodeStats()
    stats.observe(0, 0)  # a step without drafts is not counted
    stats.observe(4, 2)
    stats.observe(2, 2)
    assert stats.as_dict() == {"num_drafts": 2, "num_draft_tokens": 6, "num_accepted_tokens": 4,
                               "num_accepted_tokens_per_pos": [2, 2, 0, 0],
                               "acceptance_rate": 4 / 6, "mean_acceptance_length": 3.0, "propose_seconds": 0.0}


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="oneDNN is the CPU fast path")
def test_packed_and_fused_projections_match_the_plain_layers():
    """pack_for_cpu's oneDNN copies (q/k/v and gate/up fused) compute what the plain layers do, and
    step aside once a weight changes (training in place) or gradients are on."""
    from rayspec.model.families import ModelArgs
    from rayspec.model.native import MLP, Attention

    torch.manual_seed(0)
    args = ModelArgs(vocab_size=50, hidden_size=64, intermediate_size=96, num_layers=1, num_heads=4,
                     num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6, tie_word_embeddings=False)
    attn, mlp = Attention(args), MLP(args)
    for rows in (1, 9):
        x = torch.randn(2, rows, 64)
        with torch.no_grad():
            plain = [attn.q_proj(x), attn.k_proj(x), attn.v_proj(x), mlp(x)]
            for m in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj):
                m.pack_for_cpu()
            attn.fuse_for_cpu()
            mlp.fuse_for_cpu()
            q, k, v = attn.qkv(x)
            assert [t.shape for t in (q, k, v)] == [(2, rows, 64), (2, rows, 32), (2, rows, 32)]
            for got, want in zip([q, k, v, mlp(x)], plain):
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
            assert mlp.gate_up(x) is not None
    with torch.no_grad():
        mlp.up_proj.weight.mul_(2)  # an in-place update: the fused copy is stale now
        assert mlp.gate_up(x) is None
        want = mlp.down_proj(torch.nn.functional.silu(x @ mlp.gate_proj.weight.T) * (x @ mlp.up_proj.weight.T))
        torch.testing.assert_close(mlp(x), want, rtol=1e-5, atol=1e-5)
    assert attn.qkv(x) is None  # gradients on: the plain layers (autograd) run


def test_prefill_groups_minimise_padded_cost():
    """Prompts are prefilled in the groups that minimise padded tokens plus a per-forward overhead
    (checked against every partition of small random cases)."""
    import itertools
    import random

    from rayspec.model.batch_layout import prefill_groups

    def cost(groups, lengths, overhead):
        return sum(overhead + len(g) * max(lengths[i] for i in g) for g in groups)

    def partitions(items):  # every set partition
        if not items:
            yield []
            return
        first, rest = items[0], items[1:]
        for p in partitions(rest):
            yield [[first]] + p
            for k in range(len(p)):
                yield p[:k] + [[first] + p[k]] + p[k + 1:]

    rng = random.Random(0)
    for _ in range(60):
        lengths = [rng.randint(1, 300) for _ in range(rng.randint(1, 6))]
        overhead = rng.choice([0, 24, 1000])
        groups = prefill_groups(lengths, overhead)
        assert sorted(itertools.chain(*groups)) == list(range(len(lengths)))  # each prompt exactly once
        best = min(cost(p, lengths, overhead) for p in partitions(list(range(len(lengths)))))
        assert cost(groups, lengths, overhead) == best
    assert prefill_groups([49, 52, 60, 243], 24) == [[0, 1, 2], [3]]  # the long prompt goes alone
    assert prefill_groups([100, 90, 80], 1024) == [[2, 1, 0]]  # overhead dominates: one batch


def _sorted_reference(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """Top-k / top-p by sorting the whole vocabulary, the mass before each token summed in float64."""
    logits = logits / temperature
    values, index = logits.sort(dim=-1, descending=True)
    remove = torch.zeros_like(values, dtype=torch.bool)
    if 0 < top_k < logits.shape[-1]:
        remove[:, top_k:] = True
    if top_p < 1.0:
        probs = values.double().masked_fill(remove, float("-inf")).softmax(-1)
        remove |= probs.cumsum(-1) - probs >= top_p
        remove[:, 0] = False
    return torch.empty_like(logits).scatter_(-1, index, values.masked_fill(remove, float("-inf"))).softmax(-1)


@pytest.mark.parametrize("scale", [0.5, 12.0])  # flat (most tokens can stay) to sharp; rows 1 and 2 below vary it
@pytest.mark.parametrize("top_k,top_p", [(0, 0.95), (0, 0.999), (40, 1.0), (40, 0.9), (3000, 0.5)])
@pytest.mark.parametrize("counted", [True, False])  # False: a GPU's path (top-p by bisection, no sort)
def test_logits_to_probs_equals_a_full_sort(scale, top_k, top_p, counted, monkeypatch):
    """Top-k / top-p over the tokens that can stay (torch.topk of those above the floor; on a GPU's
    path a top-p alone by bisection over the logits' order keys) keeps the same tokens as sorting the
    whole (16,384-token) vocabulary, and the same probabilities to float32 rounding; rows of one call
    whose nuclei differ in size each keep their own."""
    from rayspec.sampling import sampler as sampling

    monkeypatch.setattr(sampling, "_count_on_host", lambda device: counted)
    gen = torch.Generator().manual_seed(int(scale * 10) + top_k)
    logits = torch.randn(6, 16384, generator=gen) * scale
    logits[1] *= 0.1  # a flat row: far more of its tokens can stay than of the others
    logits[2, 17] = 60.0  # one token takes all the mass
    for temperature in (0.7, 1.0):
        got = logits_to_probs(logits, temperature, top_k, top_p)
        want = _sorted_reference(logits, temperature, top_k, top_p)
        assert torch.equal(got > 0, want > 0), (top_k, top_p, (got > 0).sum(-1), (want > 0).sum(-1))
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-9)
        assert torch.allclose(got.sum(-1), torch.ones(6), atol=1e-4)


@pytest.mark.parametrize("path", ["counted", "bisection", "with top-k"])
def test_top_p_keeps_every_token_tied_at_its_cut(path, monkeypatch):
    """Tokens whose logits equal the last kept one's all stay, on every path (the kept set is a
    threshold on the logit, not an order among equals), as tests/reference.py's processed_probs
    keeps them; a cut between two distinct logits is unchanged. Also rows with -inf (masked) tokens,
    -0.0 beside 0.0, and a top_p so small that only the first token stays."""
    from reference import processed_probs
    from rayspec.sampling import sampler as sampling

    monkeypatch.setattr(sampling, "_count_on_host", lambda device: path != "bisection")
    top_k = 4000 if path == "with top-k" else 0
    logits = torch.full((4, 5000), -9.0)
    logits[:, :4] = torch.tensor([6.0, 3.0, 3.0, 3.0])  # three tied at the cut of rows 0 and 2
    logits[1, :4] = torch.tensor([6.0, 3.0, 2.5, 2.0])  # distinct: the cut falls between 1 and 2
    logits[2, 10:20] = float("-inf")
    logits[3, :4] = torch.tensor([0.0, -0.0, -1.0, -1.0])
    p = torch.softmax(logits.double(), -1)
    # per row: a top_p inside the tied group (rows 0, 2), between tokens 1 and 2 (row 1), between the
    # first token and its -0.0 twin (row 3)
    cuts = [float(p[0, 0] + 0.5 * p[0, 1]), float(p[1, 0] + 0.5 * p[1, 1]), float(p[2, 0] + 0.5 * p[2, 1]),
            float(0.5 * p[3, 0])]
    want_kept = [{0, 1, 2, 3}, {0, 1}, {0, 1, 2, 3}, {0, 1}]
    for r, (top_p, want) in enumerate(zip(cuts, want_kept)):
        got = logits_to_probs(logits[r:r + 1], 1.0, top_k, top_p)
        assert set((got[0] > 0).nonzero().flatten().tolist()) == want, (r, got[0, :5])
        ref = torch.from_numpy(processed_probs(logits[r:r + 1], 1.0, top_k, top_p))
        torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-9)
    only_first = logits_to_probs(logits[1:2], 1.0, top_k, 1e-12)
    assert int((only_first > 0).sum()) == 1


def test_cut_margin_sees_a_tie_at_the_top_p_cut():
    """tests/reference.py's cut_margin: where the mass keeps a token tied (or nearly) with the next, a
    change in the last bits of one logit keeps one token more or fewer, so the margin is that gap (a
    grid cell failed on an exact tie the engine's rounding split, with a margin of 0.007); a cut
    between distinct logits far from top_p keeps its margin."""
    from reference import cut_margin, processed_probs

    tied = np.array([[6.0, 3.0, 3.0, -9.0]])
    p = processed_probs(tied, 1.0, 0, 1.0)[0]
    top_p = float(p[0] + 0.5 * p[1])  # the mass keeps token 1; the tie keeps token 2 too
    assert (processed_probs(tied, 1.0, 0, top_p)[0] > 0).tolist() == [True, True, True, False]
    assert cut_margin(tied, 1.0, 0, top_p)[0] == 0.0
    split = tied + np.array([[0.0, 0.0, -1e-6, 0.0]])  # the same row as another's rounding may give it
    assert (processed_probs(split, 1.0, 0, top_p)[0] > 0).tolist() == [True, True, False, False]
    assert cut_margin(split, 1.0, 0, top_p)[0] < 2e-6
    distinct = np.array([[6.0, 3.0, 1.0, -9.0]])
    assert cut_margin(distinct, 1.0, 0, top_p)[0] > 0.01


def test_sample_draws_in_proportion_and_never_a_zero():
    """sample() over an unnormalized row with zeros (a rejection residual's shape): 20,000 draws fit
    the normalized row (chi-square, alpha 1e-4; a draw from the wrong neighbour of each cut, i.e. an
    off-by-one in the inverse CDF, is rejected at far below it), no zero-mass token is ever drawn, and
    a seeded generator repeats its draws."""
    from stat_utils import chi_square_test

    row = torch.tensor([0.0, 3.0, 0.0, 1.0, 0.5, 0.0, 2.5, 0.0, 1.0, 0.0]) * 0.37
    gen = torch.Generator().manual_seed(11)
    draws = [sample(row, gen) for _ in range(20_000)]
    assert not {i for i in draws if row[i] == 0}
    probs = {i: float(row[i] / row.sum()) for i in range(len(row)) if row[i] > 0}
    assert chi_square_test(draws, probs).p_value > 1e-4
    shifted = {i + 1: p for i, p in probs.items()}  # the off-by-one sampler's distribution
    wrong = chi_square_test(draws, shifted)  # what this check would see of an off-by-one
    assert wrong.impossible or wrong.p_value < 1e-4
    again = torch.Generator().manual_seed(11)
    assert [sample(row, again) for _ in range(50)] == draws[:50]
    one_hot = torch.zeros(49152)
    one_hot[49151] = 1.0  # the last token: the clamp at the row's end is not a way out
    assert sample(one_hot, gen) == 49151


def test_batched_rows_are_the_single_row_probs_and_draws():
    """probs_of_rows / sample_rows (the proposers' sampled drafts, one set of kernels for the batch)
    give each row what logits_to_probs / sample give it alone: the same probabilities under mixed
    settings, the same token from the same seeded generator (a seeded request draws alike in a batch
    or alone), over 100 rounds of fresh generators."""
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(6, 500, generator=gen) * 3
    settings = [(0.7, 0, 0.9), (1.0, 20, 1.0), (0.7, 0, 0.9), (1.3, 0, 1.0), (0.5, 5, 0.8), (0.7, 0, 0.9)]
    probs = probs_of_rows(logits, settings)
    for i, key in enumerate(settings):
        assert torch.equal(probs[i], logits_to_probs(logits[i: i + 1], *key)[0]), key
    draws = []
    for trial in range(100):
        batch = sample_rows(probs, [make_generator(100 * trial + i, "cpu") for i in range(6)])
        assert batch.dtype == torch.long
        alone = [sample(probs[i], make_generator(100 * trial + i, "cpu")) for i in range(6)]
        assert batch.tolist() == alone, trial
        draws += alone
    assert len(set(draws)) > 12  # real draws, not the rows' argmax


def test_coupled_hash_is_splitmix64():
    """The tensor hash wraps its int64 products as the Python reference's 64-bit mask does (a
    platform whose vector multiply saturated, or a shift that kept the sign, would fail here)."""
    from rayspec.sampling.sampler import _GAMMA, _mix64, _mix64_tensor, _signed

    # splitmix64's published stream from seed 0 (Vigna's reference implementation)
    assert [_mix64(i * _GAMMA) for i in (1, 2)] == [0xE220A8397B1DCDAF, 0x6E789E6AA1B965F4]
    rng = np.random.default_rng(0)
    xs = [0, 1, (1 << 63) - 1, 1 << 63, (1 << 64) - 1] + [int(x) for x in rng.integers(0, 2**63, 200)] * 2
    xs[205:] = [x | (1 << 63) for x in xs[205:]]  # high bit set: negative as int64
    got = _mix64_tensor(torch.tensor([_signed(x) for x in xs], dtype=torch.int64)).tolist()
    assert [g & ((1 << 64) - 1) for g in got] == [_mix64(x) for x in xs]
    # the noise is standard exponential: mean 1, variance 1, no value 0 or infinite
    e = coupled_noise([coupled_key(7, t) for t in range(8)], 4096, "cpu")
    assert e.dtype == torch.float64 and torch.isfinite(e).all() and (e > 0).all()
    assert abs(e.mean().item() - 1) < 0.02 and abs(e.var().item() - 1) < 0.05
    # the keys made on the device (a deferred tree's depths are there) are coupled_key's, seeds of every size
    from rayspec.sampling.sampler import coupled_keys_at

    seeds = [0, 7, (1 << 63) - 1, (1 << 64) - 1, 12345678901234567890] + [int(x) for x in rng.integers(0, 2**62, 50)]
    positions = [0, 1, 2**40, 5, 99] + [int(x) for x in rng.integers(0, 2**20, 50)]
    keys = coupled_keys_at(seeds, torch.tensor(positions)).tolist()
    assert [k & ((1 << 64) - 1) for k in keys] == [coupled_key(s, p) for s, p in zip(seeds, positions)]


def test_coupled_draws_follow_the_row_and_are_independent():
    """A coupled draw (argmax p / E) is distributed as p: 20,000 keys (seeds at one position) against
    an 8-token row with two zeros, chi-square at 1e-3 (the keys are fixed: the same verdict every run);
    the same test rejects a row 0.02 in total variation away (its power here), zero-mass tokens never
    come, and two positions of one seed are independent (pairs against p x p)."""
    from stat_utils import chi_square_test

    p = torch.tensor([[0.30, 0.0, 0.22, 0.15, 0.13, 0.0, 0.12, 0.08]], dtype=torch.float32)
    n = 20_000
    draws = coupled_sample(p.expand(n, -1), [coupled_key(seed, 17) for seed in range(n)]).tolist()
    exact = {i: float(p[0, i]) for i in range(8) if p[0, i] > 0}
    fit = chi_square_test(draws, exact)
    assert fit.impossible == 0 and fit.p_value > 1e-3, fit
    shifted = dict(exact)
    shifted[0] -= 0.02
    shifted[7] += 0.02
    assert chi_square_test(draws, shifted).p_value < 1e-3
    nxt = coupled_sample(p.expand(n, -1), [coupled_key(seed, 18) for seed in range(n)]).tolist()
    pairs = chi_square_test(list(zip(draws, nxt)), {(a, b): pa * pb for a, pa in exact.items()
                                                               for b, pb in exact.items()})
    assert pairs.p_value > 1e-3, pairs
    assert sum(a == b for a, b in zip(draws, nxt)) < 0.25 * n  # not the same draw twice


def test_coupled_noise_of_a_draft_vocabulary_is_the_targets():
    """EAGLE-3's reduced draft vocabulary draws with the target's noise at the mapped ids, so a head
    whose q equals the target's p drafts exactly the target's draw; draw_rows mixes coupled rows and
    stream rows as each alone."""
    keys = [coupled_key(3, t) for t in range(5)]
    full = coupled_noise(keys, 300, "cpu")
    ids = torch.tensor([5, 17, 42, 299, 0])
    assert torch.equal(coupled_noise(keys, ids, "cpu"), full[:, ids])
    gen = torch.Generator().manual_seed(1)
    probs = torch.softmax(torch.randn(4, 300, generator=gen), -1)
    sources = [coupled_key(3, 0), make_generator(11, "cpu"), coupled_key(3, 1), make_generator(12, "cpu")]
    mixed = draw_rows(probs, sources).tolist()
    assert mixed[0] == int(coupled_sample(probs[:1], [coupled_key(3, 0)])[0])
    assert mixed[2] == int(coupled_sample(probs[2:3], [coupled_key(3, 1)])[0])
    assert mixed[1] == sample(probs[1], make_generator(11, "cpu"))
    assert mixed[3] == sample(probs[3], make_generator(12, "cpu"))


def test_top_p_below_float32_range_keeps_the_top_token():
    # found by the route fuzz (top_p 5e-324 -> 500): the threshold rounds to 0.0 in float32, which
    # removed every token and made the probabilities NaN
    from rayspec.sampling.sampler import logits_to_probs
    logits = torch.tensor([[0.1, 2.0, -1.0, 0.5], [3.0, 0.0, 0.0, 0.0]])
    for top_p, top_k in ((5e-324, 0), (1e-45, 0), (5e-324, 2)):
        probs = logits_to_probs(logits, 0.7, top_k, top_p)
        assert torch.equal(probs, torch.nn.functional.one_hot(logits.argmax(-1), 4).float())
