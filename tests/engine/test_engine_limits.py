"""Engine limits: request validation, a KV budget smaller than the load, abort."""

from __future__ import annotations

import pytest

from engine_utils import cached_model, make_engine, run_alone, run_to_completion
from rayspec.engine.llm_engine import InvalidRequestError
from rayspec.model.kv_cache import KVCache
from rayspec.sampling.sampler import SamplingParams

MAX_LEN = 64


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return cached_model(str(tiny_model_dir))


@pytest.fixture
def engine(tiny_model_dir, tiny):
    return make_engine(tiny_model_dir, "ngram", loaded=tiny, max_model_len=MAX_LEN)


@pytest.mark.parametrize("prompt,params,match", [
    (list(range(3, 3 + MAX_LEN + 10)), SamplingParams(max_tokens=1), "max_model_len|at most"),  # longer
    (list(range(3, 3 + MAX_LEN)), SamplingParams(max_tokens=1), "at most 64"),  # no room for one token
    (list(range(3, 3 + MAX_LEN - 10)), SamplingParams(max_tokens=11), "exceeds max_model_len"),
    ([], SamplingParams(), "empty"),
    ([5, 10**6], SamplingParams(), r"token ids must be in \[0, 8192\)"),
    ([5, -1], SamplingParams(), "token ids"),
])
def test_invalid_requests_raise(engine, prompt, params, match):
    with pytest.raises(InvalidRequestError, match=match):
        engine.add_request(prompt, params)
    assert not engine.has_unfinished_requests()


def test_prompt_that_fits_exactly(engine):
    prompt = list(range(3, 3 + MAX_LEN - 10))
    (out,) = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    assert len(out.token_ids) == 10 and out.finish_reason == "length"
    # max_tokens=None: up to max_model_len
    (out,) = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=None, ignore_eos=True))
    assert len(prompt) + len(out.token_ids) == MAX_LEN and out.finish_reason == "length"


def test_long_text_prompt_raises(engine):
    with pytest.raises(InvalidRequestError, match="max_model_len|at most"):
        engine.add_request("word " * 200, SamplingParams())


def test_duplicate_request_id(engine):
    engine.add_request("hello", SamplingParams(max_tokens=2), request_id="x")
    with pytest.raises(InvalidRequestError, match="already in use"):
        engine.add_request("hello", SamplingParams(max_tokens=2), request_id="x")
    run_to_completion(engine)
    engine.add_request("hello", SamplingParams(max_tokens=2), request_id="x")  # free again once finished


def test_without_tokenizer(tmp_path):
    from conftest import make_tiny_model_dir

    path = make_tiny_model_dir(tmp_path / "m", vocab_size=32, with_tokenizer=False)
    engine = make_engine(path, "ngram", max_model_len=MAX_LEN)
    assert engine.tokenizer is None
    with pytest.raises(InvalidRequestError, match="tokenizer"):
        engine.add_request("text needs a tokenizer")
    with pytest.raises(InvalidRequestError, match="stop strings"):
        engine.add_request([1, 2, 3], SamplingParams(stop=["x"]))
    (out,) = engine.generate([[4, 5, 6, 4, 5]], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    assert len(out.token_ids) == 6 and out.text == ""


@pytest.mark.parametrize("kwargs", [dict(temperature=-1), dict(top_p=0), dict(top_p=1.5), dict(top_k=-2),
                                    dict(max_tokens=0), dict(num_speculative_tokens=-1), dict(stop=[""])])
def test_invalid_sampling_params(kwargs):
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)


def _two_slot_budget_gb(tiny, max_len: int, k: int, draft: bool = False) -> float:
    per_slot = KVCache.bytes_per_token(tiny[0].args, tiny[0].lm_head.weight.dtype) * (max_len + k + 1)
    return 2.5 * per_slot * (2 if draft else 1) / 2**30


@pytest.mark.parametrize("method,spec", [("none", {}), ("ngram", dict(prompt_lookup_min=1)),
                                         ("draft_model", dict(draft_num_layers=1))])
