"""Cost-aware drafting in the engine (rayspec.engine.drafting): drafts that are rejected stop being made
(plain decode steps, with probes now and then), drafts that are accepted are made in full, and
either way the output is target-only decoding's. The planner's arithmetic is unit-tested in
tests/unit/test_units.py; here tiny models, modelled costs (engine_utils.MODELLED_COSTS)."""

from __future__ import annotations

import pytest

from engine_utils import OracleProposer, cached_model, make_engine, run_to_completion
from rayspec.engine.drafting import MeasuredCosts
from rayspec.sampling.sampler import SamplingParams

PROMPTS = ["The cat sat on the mat. The cat", "Hello, world!", "a b c d a b c d"]
GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


@pytest.fixture(scope="module")
def loaded(tiny_model_dir):
    return cached_model(str(tiny_model_dir))


@pytest.fixture(scope="module")
def reference(tiny_model_dir, loaded) -> list[list[int]]:
    engine = make_engine(tiny_model_dir, "none", loaded=loaded)
    return [o.token_ids for o in engine.generate(PROMPTS, GREEDY)]


def _asked(engine) -> list[list[int]]:
    """Record, per proposer call, the budgets asked for."""
    calls, propose = [], engine.proposer.propose

    def recording(requests):
        calls.append([r.num_tokens for r in requests])
        return propose(requests)

    engine.proposer.propose = recording
    return calls


@pytest.mark.parametrize("adaptive", [True, False], ids=["cost-aware", "fixed"])
def test_rejected_drafts_stop(tiny_model_dir, tiny_draft_dir, loaded, reference, adaptive):
    """An unrelated random draft model (every draft rejected): with the planner, after its first
    draft the steps are plain decode steps but for probes (the full budget, at intervals doubling
    while they find nothing); fixed k drafts at every step. Outputs equal target-only decoding's
    either way."""
    engine = make_engine(tiny_model_dir, "draft_model", k=3, loaded=loaded, adaptive=adaptive,
                         draft_model=str(tiny_draft_dir))
    calls = _asked(engine)
    outs = engine.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == reference
    steps = max(o.num_steps for o in outs)
    assert engine.stats.num_accepted_tokens == 0 < engine.stats.num_draft_tokens
    if not adaptive:
        assert len(calls) == steps - 1 and all(n == [3] * len(PROMPTS) for n in calls[:-2])  # (the last token: none)
        return
    # after the first draft, only probes: the full budget for the sequences due (after 16 undrafted
    # steps, then 32: nothing found) that the probe budget (2% of the steps) covers, the rest none
    assert 2 <= len(calls) <= 4 and all(set(c) <= {0, 3} and any(c) for c in calls[1:]), calls
    assert engine.stats.num_draft_tokens < 0.15 * 3 * steps * len(PROMPTS)


def test_probe_budget_cuts_probes(tiny_model_dir, tiny_draft_dir, loaded, reference):
    """SpeculativeConfig.probe_share reaches the planner: with a 2% budget the random draft model's
    probes (every one rejected) cover only the sequences the budget pays for, so fewer tokens are
    drafted than with pacing alone; outputs equal target-only decoding's either way."""
    drafted = {}
    for share in (None, 0.02):
        engine = make_engine(tiny_model_dir, "draft_model", k=3, loaded=loaded, adaptive=True,
                             draft_model=str(tiny_draft_dir), probe_share=share)
        calls = _asked(engine)
        outs = engine.generate(PROMPTS, GREEDY)
        assert [o.token_ids for o in outs] == reference
        assert engine.planner.probe_share == share
        drafted[share] = (engine.stats.num_draft_tokens, calls)
    assert drafted[0.02][0] < drafted[None][0], drafted
    assert any(0 in c and any(c) for c in drafted[0.02][1][1:]), drafted  # a partial probing step


