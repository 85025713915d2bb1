"""Greedy (temperature 0) speculative decoding is lossless: every proposer emits exactly the
tokens of target-only decoding, alone, batched and with requests joining mid-batch."""

from __future__ import annotations

import pytest

from conftest import make_tiny_model_dir
from engine_utils import (cached_model, greedy_reference, make_engine, run_alone, run_batch, run_joining,
                          run_to_completion)
from rayspec.proposers.draft_model import DraftModelProposer
from rayspec.sampling.sampler import SamplingParams

TINY_PROMPTS = [
    "The cat sat on the mat. The cat sat on the mat. The cat",
    "one two three one two three one two three one",
    "Hello, world!",
    "a b c d a b c d a b c d a b",
]
TINY_PARAMS = SamplingParams(temperature=0, max_tokens=32)


# This module's tiny model: conftest's with seed 4, where its first layer as a draft ("self") is
# accepted 46 of 219 drafted tokens on TINY_PROMPTS (seed 0: 21 of 290, too rarely for cost-aware
# drafting to find a draft that pays within 32 tokens), and n-gram drafts are accepted at times.
# (Seeds 1, 4-7 pass every case here; seed 1 shares its embedding and first layer with conftest's
# tiny_draft_dir, the "other" draft.)
@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny-seed4") / "model", seed=4)


# cost-aware drafting (the -adaptive cases) under modelled costs where drafts are cheap: the tiny
# drafts, mostly rejected, still pay now and then, so the planned budgets vary and both verdicts occur
CHEAP_DRAFTS = {"step_s": 0.010, "row_s": 0.0001, "propose_s": 0.0002, "propose_depth_s": 0.0001}

# (id, speculative config, draft checkpoint). "self": the target's first layer as the draft
# (partly accepted); "other": an unrelated random model (its drafts are all rejected). The cases without
# -adaptive draft a fixed budget (adaptive=False; the planner is on by default, make_engine): they
# assert both verdicts in every mode, which the planner's closed-batch rule seldom drafts for here
# (see the test), and the -adaptive cases run the planner.
TINY_METHODS = [
    ("none", dict(method="none"), None),
    ("ngram", dict(method="ngram", k=4, prompt_lookup_min=1, prompt_lookup_max=3, adaptive=False), None),
    ("ngram-adaptive", dict(method="ngram", k=4, adaptive=True, prompt_lookup_min=1, prompt_lookup_max=3,
                            draft_costs=CHEAP_DRAFTS), None),
    ("ngram-k1", dict(method="ngram", k=1, prompt_lookup_min=2, prompt_lookup_max=4, adaptive=False), None),
    ("draft-self-1layer", dict(method="draft_model", k=3, draft_num_layers=1, adaptive=False), "self"),
    ("draft-other-model", dict(method="draft_model", k=2, adaptive=False), "other"),
    ("draft-adaptive", dict(method="draft_model", k=3, adaptive=True, draft_num_layers=1, draft_costs=CHEAP_DRAFTS),
     "self"),
    # the target itself with weight-only int8 linears (rayspec.model.quantize): mostly accepted, and whether any
    # draft is rejected depends on the CPU's rounding (all 92 were accepted on one CI machine), so this case
    # asks for equality and acceptance only; the other drafts exercise rejection
    ("draft-self-int8", dict(method="draft_model", k=3, draft_quantization="int8", adaptive=False), "self"),
]


@pytest.fixture(scope="module")
def tiny_loaded(tiny_model_dir):
    return cached_model(str(tiny_model_dir))


@pytest.fixture(scope="module")
def tiny_reference(tiny_model_dir, tiny_loaded):
    """Target-only decoding, each prompt alone."""
    engine = make_engine(tiny_model_dir, "none", loaded=tiny_loaded)
    return run_alone(engine, TINY_PROMPTS, TINY_PARAMS)


def _tiny_engine(tiny_model_dir, tiny_draft_dir, tiny_loaded, spec: dict, draft):
    spec = dict(spec)
    if draft == "other":
        spec["draft_model"] = str(tiny_draft_dir)
    return make_engine(tiny_model_dir, loaded=tiny_loaded, **spec)


@pytest.mark.parametrize("mode", ["alone", "batch", "joining"])
@pytest.mark.parametrize("name,spec,draft", TINY_METHODS, ids=[m[0] for m in TINY_METHODS])
def test_tiny_greedy_matches_baseline(tiny_model_dir, tiny_draft_dir, tiny_loaded, tiny_reference,
                                      name, spec, draft, mode):
    engine = _tiny_engine(tiny_model_dir, tiny_draft_dir, tiny_loaded, spec, draft)
    run = {"alone": run_alone, "batch": run_batch, "joining": run_joining}[mode]
    got = run(engine, TINY_PROMPTS, TINY_PARAMS)
    for i, (g, ref) in enumerate(zip(got, tiny_reference)):
        assert g == ref, f"prompt {i}: {name}/{mode} diverges from target-only decoding"
    assert all(len(r) == TINY_PARAMS.max_tokens for r in tiny_reference)
    stats = engine.stats
    if spec["method"] == "none":
        assert stats.num_draft_tokens == 0
    elif spec.get("adaptive") and mode == "batch":
        # a closed batch (all requests started together, nothing joining): cost-aware drafting drafts
        # only where every one of its slowest sequences drafts and that pays (DraftPlanner._closed),
        # which these tiny drafts seldom do (n-gram: one draft in 32 steps here); outputs checked
        # above, verdicts in the alone and joining modes
        pass
    else:
        # speculation really happened, and both outcomes of verification were exercised
        assert stats.num_drafts > 0, f"{name}: no drafts proposed"
        if draft != "other":
            assert stats.num_accepted_tokens > 0, f"{name}: no draft accepted"
        if name != "draft-self-int8":
            assert stats.num_accepted_tokens < stats.num_draft_tokens, f"{name}: no draft rejected"
    assert engine.num_running == engine.num_waiting == 0
    assert engine.kv.num_free_slots == engine.num_slots


