"""Asynchronous drafting (rayspec.proposers.pre_draft): verdict ranking, and greedy outputs equal to
the target alone whether drafts come from the speculation cache (hits) or are drafted on the call
(misses), with rounds inline or in a background thread racing the engine's verification."""

from __future__ import annotations

import pytest

from engine_utils import cached_model, greedy_reference, make_engine
from rayspec.proposers.draft_model import DraftModelProposer
from rayspec.proposers.pre_draft import PreDraftingProposer, rank_verdicts
from rayspec.sampling import SamplingParams

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
    return make_engine(target, "draft_model", k=k, loaded=cached_model(target), proposer=proposer), proposer


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
    # an untrained truncated draft rarely guesses the verdict (benchmarks/README.md "draft_model"), but it does
    assert stats.num_hits > 0, stats.as_dict()