def test_sampled_drafts_shrink_to_what_pays(tiny_model_dir, tiny_draft_dir, loaded):
    """At temperature 1 the random draft model's sampled drafts are accepted a third of the time or
    so; where a verified row costs a quarter of a step that does not pay and drafting all but stops
    (modelled costs: deterministic). Under measured costs a seeded request is planned like any other
    (its budgets follow the host timers) and its output is still the seed's under fixed k, and
    target-only decoding's (coupled draws: rayspec.sampling.sampler)."""
    dear_rows = {"step_s": 0.010, "row_s": 0.0025, "propose_s": 0.001, "propose_depth_s": 0.001}
    engine = make_engine(tiny_model_dir, "draft_model", k=3, loaded=loaded, adaptive=True,
                         draft_model=str(tiny_draft_dir), draft_costs=dear_rows)
    calls = _asked(engine)
    params = [SamplingParams(temperature=1.0, max_tokens=40, ignore_eos=True, seed=2 * i) for i in range(3)]
    outs = engine.generate(PROMPTS, params)
    assert all(len(o.token_ids) == 40 for o in outs)
    drafted, accepted = engine.stats.num_draft_tokens, engine.stats.num_accepted_tokens
    assert 0 < accepted < drafted < 0.25 * 3 * max(o.num_steps for o in outs) * len(PROMPTS), (drafted, calls)

    seeded = SamplingParams(temperature=1.0, max_tokens=20, seed=7, ignore_eos=True)
    timed = make_engine(tiny_model_dir, "draft_model", k=3, loaded=loaded, adaptive=True, measured_costs=True,
                        draft_model=str(tiny_draft_dir))
    assert isinstance(timed.planner.costs, MeasuredCosts) and timed.planner.costs.known  # calibrated
    (out,) = timed.generate([PROMPTS[0]], seeded)
    fixed = make_engine(tiny_model_dir, "draft_model", k=3, loaded=loaded, draft_model=str(tiny_draft_dir))
    assert fixed.generate([PROMPTS[0]], seeded)[0].token_ids == out.token_ids  # the seed's output, as fixed k
    alone = make_engine(tiny_model_dir, "none", loaded=loaded)
    assert alone.generate([PROMPTS[0]], seeded)[0].token_ids == out.token_ids  # and as target-only decoding


def test_accepted_drafts_are_made_in_full(tiny_model_dir, loaded, reference):
    """A proposer that drafts the target's own continuation: every draft accepted, so the planner
    goes up to the full k within a few steps and stays there."""
    engine = make_engine(tiny_model_dir, "ngram", k=4, loaded=loaded, adaptive=True)
    prompt_ids = [tuple(engine.encode(p)) for p in PROMPTS]
    engine.proposer = OracleProposer(dict(zip(prompt_ids, [r + [0] * 8 for r in reference])), k=4, wrong=0)
    calls = _asked(engine)
    outs = engine.generate([list(p) for p in prompt_ids], GREEDY)
    assert [o.token_ids for o in outs] == reference
    assert engine.stats.num_accepted_tokens == engine.stats.num_draft_tokens > 0
    # from the prior (half accepted: 2 tokens pay) up to the full k in three steps, kept there but
    # for the last step (capped by the tokens left)
    assert calls[0] == [2, 2, 2] and all(c == [4, 4, 4] for c in calls[3:-1]) and len(calls) >= 6, calls


def test_a_closed_batch_drafts_for_its_slowest(tiny_model_dir, loaded, reference):
    """Requests started together with nothing joining them (a closed batch, an offline generate()):
    the batch runs as long as its slowest, so the two requests with 8 tokens to make are never
    drafted for while the 40-token one is more than a draft ahead of them, though a perfect oracle's
    drafts would all be accepted; the 40-token one drafts. Once requests join mid-decode (open
    traffic, whose finished requests are replaced at once) all three draft. Outputs unchanged."""
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (40, 8, 8)]
    want = [r[:p.max_tokens] for r, p in zip(reference, params)]

    def oracle_engine():
        engine = make_engine(tiny_model_dir, "ngram", k=4, loaded=loaded, adaptive=True)
        prompt_ids = [list(engine.encode(p)) for p in PROMPTS]
        engine.proposer = OracleProposer(dict(zip(map(tuple, prompt_ids), [r + [0] * 8 for r in reference])), k=4,
                                         wrong=0)
        drafted, propose = set(), engine.proposer.propose

        def recording(requests):  # which prompts' sequences were asked for drafts
            drafted.update(i for r in requests if r.num_tokens for i, p in enumerate(prompt_ids)
                           if r.token_ids[:len(p)] == p)
            return propose(requests)

        engine.proposer.propose = recording
        return engine, prompt_ids, drafted

    engine, prompt_ids, drafted = oracle_engine()
    assert [o.token_ids for o in engine.generate(prompt_ids, params)] == want
    assert drafted == {0} and engine.stats.num_accepted_tokens > 0, drafted
    assert engine.scheduler.closed_batch()

    engine, prompt_ids, drafted = oracle_engine()
    ids = [engine.add_request(prompt_ids[0], params[0])]
    done = {out.request_id: out for _ in range(3) for out in engine.step() if out.finished}
    ids += [engine.add_request(p, sp) for p, sp in zip(prompt_ids[1:], params[1:])]  # joining mid-decode
    run_to_completion(engine, done)
    assert [done[i].token_ids for i in ids] == want
    assert not engine.scheduler.closed_batch()
    assert drafted == {0, 1, 2}, drafted


