"""The compiled step (EngineConfig.compile, rayspec.model.compiled) on CPU: greedy output equal to the
eager engine's, token for token, for plain decoding, n-gram and draft-model chains (drafts accepted,
drafts rejected) and EAGLE-3 trees and chains, at batch sizes 1-3 (padded to the buckets 1, 2, 4),
with requests finishing at different steps, joining mid-decode and starting from prefix-cache hits;
and its shapes really went through torch.compile. (On CUDA the same code captures CUDA graphs:
benchmarks/gpu_roofline.py.)"""

from __future__ import annotations

from dataclasses import replace as dataclasses_replace

import pytest

from conftest import make_tiny_model_dir
from engine_utils import cached_model, run_to_completion
from rayspec.config import EngineConfig, SpeculativeConfig
from rayspec.engine.llm_engine import LLMEngine
from rayspec.sampling.sampler import SamplingParams

PROMPTS = [[5, 17, 99, 3, 42, 8], [7, 7, 7, 12, 30, 31, 32, 33, 5], [100, 4, 64]]


# This module's tiny model: conftest's with seed 3. The oracle head (eagle_utils.oracle_head) drafts
# a bigram table; with seed 3 the target's greedy continuations of JOINING follow it at all 48 steps
# (seed 0: 46), so every draft of the oracle is accepted at least in part.
@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("tiny-seed3") / "model", seed=3)


def _engine(model_dir, method, compile, loaded=None, **spec) -> LLMEngine:
    config = EngineConfig(model=str(model_dir), max_model_len=128, max_num_seqs=4, kv_cache_memory_gb=0.05,
                          compile=compile,
                          speculative=SpeculativeConfig(method=method, num_speculative_tokens=3, adaptive=False, **spec))
    if loaded is not None:
        return LLMEngine(config, model=loaded[0], tokenizer=loaded[1])
    return LLMEngine(config)


@pytest.fixture(scope="module")
def joining_reference(tiny_model_dir):
    """Target-only greedy outputs (eager) of JOINING, 12 tokens each."""
    engine = _engine(tiny_model_dir, "none", False, loaded=cached_model(str(tiny_model_dir)))
    return [o.token_ids for o in engine.generate(JOINING, SamplingParams(temperature=0.0, max_tokens=12,
                                                                           ignore_eos=True))]


@pytest.fixture(scope="module")
def eagle3_head_dir(tiny_model_dir, joining_reference, tmp_path_factory):
    """An oracle head (eagle_utils.oracle_head): it drafts the target's greedy continuations of JOINING,
    so accepted chains and tree paths go through the compiled step."""
    import torch

    from eagle_utils import oracle_head
    from rayspec.eagle.checkpoint import save_eagle_head

    args = cached_model(str(tiny_model_dir))[0].args
    head = oracle_head(tiny_model_dir, args.num_layers, args.hidden_size,
                       [p[-1:] + r for p, r in zip(JOINING, joining_reference)])
    return save_eagle_head(head, tmp_path_factory.mktemp("compiled-head") / "head", dtype=torch.float32)


# a shared prefix of two KV blocks (16 positions each): the requests that join later start from its cache
SHARED = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26] * 2
JOINING = [SHARED + [40, 41], SHARED + [50], [9, 8, 7, 6], SHARED + [60, 61, 62]]


# inductor's CPU kernels (the compiled step as it runs) for plain decoding over the decode buckets; the
# other methods' compiled steps traced (aot_eager: the same graphs, padding and buckets, without
# inductor's C++ builds: each of the 65 kernels of this test's inductor runs took 0.5-2 CPU-s of g++,
# 95 CPU-s with EAGLE-3 trees through inductor as well, 2026-12-05). Inductor's kernels for chain and
# tree verification are compared with the eager step's in test_compiled_kv.
INDUCTOR = {"none"}


