"""Asynchronous drafting (rayspec.proposers.pre_draft): verdict ranking, and greedy outputs equal to
the target alone whether drafts come from the speculation cache (hits) or are drafted on the call
(misses), with rounds inline or in a background thread racing the engine's verification."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from engine_utils import cached_model, greedy_reference, make_engine
from rayspec.proposers.base import Draft, PreDraftable, ProposeRequest
from rayspec.proposers.draft_model import DraftModelProposer
from rayspec.proposers.pre_draft import PreDrafter, PreDraftingProposer, rank_verdicts
from rayspec.sampling.sampler import SamplingParams

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "1, 2, 3, 4,"]
MAX_TOKENS = 24


def test_rank_verdicts():
    # draft [5, 6]; position 0: 5 (0.6) or 7 (0.3); position 1: 6 (0.5) or 8 (0.4); after: 9 (0.8) or 1 (0.1)
    candidates = [([5, 7], [0.6, 0.3]), ([6, 8], [0.5, 0.4]), ([9, 1], [0.8, 0.1])]
    # acceptance 0.5: (0, 7) 0.5 * 0.3 / 0.4 = 0.375, (1, 8) 0.25 * 0.4 / 0.5 = 0.2, (2, 9) 0.2, (2, 1) 0.025
    assert rank_verdicts([5, 6], candidates, 3, 0.5)[0] == (0, 7)
    assert set(rank_verdicts([5, 6], candidates, 3, 0.5)[1:]) == {(1, 8), (2, 9)}
    assert rank_verdicts([5, 6], candidates, 10, 0.5)[-1] == (2, 1)
    assert rank_verdicts([5, 6], candidates, 1, 0.9) == [(2, 9)]  # a good draft: all accepted first
    assert set(rank_verdicts([5, 6], candidates[:2], 10, 0.9)) == {(1, 8), (0, 7)}  # no lookahead: no full-accept verdicts


def _engine(target, draft_model, k, hypotheses, background):
    inner = DraftModelProposer(draft_model, max_model_len=256, num_slots=8, max_draft_tokens=k)
    proposer = PreDraftingProposer(inner, hypotheses, max_model_len=256, background=background)
    # adaptive off: hits in the speculation cache are asserted, and the cache holds drafts of the full
    # budget k; with the planner on, SmolLM2's budgets were cut and no pre-draft was hit
    return make_engine(target, "draft_model", k=k, loaded=cached_model(target), proposer=proposer,
                       adaptive=False), proposer


@pytest.mark.parametrize("background", [False, True], ids=["inline", "background"])
@pytest.mark.parametrize("draft", ["self", "other"])
def test_tiny_greedy_matches_target(tiny_model_dir, tiny_draft_dir, draft, background):
    target = str(tiny_model_dir)
    draft_model = cached_model(target if draft == "self" else str(tiny_draft_dir))[0]
    # 5 hypotheses: every verdict with the draft's top 2 tokens per position (3 + 2), so with the
    # target as its own draft (all accepted, bonus its top token) every inline call hits
    engine, proposer = _engine(target, draft_model, 3, 5, background)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    try:
        outs = engine.generate(PROMPTS, params)  # a batch of 4: hypotheses batched over sequences
        alone = [engine.generate([p], params)[0] for p in PROMPTS[:2]]
    finally:
        proposer.close()
    for p, out in zip(PROMPTS, outs):
        assert list(out.token_ids) == list(greedy_reference(target, p, MAX_TOKENS)), p
    assert [list(o.token_ids) for o in alone] == [list(o.token_ids) for o in outs[:2]]
    stats = proposer.pre_drafter.stats
    assert stats.num_hits + stats.num_misses > 0
    if draft == "self" and not background:  # only the first call of each sequence misses
        assert stats.num_misses == len(PROMPTS) + 2 and stats.num_hits > 3 * stats.num_misses, stats


@pytest.mark.slow
def test_smollm2_greedy_matches_target_with_hits(smollm2):
    draft_model = cached_model(smollm2, 8)[0]
    engine, proposer = _engine(smollm2, draft_model, 3, 3, background=False)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS)
    outs = engine.generate(PROMPTS[:2], params)
    for p, out in zip(PROMPTS, outs):
        assert list(out.token_ids) == list(greedy_reference(smollm2, p, MAX_TOKENS)), p
    stats = proposer.pre_drafter.stats
    # an untrained truncated draft rarely guesses the verdict (docs/benchmarks-history.md "draft_model"), but it does
    assert stats.num_hits > 0, stats.as_dict()


# ---- EAGLE-3: hypotheses drafted from the head's own states ---------------------------------------

@pytest.fixture(scope="module")
def eagle_setup(tmp_path_factory):
    """A tiny 8-layer target, prompts on which it repeats tokens, and a hand-set "repeat this
    token" EAGLE-3 head over its tokens (tests/eagle_utils.py)."""
    from conftest import make_tiny_model_dir
    from eagle_utils import PROMPTS as EAGLE_PROMPTS
    from eagle_utils import TARGET_LAYERS, copy_head

    from rayspec.eagle.checkpoint import save_eagle_head

    root = tmp_path_factory.mktemp("pre-draft-eagle")
    target = str(make_tiny_model_dir(root / "target", num_layers=TARGET_LAYERS))
    tokens = {t for p in EAGLE_PROMPTS for t in greedy_reference(target, p, MAX_TOKENS)}
    head = save_eagle_head(copy_head(Path(target), sorted(tokens | set(range(3, 67)))), root / "head")
    return target, str(head), EAGLE_PROMPTS