def test_kv_budget_of_two_slots_serves_five_requests(tiny_model_dir, tiny, method, spec):
    k = 3
    budget = _two_slot_budget_gb(tiny, MAX_LEN, k, draft=method == "draft_model")
    engine = make_engine(tiny_model_dir, method, k=k, loaded=tiny, max_model_len=MAX_LEN,
                         kv_cache_memory_gb=budget, **spec)
    assert engine.kv_plan.tokens >= 2 * engine.kv.capacity  # two of max_model_len; short ones share it
    prompts = ["The cat sat on the mat.", "a b c a b c", "Hello", "one two one two", "x"]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in prompts]
    done, most_running = {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
        most_running = max(most_running, engine.num_running)
        assert engine.num_running + engine.num_waiting + len(done) == len(prompts)
    assert most_running >= 2
    alone = run_alone(make_engine(tiny_model_dir, "none", loaded=tiny, max_model_len=MAX_LEN), prompts, params)
    assert [done[i].token_ids for i in ids] == alone


def test_kv_budget_too_small_for_one_sequence(tiny_model_dir, tiny):
    with pytest.raises(ValueError, match="cannot hold"):
        make_engine(tiny_model_dir, loaded=tiny, max_model_len=MAX_LEN, kv_cache_memory_gb=1e-9)


@pytest.mark.parametrize("method,spec", [("ngram", dict(prompt_lookup_min=1)),
                                         ("draft_model", dict(draft_num_layers=1))])
def test_abort_frees_the_slot(tiny_model_dir, tiny, method, spec):
    k = 3
    budget = _two_slot_budget_gb(tiny, MAX_LEN, k, draft=method == "draft_model")
    engine = make_engine(tiny_model_dir, method, k=k, loaded=tiny, max_model_len=MAX_LEN, max_num_seqs=2,
                         kv_cache_memory_gb=budget, **spec)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    prompts = ["a b c a b c", "The cat sat on the mat.", "Hello there"]
    a, b, c = (engine.add_request(p, params) for p in prompts)
    engine.step()
    engine.step()
    assert (engine.num_running, engine.num_waiting, engine.kv.num_free_slots) == (2, 1, 0)
    assert engine.abort_request(a)
    assert (engine.num_running, engine.kv.num_free_slots) == (1, 1)
    assert not engine.kv.has(a)
    if method == "draft_model":
        assert not engine.proposer.runner.kv.has(a)
    assert not engine.abort_request(a)  # unknown now
    assert not engine.abort_request("never-added")
    outs = engine.step()  # c is admitted into the freed slot
    assert engine.kv.has(c) and engine.num_waiting == 0
    assert a not in {o.request_id for o in outs}
    done = run_to_completion(engine, {o.request_id: o for o in outs if o.finished})
    assert set(done) == {b, c}
    alone = run_alone(make_engine(tiny_model_dir, "none", loaded=tiny, max_model_len=MAX_LEN), prompts, params)
    assert done[b].token_ids == alone[1] and done[c].token_ids == alone[2]
    assert engine.kv.num_free_slots == 2


def test_abort_waiting_request(engine):
    ids = [engine.add_request("hello", SamplingParams(max_tokens=4)) for _ in range(3)]
    assert engine.num_waiting == 3
    assert engine.abort_request(ids[1])
    assert engine.num_waiting == 2
    done = run_to_completion(engine)
    assert set(done) == {ids[0], ids[2]}


@pytest.mark.parametrize("method,spec", [("ngram", dict(prompt_lookup_min=1)),
                                         ("draft_model", dict(draft_num_layers=1)),
                                         ("draft_model", dict())])
def test_long_prompt_joins_next_to_a_sequence_near_the_end(tiny_model_dir, tiny_draft_dir, tiny, method, spec):
    """A long prompt joining while another sequence is deep in its context: batched catch-up
    (the draft model pads every row to the longest) must stay inside each row's cache."""
    spec = dict(spec)
    if method == "draft_model" and "draft_num_layers" not in spec:
        spec["draft_model"] = str(tiny_draft_dir)
    engine = make_engine(tiny_model_dir, method, k=3, loaded=tiny, max_model_len=MAX_LEN, **spec)
    params = SamplingParams(temperature=0, max_tokens=None, ignore_eos=True)  # up to max_model_len
    first = list(range(100, 110))
    joiner = list(range(200, 200 + MAX_LEN - 12))
    a = engine.add_request(first, params)
    while len(engine._requests[a].token_ids) < MAX_LEN - 8:
        engine.step()
    b = engine.add_request(joiner, params)
    done = run_to_completion(engine)
    assert len(done[a].token_ids) == MAX_LEN - len(first) and len(done[b].token_ids) == 12
    alone = run_alone(make_engine(tiny_model_dir, "none", loaded=tiny, max_model_len=MAX_LEN), [first, joiner], params)
    assert [done[a].token_ids, done[b].token_ids] == alone


def test_disable_by_batch_size_stops_drafting(tiny_model_dir):
    """No drafts while >= disable_by_batch_size sequences run; outputs still equal the baseline."""
    loaded = cached_model(str(tiny_model_dir))
    prompts = [[5, 6, 7, 5, 6, 7, 5, 6], [9, 10, 9, 10, 9], [11, 12, 13, 11, 12, 13]]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)  # the random model repeats itself late
    base = make_engine(tiny_model_dir, "none", loaded=loaded)
    ref = [o.token_ids for o in base.generate(prompts, params)]
    off = make_engine(tiny_model_dir, "ngram", k=4, loaded=loaded, prompt_lookup_min=1, disable_by_batch_size=2)
    assert [o.token_ids for o in off.generate(prompts, params)] == ref
    assert off.stats.num_draft_tokens == 0  # always >= 2 running together
    drafted = []
    for limit in (2, None):  # one sequence at a time: the limit changes nothing
        eng = make_engine(tiny_model_dir, "ngram", k=4, loaded=loaded, prompt_lookup_min=1, disable_by_batch_size=limit)
        for p, r in zip(prompts, ref):
            assert eng.generate([p], params)[0].token_ids == r
        drafted.append(eng.stats.num_draft_tokens)
    assert drafted[0] == drafted[1] > 0


