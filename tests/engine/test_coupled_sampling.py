"""Seeded sampled requests draw coupled (rayspec.sampling.sampler, "Two kinds of draw"): what they emit is
target-only decoding with the same seed, token for token, whatever proposes (n-gram, a draft model,
synchronous or pre-drafting, mostly accepted or never, EAGLE-3 chains and trees), whatever the
cost-aware planner drafts (measured costs: timing-dependent plans), alone, in a batch, joining
mid-decode and beside unseeded requests.
Exact equality, no statistics: with tests/unit/test_units.py's check that a coupled draw is distributed as
its row (chi-square over seeds), it is the losslessness of the seeded path."""

from __future__ import annotations

import pytest
import torch

from engine_utils import cached_model, make_engine, run_alone, run_batch, run_joining
from rayspec.sampling.sampler import SamplingParams

SHARED = [11, 12, 13, 14, 15, 16, 17, 18] * 3
PROMPTS = [SHARED + [40, 41], [9, 8, 7, 6, 9, 8, 7, 6, 9, 8], SHARED + [50], [3, 4, 5, 3, 4, 5, 3]]
# peaked enough that drafts are accepted at times (the accepted paths run), flat enough that they are not always
PARAMS = dict(temperature=0.3, top_k=20, max_tokens=24, ignore_eos=True)
# the tiny random model repeats itself (what n-gram drafts need) only when nearly greedy
NGRAM_TEMPERATURE = 0.05


def _params(seed: int, **over) -> SamplingParams:
    return SamplingParams(**{**PARAMS, "seed": seed, **over})


@pytest.fixture(scope="module")
def loaded(tiny_model_dir):
    return cached_model(str(tiny_model_dir))


@pytest.fixture(scope="module")
def reference(tiny_model_dir, loaded):
    """temperature -> target-only decoding of each prompt alone, seed 1234 + i."""
    engine = make_engine(tiny_model_dir, "none", loaded=loaded)
    return {t: [engine.generate([p], _params(1234 + i, temperature=t))[0].token_ids for i, p in enumerate(PROMPTS)]
            for t in (PARAMS["temperature"], NGRAM_TEMPERATURE)}


@pytest.fixture(scope="module")
def head_dir(tiny_model_dir, loaded, tmp_path_factory):
    """An oracle EAGLE-3 head (eagle_utils.oracle_head) on the target's greedy continuations: its
    drafts are the target's likeliest tokens, so coupled draws accept some of them."""
    from eagle_utils import oracle_head
    from rayspec.eagle.checkpoint import save_eagle_head

    engine = make_engine(tiny_model_dir, "none", loaded=loaded)
    greedy = [o.token_ids for o in engine.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=24,
                                                                               ignore_eos=True))]
    args = loaded[0].args
    head = oracle_head(tiny_model_dir, args.num_layers, args.hidden_size, [p[-1:] + g for p, g in zip(PROMPTS, greedy)])
    return save_eagle_head(head, tmp_path_factory.mktemp("coupled-head") / "head", dtype=torch.float32)


# adaptive=False: these runs must verify accepted and rejected drafts on every path (asserted below);
# at these temperatures the planner (on modelled costs) stops drafting after the first rejections,
# before any draft is accepted. draft-other keeps the defaults (planner on), draft-self-measured
# runs the planner on host timers.
METHODS = {
    "ngram": dict(method="ngram", k=4, prompt_lookup_min=1, prompt_lookup_max=3, adaptive=False),
    "draft-self": dict(method="draft_model", k=3, draft_num_layers=1, draft_model="self", adaptive=False),
    "draft-other": dict(method="draft_model", k=2, draft_model="other"),
    # the planner on host timers: its budgets vary with the machine's load, the output may not
    "draft-self-measured": dict(method="draft_model", k=4, draft_num_layers=1, draft_model="self", adaptive=True,
                                measured_costs=True),
    # asynchronous drafting (rayspec.proposers.pre_draft): drafts from the speculation cache too
    "draft-self-async": dict(method="draft_model", k=3, draft_num_layers=1, draft_model="self", adaptive=False),
    "eagle3-chain": dict(method="eagle3", k=4, draft_model="head", tree_max_batch=0, adaptive=False),
    "eagle3-tree": dict(method="eagle3", k=6, draft_model="head", eagle_topk=2, tree_max_batch=8, adaptive=False),
}