@pytest.mark.parametrize("background", [False, True], ids=["inline", "background"])
@pytest.mark.parametrize("topk", [1, 4], ids=["chain", "tree"])
def test_eagle3_greedy_matches_target(eagle_setup, topk, background):
    target, head, prompts = eagle_setup
    # adaptive off: hits in the speculation cache are asserted (inline), and with the planner on the
    # tree run's budgets changed and no pre-draft was hit
    engine = make_engine(target, "eagle3", k=4, loaded=cached_model(target), draft_model=head, eagle_topk=topk,
                         num_steps=3, tree_max_batch=8, adaptive=False)
    proposer = PreDraftingProposer(engine.proposer, 4, max_model_len=256, background=background)
    engine.proposer = proposer
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    try:
        outs = engine.generate(prompts, params)
        alone = [engine.generate([p], params)[0] for p in prompts[:2]]
    finally:
        proposer.close()
    for p, out in zip(prompts, outs):
        assert list(out.token_ids) == list(greedy_reference(target, p, MAX_TOKENS)), p
    assert [list(o.token_ids) for o in alone] == [list(o.token_ids) for o in outs[:2]]
    stats = proposer.pre_drafter.stats
    if not background:  # every hypothesis drafted: some verdicts were guessed
        assert stats.num_hits > 0 and stats.verdicts_after_hits > 0, stats.as_dict()


def test_pre_drafting_pauses_where_it_slows_the_verifier():
    """The cycle the verifier sees (its pace plus the call) was 10 ms longer after pre-drafting
    rounds than after idle ones: only the probe rounds pre-draft (one in 16; another in 16 stays
    idle to measure the cycle without it). Shorter after pre-drafting: every round but the idle one."""

    class Stub(PreDraftable):
        name = "stub"

        def propose(self, requests):  # (the pacing alone is tested: nothing is drafted)
            raise AssertionError("not called")

    pre = PreDrafter(Stub(), 2, max_model_len=64)
    pre._busy_cycles.extend([0.100] * 3)
    pre._idle_cycles.extend([0.090] * 3)
    assert [pre._pays(1) for _ in range(32)].count(True) == 2
    assert pre.stats.num_idle_rounds == 2 and pre.stats.num_paused_rounds == 28
    pre._busy_cycles.extend([0.080] * 9)
    assert sum(pre._pays(1) for _ in range(16)) == 15


def test_the_cycle_is_measured_by_the_mode_of_the_round_before_the_call():
    """reply -> next call -> its reply, filed under busy or idle by what the round between did."""

    class Stub(PreDraftable):
        name = "stub"

        def propose(self, requests):
            return [Draft([7, 8]) for _ in requests]

        def release(self, seq_id):
            pass

    now = [0.0]
    pre = PreDrafter(Stub(), 1, max_model_len=64, clock=lambda: now[0])
    req = ProposeRequest("s", [1, 2, 3], 2)
    pre.propose([req])  # first call: no cycle yet
    now[0] += 0.050
    pre._round_busy = True  # as if the round after that reply pre-drafted
    pre.propose([dataclasses.replace(req, token_ids=[1, 2, 3, 9])])
    assert list(pre._busy_cycles) == [pytest.approx(0.050)] and not pre._idle_cycles
    now[0] += 0.070
    pre.propose([dataclasses.replace(req, token_ids=[1, 2, 3, 9, 9])])  # the round before stayed idle
    assert list(pre._idle_cycles) == [pytest.approx(0.070)]