def test_waiting_queue_bound_refuses_past_it_and_takes_failovers(tiny_model_dir, tiny):
    """max_num_waiting: requests that would wait for a KV slot beyond the bound are refused
    (EngineOverloadedError, the server's 429); the free slots count as room; a resumed request
    (a failover from a lost replica) is always taken; the requests taken are served unchanged."""
    from rayspec.engine.llm_engine import EngineOverloadedError

    engine = make_engine(tiny_model_dir, "ngram", loaded=tiny, max_model_len=MAX_LEN, max_num_seqs=2)
    engine.config.max_num_waiting = 1
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    prompts = [[5 + i, 6, 7, 8] for i in range(5)]
    taken = [engine.add_request(p, params, f"r{i}") for i, p in enumerate(prompts[:3])]  # 2 slots + 1 waiting
    with pytest.raises(EngineOverloadedError, match="max_num_waiting 1"):
        engine.add_request(prompts[3], params, "r3")
    assert "r3" not in engine._requests and engine.num_waiting == 3  # nothing of it was kept
    engine.add_request(prompts[4], params, "resumed", resume_output_ids=[9, 10])  # a failover gets in
    engine.step()  # two run now, two wait: still full
    assert (engine.num_running, engine.num_waiting) == (2, 2)
    with pytest.raises(EngineOverloadedError):
        engine.add_request(prompts[3], params, "r3")
    outputs = run_to_completion(engine)
    alone = make_engine(tiny_model_dir, "none", loaded=tiny, max_model_len=MAX_LEN)
    assert [outputs[rid].token_ids for rid in taken] == run_alone(alone, prompts[:3], params)
    assert "resumed" in outputs
    engine.add_request(prompts[3], params, "r3")  # idle again: taken
    assert [run_to_completion(engine)["r3"].token_ids] == run_alone(alone, prompts[3:4], params)


def test_a_draft_longer_than_asked_is_cut(tiny_model_dir, tiny):
    """A proposer (a remote one: its reply is another process's word) that answers 40 tokens more
    than each request's num_tokens: the engine verifies at most num_tokens of them, so a step
    never takes more KV rows or emits more tokens than it budgeted for; outputs are unchanged."""
    import dataclasses

    from engine_utils import OracleProposer

    prompt, k = [5, 6, 7, 8], 3
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    ref = run_alone(make_engine(tiny_model_dir, "none", loaded=tiny, max_model_len=MAX_LEN), [prompt], params)[0]
    oracle = OracleProposer({tuple(prompt): ref}, k=k, wrong=0)

    class Overlong(OracleProposer):
        def propose(self, requests):
            asked = [r.num_tokens for r in requests]
            drafts = oracle.propose([dataclasses.replace(r, num_tokens=r.num_tokens + 40) for r in requests])
            assert all(len(d.tokens) > n for d, n in zip(drafts, asked) if n)  # really longer than asked
            return drafts

    engine = make_engine(tiny_model_dir, "ngram", k=k, loaded=tiny, max_model_len=MAX_LEN,
                         proposer=Overlong({}, k, 0))
    out = engine.generate([prompt], params)[0]
    assert out.token_ids == ref
    assert out.num_draft_tokens <= k * out.num_steps and out.num_steps >= len(ref) // (k + 1)