def test_tiny_joining_mixed_params(tiny_model_dir, tiny_loaded, tiny_reference):
    """Greedy and sampled requests in one batch: the greedy ones stay exact."""
    engine = make_engine(tiny_model_dir, "ngram", k=4, loaded=tiny_loaded, prompt_lookup_min=1)
    ids = [engine.add_request(TINY_PROMPTS[0], TINY_PARAMS),
           engine.add_request(TINY_PROMPTS[1], SamplingParams(temperature=1.0, seed=3, max_tokens=40))]
    engine.step()
    engine.step()
    ids.append(engine.add_request(TINY_PROMPTS[2], TINY_PARAMS))
    ids.append(engine.add_request(TINY_PROMPTS[3], SamplingParams(temperature=0.7, top_k=5, seed=4, max_tokens=7)))
    done = run_to_completion(engine)
    assert done[ids[0]].token_ids == tiny_reference[0]
    assert done[ids[2]].token_ids == tiny_reference[2]
    assert len(done[ids[1]].token_ids) == 40 and len(done[ids[3]].token_ids) == 7


# ---- SmolLM2-135M -------------------------------------------------------------------------

SMOL_PROMPTS = [
    "List the colors: red, green, blue, red, green, blue, red, green,",
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return",
    "The capital of France is",
    "1, 2, 3, 4, 5, 6, 7, 8,",
]
SMOL_PARAMS = SamplingParams(temperature=0, max_tokens=32)
SMOL_DRAFT_LAYERS = 8  # of 30: a cheap, weak self-draft, so drafts are partly accepted


@pytest.fixture(scope="module")
def smol(smollm2):
    return cached_model(smollm2)


@pytest.fixture(scope="module")
def smol_draft(smollm2):
    return cached_model(smollm2, SMOL_DRAFT_LAYERS)[0]


@pytest.fixture(scope="module")
def smol_reference(smollm2, smol):
    return [list(greedy_reference(smollm2, p, SMOL_PARAMS.max_tokens)) for p in SMOL_PROMPTS]


def _smol_engine(smollm2, smol, smol_draft, method: str, k: int = 3, **kw):
    proposer = None
    if method == "draft_model":  # share the already loaded truncated draft (engine defaults: 256 tokens, 8 slots)
        proposer = DraftModelProposer(smol_draft, max_model_len=256, num_slots=8, max_draft_tokens=k)
    engine = make_engine(smollm2, method, k=k, loaded=smol, proposer=proposer, **kw)
    assert engine.num_slots <= 8 and engine.max_model_len == 256
    return engine


@pytest.mark.slow
@pytest.mark.parametrize("method,kw", [  # fixed budgets (adaptive=False: both verdicts asserted) and the planner
    ("ngram", dict(k=4, adaptive=False)),
    ("ngram", dict(k=4, adaptive=True)),
    ("draft_model", dict(k=3, adaptive=False)),
], ids=["ngram", "ngram-adaptive", "draft_model"])
def test_smollm2_greedy_matches_baseline(smollm2, smol, smol_draft, smol_reference, method, kw):
    engine = _smol_engine(smollm2, smol, smol_draft, method, **dict(kw))
    alone = run_alone(engine, SMOL_PROMPTS[:2], SMOL_PARAMS)
    batch = run_batch(engine, SMOL_PROMPTS, SMOL_PARAMS)
    joining = run_joining(engine, SMOL_PROMPTS, SMOL_PARAMS, first=2, steps_before_join=2)
    assert alone == smol_reference[:2]
    for i, ref in enumerate(smol_reference):
        assert batch[i] == ref, f"prompt {i}: batch of 4 diverges"
        assert joining[i] == ref, f"prompt {i}: joining mid-batch diverges"
    stats = engine.stats
    assert stats.num_accepted_tokens > 0, "no draft accepted"
    assert stats.num_accepted_tokens < stats.num_draft_tokens, "no draft rejected: rollback not exercised"


@pytest.mark.slow
def test_smollm2_draft_model_from_config(smollm2, smol, smol_reference):
    """The draft proposer built by the registry (draft_model=<same model>, truncated)."""
    # adaptive off: both verdicts are asserted, and with the planner on the truncated draft's first 3
    # drafts were rejected and it stopped drafting
    engine = make_engine(smollm2, "draft_model", k=2, loaded=smol, draft_model=smollm2,
                         draft_num_layers=SMOL_DRAFT_LAYERS, adaptive=False)
    assert isinstance(engine.proposer, DraftModelProposer)
    assert engine.proposer.runner.model.args.num_layers == SMOL_DRAFT_LAYERS
    got = run_batch(engine, SMOL_PROMPTS[2:], SMOL_PARAMS)
    assert got == smol_reference[2:]
    assert 0 < engine.stats.num_accepted_tokens < engine.stats.num_draft_tokens
