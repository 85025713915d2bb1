"""The compiled step (EngineConfig.compile, rayspec.compiled) on CPU: greedy output equal to the
eager engine's, token for token, for plain decoding and chain verification (drafts accepted, drafts rejected) at batch sizes 1-3
(padded to the buckets 1, 2, 4) with requests finishing at different steps; and its shapes really
went through torch.compile. (On CUDA the same code captures CUDA graphs: benchmarks/gpu_compiled.py.)"""

from __future__ import annotations

import pytest

from rayspec.config import EngineConfig, SpeculativeConfig
from rayspec.engine import LLMEngine
from rayspec.sampling import SamplingParams

PROMPTS = [[5, 17, 99, 3, 42, 8], [7, 7, 7, 12, 30, 31, 32, 33, 5], [100, 4, 64]]


def _engine(model_dir, method, compile, **spec) -> LLMEngine:
    config = EngineConfig(model=str(model_dir), max_model_len=128, max_num_seqs=4, kv_cache_memory_gb=0.05,
                          compile=compile,
                          speculative=SpeculativeConfig(method=method, num_speculative_tokens=3, adaptive=False, **spec))
    return LLMEngine(config)


@pytest.mark.parametrize("method", ["none", "draft_model", "ngram"])
def test_compiled_step_equals_eager(tiny_model_dir, method):
    # the target as its own draft: every draft accepted; n-gram drafts: mostly rejected
    spec = {"draft_model": str(tiny_model_dir)} if method == "draft_model" else {}
    params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in (6, 11, 16)]
    eager = _engine(tiny_model_dir, method, False, **spec)
    assert eager.runner.compiled is None
    compiled = _engine(tiny_model_dir, method, True, **spec)
    assert compiled.runner.compiled is not None
    want = [o.token_ids for o in eager.generate(PROMPTS, params)]
    got = compiled.generate(PROMPTS, params)
    assert [o.token_ids for o in got] == want
    assert all(o.finish_reason == "length" for o in got)
    shapes = compiled.runner.compiled.shapes  # (padded batch, padded rows) that went through torch.compile
    assert {b for b, _ in shapes} >= {1, 2, 4}, shapes
    if method == "draft_model":  # verification rows (1 + 3 drafts) through the compiled step
        assert any(q == 4 for _, q in shapes) and compiled.stats.num_accepted_tokens > 0


def test_warm_up_compiles_the_usual_shapes_before_requests(tiny_model_dir):
    """LLMEngine.warm_up (the verifier deployment calls it): every batch bucket at 1 row and at the
    verification's rows is compiled before the first request, which then compiles nothing new;
    the dummy sequences leave nothing behind."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    engine = _engine(tiny_model_dir, "draft_model", True, draft_model=str(tiny_model_dir))
    assert engine._warmed_up and engine.warm_up() == []  # done when the engine was built, once
    assert engine.runner.compiled.shapes == {(1, 1), (2, 1), (4, 1), (1, 4), (2, 4), (4, 4)}
    assert engine.runner.num_free_slots == engine.num_slots
    assert engine.runner.num_free_blocks == engine.num_blocks  # the dummy sequences left nothing behind
    graphs, warmed = counters["stats"]["unique_graphs"], set(engine.runner.compiled.shapes)
    out = engine.generate(PROMPTS[:2], SamplingParams(temperature=0.0, max_tokens=70, ignore_eos=True))
    assert all(len(o.token_ids) == 70 for o in out)  # past a 64-key bucket too: keys are dynamic
    # only the last steps' shorter drafts (rows 1 + 1, bucket 2) are new, one graph each, no recompiles
    new = engine.runner.compiled.shapes - warmed
    assert new <= {(2, 2)}, new
    assert counters["stats"]["unique_graphs"] == graphs + len(new)
    assert _engine(tiny_model_dir, "none", False).warm_up() == []


@pytest.mark.parametrize("compiled_faster", [True, False])
def test_default_keeps_the_compiled_step_only_where_it_measures_faster(tiny_model_dir, monkeypatch, compiled_faster):
    """compile left to its default on a device where it may pay (CUDA; here CPU made to take that
    path): the engine times a decode forward both ways and keeps the faster."""
    import rayspec.compiled

    monkeypatch.setitem(rayspec.compiled.COMPILE_BY_DEFAULT, "cpu", True)
    timings = {False: 0.002, True: 0.001 if compiled_faster else 0.003}
    monkeypatch.setattr(LLMEngine, "_time_decode", lambda self, static, repeats=10: timings[static])
    engine = _engine(tiny_model_dir, "none", None)
    assert engine.compile_timings == {"eager_s": 0.002, "compiled_s": timings[True]}
    assert (engine.runner.compiled is not None) == compiled_faster == engine.compile
    got = engine.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    want = _engine(tiny_model_dir, "none", False).generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=8,
                                                                                     ignore_eos=True))
    assert [o.token_ids for o in got] == [o.token_ids for o in want]


def test_time_decode_measures_both_paths(tiny_model_dir):
    engine = _engine(tiny_model_dir, "none", True)
    eager, compiled = engine._time_decode(False, repeats=3), engine._time_decode(True, repeats=3)
    assert eager > 0 and compiled > 0
    assert engine.runner.num_free_blocks == engine.num_blocks