@pytest.mark.parametrize("method", ["none", "ngram", "draft_model", "eagle3-tree", "eagle3-chain"])
def test_compiled_step_equals_eager_joining_with_prefix_hits(tiny_model_dir, eagle3_head_dir, joining_reference, method,
                                                            monkeypatch):
    """Requests joining mid-decode, two of them on a cached prefix: the compiled engine's greedy output
    is the eager one's (EAGLE-3: trees verified as one compiled forward at batch 1-2, chains beyond).
    Inductor's kernels where the method is in INDUCTOR, the traced graphs (aot_eager) otherwise."""
    from rayspec.model.compiled import CompiledForward

    if method not in INDUCTOR:
        monkeypatch.setattr(CompiledForward, "backend", "aot_eager")
    spec = {}
    if method == "draft_model":  # the target's first layer as its draft: accepted at times, not always
        spec = dict(draft_model=str(tiny_model_dir), draft_num_layers=1)
    if method.startswith("eagle3"):
        spec = dict(draft_model=str(eagle3_head_dir), eagle_topk=2,
                    tree_max_batch=2 if method == "eagle3-tree" else 0)
    loaded = cached_model(str(tiny_model_dir))
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outputs, cached = [], []
    for compile in (False, True):
        engine = _engine(tiny_model_dir, method.split("-")[0], compile, loaded=loaded, **spec)
        assert (engine.runner.compiled is not None) == compile
        engine.generate([SHARED + [30]], SamplingParams(temperature=0.0, max_tokens=2))  # caches the prefix
        ids, done = [engine.add_request(JOINING[0], params)], {}
        for _ in range(2):  # the first request decodes, then the others join
            done.update({o.request_id: o for o in engine.step() if o.finished})
        ids += [engine.add_request(p, params) for p in JOINING[1:]]
        run_to_completion(engine, done)
        outputs.append([done[i].token_ids for i in ids])
        cached.append([done[i].num_cached_tokens for i in ids])
        if compile:
            shapes = engine.runner.compiled.shapes
            assert shapes, "nothing went through the compiled step"
            if method != "none":  # verification (a tree or a chain of drafts) went through it too
                assert any(rows > 1 for _, rows in shapes), shapes
            if spec:  # and the draft's or the head's own forwards
                assert engine.proposer.runner.compiled.shapes
            if method.startswith("eagle3"):  # the oracle head: every draft's first token accepted, deeper ones too
                # (how deep is bounded by the 12 tokens each request has: ~26 accepted in ~18 drafts)
                stats = engine.stats.as_dict()
                per_pos = stats["num_accepted_tokens_per_pos"]
                assert per_pos[0] == stats["num_drafts"] and per_pos[1] > 0 and per_pos[2] > 0, stats
    assert outputs[1] == outputs[0] == joining_reference
    assert all(len(o) == 12 for o in outputs[1])
    assert cached[1] == cached[0] and cached[1][1] >= 16 and cached[1][3] >= 16, cached  # prefix-cache hits


@pytest.mark.parametrize("method", ["none", "draft_model", "ngram"])
def test_compiled_step_equals_eager(tiny_model_dir, method, monkeypatch):
    # the target as its own draft: every draft accepted; n-gram drafts: mostly rejected
    # (inductor for "none"; the others traced, as in the test above)
    from rayspec.model.compiled import CompiledForward

    if method not in INDUCTOR:
        monkeypatch.setattr(CompiledForward, "backend", "aot_eager")
    spec = {"draft_model": str(tiny_model_dir)} if method == "draft_model" else {}
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (6, 11, 16)]
    loaded = cached_model(str(tiny_model_dir))  # one model object: graphs dynamo compiled for it are reused
    eager = _engine(tiny_model_dir, method, False, loaded=loaded, **spec)
    assert eager.runner.compiled is None
    compiled = _engine(tiny_model_dir, method, True, loaded=loaded, **spec)
    assert compiled.runner.compiled is not None
    want = [o.token_ids for o in eager.generate(PROMPTS, params)]
    got = compiled.generate(PROMPTS, params)
    assert [o.token_ids for o in got] == want
    assert all(o.finish_reason == "length" for o in got)
    shapes = compiled.runner.compiled.shapes  # (padded batch, padded rows) that went through torch.compile
    assert {b for b, _ in shapes} >= {1, 2, 4}, shapes
    if method == "draft_model":  # verification rows (1 + 3 drafts) through the compiled step
        assert any(q == 4 for _, q in shapes) and compiled.stats.num_accepted_tokens > 0
        assert compiled.proposer.runner.compiled.shapes  # the draft's forwards went through it too