def test_draft_model_drafts_without_autograd_in_any_thread(tiny_model_dir):
    """A proposer deployment calls propose from a worker thread, where grad mode is on by default:
    the draft must not build autograd graphs there (it did: drafting took twice as long in the
    proposer replica as in the engine, whose step runs under inference_mode)."""
    import threading

    import torch

    from rayspec.model import loader
    from rayspec.proposers.base import ProposeRequest

    model, _ = loader.load_model(str(tiny_model_dir), tokenizer=False)
    proposer = DraftModelProposer(model, 64, 2, 3)
    seen = []
    forward = proposer.runner.forward

    def recording(*args, **kwargs):
        seen.append((torch.is_grad_enabled(), torch.is_inference_mode_enabled()))
        return forward(*args, **kwargs)

    proposer.runner.forward = recording
    out = []
    t = threading.Thread(target=lambda: out.append(proposer.propose([ProposeRequest("s", [5, 6, 7, 8], 3)])))
    t.start()
    t.join()
    assert len(out[0][0].tokens) == 3 and seen
    assert all(not grad and inference for grad, inference in seen), seen


class _ChainStub(PreDraftable):
    """A proposer drafting the chain [7, 8] for every request (no candidates: nothing to rank)."""
    name = "stub"

    def propose(self, requests):
        return [Draft([7, 8]) for _ in requests]

    def release(self, seq_id):
        pass


def test_pace_counts_only_regular_steps():
    """The verifier's pace is read from the interval reply -> next call only where the next call
    carries the same sequences with a verdict each: a new request's prefill (or a batch that
    changed) in between is not a step's pace."""
    now = [0.0]
    pre = PreDrafter(_ChainStub(), 2, max_model_len=4096, clock=lambda: now[0])
    a, b = [1, 2, 3], [4, 5]
    pre.propose([ProposeRequest("a", a, 2)])
    now[0] += 0.08
    a += [7, 9]  # one draft token accepted, then the bonus 9
    pre.propose([ProposeRequest("a", a, 2)])
    assert list(pre._idle_cycles) == [pytest.approx(0.08)]  # no round ran: an idle pace
    now[0] += 0.5  # b joins: its prefill ran in between
    pre.propose([ProposeRequest("a", a + [1], 2), ProposeRequest("b", b, 2)])
    now[0] += 0.5  # a new request alone
    pre.propose([ProposeRequest("c", [6, 6], 2)])
    assert len(pre._idle_cycles) == 1
    now[0] += 0.08
    pre.propose([ProposeRequest("c", [6, 6, 7, 8, 3], 2)])  # the whole draft accepted, then 3
    assert len(pre._idle_cycles) == 2 and pre._interval_s == pytest.approx(0.08)


def test_pace_is_a_median_and_calibrates_by_alternating():
    class Stub(PreDraftable):
        name = "stub"

        def propose(self, requests):  # (the pacing alone is tested: nothing is drafted)
            raise AssertionError("not called")

    pre = PreDrafter(Stub(), 2, max_model_len=64)
    # until both kinds have PACE_MIN cycles, rounds alternate: busy while idle has as many
    pattern = []
    for _ in range(6):
        pays = pre._pays(1)
        pattern.append(pays)
        (pre._busy_cycles if pays else pre._idle_cycles).append(0.08)
    assert pattern == [True, False] * 3
    # one slow step (a long context, the machine) does not move the median
    pre._busy_cycles.clear()
    pre._busy_cycles.extend([0.081, 0.082, 0.5])
    pre._idle_cycles.clear()
    pre._idle_cycles.extend([0.080, 0.080, 0.081])
    assert pre._cycle_busy == pytest.approx(0.082) and pre._cycle_idle == pytest.approx(0.080)