def test_measured_costs_are_timed(tiny_model_dir, loaded):
    """Measured costs (the default): calibrated when the engine is built, then refitted from every
    step's host timers. (Whether 5 rows at 500 keys cost more than 1 at 100 is left to the timers: for
    this tiny model the difference is within their noise on a busy 2-core machine, and the fit keeps
    its slopes >= 0, so the two came out equal once.)"""
    engine = make_engine(tiny_model_dir, "ngram", k=4, loaded=loaded, adaptive=True, measured_costs=True)
    costs = engine.planner.costs
    calibrated = costs.verify.num_observed
    assert calibrated >= 4 and costs.verify_s(1, 5, 500) >= costs.verify_s(1, 1, 100) > 0
    engine.generate(PROMPTS[:1], SamplingParams(temperature=0, max_tokens=12))
    assert costs.verify.num_observed > calibrated
    # a shape's first timing is left out (MeasuredCosts._first_seen); the same shape again counts.
    # (Shapes no step had: whether the generate above drafted, i.e. met a new shape, is the planner's
    # call from timers, and on a busy machine it once drafted nothing: a CI failure.)
    first_seen, verified, proposed = costs.num_first_seen, costs.verify.num_observed, costs.propose.num_observed
    for _ in range(2):
        costs.observe_verify(3, 7, 100.0, 0.01)
        costs.observe_propose(5, 3, 0.01)
    assert costs.num_first_seen == first_seen + 2
    assert costs.verify.num_observed == verified + 1 and costs.propose.num_observed == proposed + 1


def test_a_probe_catches_up_on_its_window_only(tiny_model_dir, tiny_draft_dir):
    """A draft model asked for a probe (ProposeRequest.max_catch_up) with more context unseen than
    the window runs only the context's last `window` tokens through its model, and drafts what a
    draft model given just those tokens drafts; the next call continues from there (its catch-up:
    the tokens since), drafting as that fresh draft model does on the same tokens."""
    from rayspec.model import loader
    from rayspec.proposers.base import ProposeRequest
    from rayspec.proposers.draft_model import DraftModelProposer

    model, _ = loader.load_model(str(tiny_draft_dir), tokenizer=False)
    proposer, fresh = DraftModelProposer(model, 128, 2, 3), DraftModelProposer(model, 128, 2, 3)
    fed, forward = [], proposer.runner.forward

    def recording(seq_ids, tokens, *args, **kwargs):
        fed.append(sum(len(t) for t in tokens))
        return forward(seq_ids, tokens, *args, **kwargs)

    proposer.runner.forward = recording
    context = [(7 * i + 3) % 500 + 20 for i in range(40)]
    assert proposer.catch_up_tokens("s", len(context)) == 40 and proposer.catch_up_tokens("s", 40, 8) == 8
    (draft,) = proposer.propose([ProposeRequest("s", context, 3, max_catch_up=8)])
    assert fed[0] == 8, fed  # the window, then one token per further draft position
    (want,) = fresh.propose([ProposeRequest("f", context[-8:], 3)])
    assert draft.tokens == want.tokens and len(draft.tokens) == 3
    # the first drafted token accepted, then the target's own: the draft continues from its window
    context += [draft.tokens[0], 11]
    assert proposer.catch_up_tokens("s", len(context)) == 1  # (its cached first draft token is kept)
    fed.clear()
    (draft,) = proposer.propose([ProposeRequest("s", context, 3, max_catch_up=8)])
    (want,) = fresh.propose([ProposeRequest("f", context[-10:], 3)])
    assert fed[0] == 1 and draft.tokens == want.tokens


def test_windowed_probes_keep_the_output(tiny_model_dir, tiny_draft_dir, loaded, reference):
    """Cost-aware drafting with an unrelated draft model, its probes windowed to 4 tokens: probes
    restart the draft's context (every probe here has more than 4 tokens unseen) and the outputs are
    target-only decoding's."""
    engine = make_engine(tiny_model_dir, "draft_model", k=3, loaded=loaded, adaptive=True,
                         draft_model=str(tiny_draft_dir))
    engine.proposer.probe_window = 4
    windows, propose = [], engine.proposer.propose

    def recording(requests):
        windows.extend(r.max_catch_up for r in requests if r.num_tokens)
        return propose(requests)

    engine.proposer.propose = recording
    restarts, restart = [], engine.proposer._restart
    engine.proposer._restart = lambda seq_id, offset: (restarts.append(offset), restart(seq_id, offset))
    outs = engine.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == reference
    assert None in windows and 4 in windows, windows  # the first drafts whole, later probes windowed
    assert restarts and all(r > 0 for r in restarts), restarts