def test_warm_up_compiles_the_usual_shapes_before_requests(tiny_model_dir, monkeypatch):
    """LLMEngine.warm_up (the verifier deployment calls it): every batch bucket at 1 row and at the
    verification's rows is compiled before the first request, which then compiles nothing new;
    the dummy sequences leave nothing behind. (Graphs counted as dynamo makes them: traced with
    aot_eager, no inductor build.)"""
    import torch._dynamo
    from torch._dynamo.utils import counters

    from rayspec.model.compiled import CompiledForward

    monkeypatch.setattr(CompiledForward, "backend", "aot_eager")

    engine = _engine(tiny_model_dir, "draft_model", True, draft_model=str(tiny_model_dir))
    assert engine._warmed_up and engine.warm_up() == []  # done when the engine was built, once
    assert engine.runner.compiled.shapes == {(1, 1), (2, 1), (4, 1), (1, 4), (2, 4), (4, 4)}
    assert engine.kv.num_free_slots == engine.num_slots
    assert engine.kv.num_free_blocks == engine.num_blocks  # the dummy sequences left nothing behind
    draft = engine.proposer.runner.compiled  # the draft's decode-shaped forwards compile as they come
    graphs, warmed, drafted = counters["stats"]["unique_graphs"], set(engine.runner.compiled.shapes), set(draft.shapes)
    out = engine.generate(PROMPTS[:2], SamplingParams(temperature=0.0, max_tokens=70, ignore_eos=True))
    assert all(len(o.token_ids) == 70 for o in out)  # past a 64-key bucket too: keys are dynamic
    # the last steps' shorter drafts (rows 1 + 1) are padded to the warmed 4 rows: no target graph is new
    # (before: (2, 2) compiled mid-generation)
    new = engine.runner.compiled.shapes - warmed
    assert not new, new
    new_draft = draft.shapes - drafted
    assert new_draft and {b for b, _ in new_draft} <= {1, 2}, new_draft
    assert graphs < counters["stats"]["unique_graphs"] <= graphs + len(new) + len(new_draft)
    assert _engine(tiny_model_dir, "none", False).warm_up() == []


@pytest.mark.parametrize("compiled_faster", [True, False])
def test_default_keeps_the_compiled_step_only_where_it_measures_faster(tiny_model_dir, monkeypatch, compiled_faster):
    """compile left to its default on a device where it may pay (CUDA; here CPU made to take that
    path): the engine times a decode forward both ways and keeps the faster."""
    import rayspec.model.compiled

    monkeypatch.setitem(rayspec.model.compiled.COMPILE_BY_DEFAULT, "cpu", True)
    timings = {False: 0.002, True: 0.001 if compiled_faster else 0.003}
    monkeypatch.setattr(LLMEngine, "_time_decode", lambda self, static, repeats=10: timings[static])
    engine = _engine(tiny_model_dir, "none", None)
    assert engine.compile_timings == {"eager_s": 0.002, "compiled_s": timings[True]}
    assert (engine.runner.compiled is not None) == compiled_faster == engine.compile
    got = engine.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    want = _engine(tiny_model_dir, "none", False).generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=8,
                                                                                     ignore_eos=True))
    assert [o.token_ids for o in got] == [o.token_ids for o in want]


def test_time_decode_measures_both_paths(tiny_model_dir, monkeypatch):
    """_time_decode(static) times `repeats` one-token forwards of the path asked for, per forward, with
    the first calls (which compile) left out, and leaves no sequence behind. A clock that each forward
    moves by a cost of its path (eager 2 ms, compiled 3 ms, but 1 s for the first two calls of each,
    as a compile would) gives exact figures; a timer that counted the wrong calls, the wrong path or
    the total would not."""
    import types

    import rayspec.engine.warm_up
    from rayspec.model.compiled import CompiledForward

    monkeypatch.setattr(CompiledForward, "backend", "aot_eager")  # the timer's logic, not inductor's build
    engine = _engine(tiny_model_dir, "none", True, loaded=cached_model(str(tiny_model_dir)))
    now, calls = [0.0], []
    forward = engine._target_forward

    def timed_forward(seq_ids, token_lists, **kwargs):
        calls.append(kwargs["static"])
        now[0] += 1.0 if len(calls) % 5 in (1, 2) else (0.003 if kwargs["static"] else 0.002)
        return forward(seq_ids, token_lists, **kwargs)

    monkeypatch.setattr(engine, "_target_forward", timed_forward)
    monkeypatch.setattr(rayspec.engine.warm_up, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))
    graph_calls, graph = [], engine.runner.compiled.fn  # the compiled step's own calls
    monkeypatch.setattr(engine.runner.compiled, "fn", lambda *a, **kw: graph_calls.append(1) or graph(*a, **kw))
    eager = engine._time_decode(False, repeats=3)
    assert calls == [False] * 5 and not graph_calls  # eager: the compiled step never ran
    compiled = engine._time_decode(True, repeats=3)
    assert calls[5:] == [True] * 5 and len(graph_calls) == 5  # compiled: every forward through it
    assert eager == pytest.approx(0.002) and compiled == pytest.approx(0.003)
    assert engine.kv.num_free_blocks == engine.num_blocks and engine.kv.num_free_slots == engine.num_slots