def _engine(name, tiny_model_dir, tiny_draft_dir, head_dir, loaded):
    spec = dict(METHODS[name])
    spec["draft_model"] = {"self": str(tiny_model_dir), "other": str(tiny_draft_dir), "head": str(head_dir),
                           None: None}[spec.get("draft_model")]
    if spec["draft_model"] is None:
        del spec["draft_model"]
    engine = make_engine(tiny_model_dir, loaded=loaded, **spec)
    if name.endswith("-async"):
        from rayspec.proposers.pre_draft import PreDraftingProposer

        engine.proposer = PreDraftingProposer(engine.proposer, 4, max_model_len=256)  # every hypothesis drafted
    return engine


def _run(engine, mode, temperature):
    """Each prompt with its own seed (1234 + i), run alone, as a batch, or joining mid-decode."""
    if mode == "alone":
        return [engine.generate([p], _params(1234 + i, temperature=temperature))[0].token_ids
                for i, p in enumerate(PROMPTS)]
    ids = [engine.add_request(p, _params(1234 + i, temperature=temperature)) for i, p in enumerate(PROMPTS[:2])]
    done = {}
    if mode == "joining":
        for _ in range(3):
            done.update({o.request_id: o for o in engine.step() if o.finished})
        assert engine.num_running > 0
    ids += [engine.add_request(p, _params(1234 + 2 + i, temperature=temperature)) for i, p in enumerate(PROMPTS[2:])]
    if mode == "beside-unseeded":  # unseeded sampled and greedy requests share every step
        engine.add_request(PROMPTS[0], SamplingParams(**PARAMS))
        engine.add_request(PROMPTS[1], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    return [done[i].token_ids for i in ids]


@pytest.mark.parametrize("mode", ["alone", "batch", "joining", "beside-unseeded"])
@pytest.mark.parametrize("name", list(METHODS))
def test_seeded_output_is_target_only_decoding(tiny_model_dir, tiny_draft_dir, head_dir, loaded, reference,
                                               name, mode):
    engine = _engine(name, tiny_model_dir, tiny_draft_dir, head_dir, loaded)
    temperature = NGRAM_TEMPERATURE if name == "ngram" else PARAMS["temperature"]
    got = _run(engine, mode, temperature)
    for i, (g, ref) in enumerate(zip(got, reference[temperature])):
        assert g == ref, f"prompt {i}: {name}/{mode} is not target-only decoding with its seed"
    stats = engine.stats
    assert stats.num_drafts > 0 and stats.num_accepted_tokens < stats.num_draft_tokens, stats.as_dict()
    # the accepted paths ran (the measured planner may stop drafting before any is accepted)
    if name not in ("draft-other", "draft-self-measured"):
        assert stats.num_accepted_tokens > 0, f"{name}/{mode}: no draft accepted"
    if name.endswith("-async"):  # drafts from the speculation cache were verified
        assert engine.proposer.pre_drafter.stats.num_hits > 0, engine.proposer.pre_drafter.stats.as_dict()


def test_seeds_and_positions_change_the_draws(tiny_model_dir, loaded, reference):
    """Not a constant stream: another seed gives another output, and a prompt one token longer
    shifts every position (the same seed, other draws)."""
    engine = make_engine(tiny_model_dir, "none", loaded=loaded)
    other = engine.generate([PROMPTS[0]], _params(99))[0].token_ids
    assert other != reference[PARAMS["temperature"]][0]
    again = engine.generate([PROMPTS[0]], _params(1234))[0].token_ids
    assert again == reference[PARAMS["temperature"]][0]
    shifted = engine.generate([[5] + PROMPTS[0]], _params(1234))[0].token_ids
    assert shifted != again


def test_a_resumed_seeded_request_continues_as_unfaulted(tiny_model_dir, tiny_draft_dir, head_dir, loaded, reference):
    """A failover resumes a request from the tokens it had (GenerateRequest.resume_output_ids): under
    its seed the rest is the unfaulted output's rest, on another engine, with speculation or without."""
    want = reference[PARAMS["temperature"]][0]
    for name in ("draft-self", None):
        engine = (_engine(name, tiny_model_dir, tiny_draft_dir, head_dir, loaded) if name
                  else make_engine(tiny_model_dir, "none", loaded=loaded))
        rid = engine.add_request(PROMPTS[0], _params(1234), resume_output_ids=want[:9])
        done = {}
        while engine.has_unfinished_requests():
            done.update({o.request_id: o for o in engine.step() if o.finished})
        assert want[:9] + done[rid].token_ids[-(len(want) - 9):] == want, name