def test_every_verification_bucket_up_to_max_num_seqs_is_compiled(tiny_model_dir):
    """Issue #50 (e): the compiled step takes a verification of max_num_seqs sequences x (1 + k) rows
    (bucketed), not only 64 padded rows: at max_num_seqs 32 and k 8, a batch of 32 verifying 9 rows fits
    (512 padded rows; before: anything past 64 rows ran eager), a batch of 33 does not; never below 64."""
    from rayspec.engine.warm_up import verification_rows
    from rayspec.model.compiled import MAX_ROWS, CompiledForward

    model = cached_model(str(tiny_model_dir))[0]
    assert verification_rows(32, 8) == 512 and verification_rows(2, 4) == MAX_ROWS
    step = CompiledForward(model, next(model.parameters()).device, verification_rows(32, 8))
    assert step.fits(32, 9) and step.fits(5, 9) and not step.fits(33, 9) and not step.fits(32, 17)
    engine = _engine(tiny_model_dir, "none", False)  # (eager here: the engine sizes its runner alike)
    assert engine.runner.max_compiled_rows == verification_rows(engine.config.max_num_seqs, engine.max_k)


def test_warm_up_compiles_the_row_buckets_a_large_batch_is_not_padded_to(tiny_model_dir, monkeypatch):
    """rayspec.model.compiled.verify_rows: a verification shorter than 1 + k (bucketed) is padded to it
    while bucket(batch) x those rows stay within PAD_ROWS (64), and past that takes its own row bucket,
    which the warm-up then compiles too: at max_num_seqs 32 and k 3 (4 rows), every batch bucket at 1
    and 4 rows, and at 2 rows only batch 32 (16 x 4 = 64 pads; 32 x 4 = 128 does not). Greedy output
    of a full batch whose requests end at different steps then compiles nothing new."""
    from rayspec.model.compiled import PAD_ROWS, CompiledForward, verify_rows

    assert PAD_ROWS == 64
    assert [verify_rows(b, q, 4) for b, q in ((1, 1), (1, 2), (3, 3), (16, 2), (32, 2), (32, 3), (32, 1))] == \
        [1, 4, 4, 4, 2, 4, 1]
    assert verify_rows(4, 2, 1) == 2  # a runner without a verification's bucket (a proposer's): its own
    monkeypatch.setattr(CompiledForward, "backend", "aot_eager")
    loaded = cached_model(str(tiny_model_dir))
    config = EngineConfig(model=str(tiny_model_dir), max_model_len=64, max_num_seqs=32, kv_cache_memory_gb=0.05,
                          compile=True, speculative=SpeculativeConfig(method="ngram", num_speculative_tokens=3,
                                                                      adaptive=False))
    engine = LLMEngine(config, model=loaded[0], tokenizer=loaded[1])
    batches = [1, 2, 4, 8, 16, 32]
    assert engine.runner.compiled.shapes == {(b, 1) for b in batches} | {(b, 4) for b in batches} | {(32, 2)}
    warmed = set(engine.runner.compiled.shapes)
    prompts = [[5 + i % 7, 9, 5 + i % 7, 9, 5 + i % 7] for i in range(32)]  # repeats: n-gram drafts
    params = [SamplingParams(temperature=0.0, max_tokens=3 + i % 9, ignore_eos=True) for i in range(32)]
    got = engine.generate(prompts, params)
    want = LLMEngine(dataclasses_replace(config, compile=False), model=loaded[0], tokenizer=loaded[1]).generate(
        prompts, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert engine.stats.num_draft_tokens > 0
    assert engine.runner.compiled.shapes == warmed
