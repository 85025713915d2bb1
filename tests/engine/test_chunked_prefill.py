"""Chunked prefill (EngineConfig.max_num_batched_tokens): long prompts go through the target in
chunks within a per-step token budget, interleaved with the running requests' verification, and
nothing changes in what is generated. Also: a forward that fails fails only the request that
caused it."""

from __future__ import annotations

import random
import time
from pathlib import Path

import pytest
import torch

from conftest import make_tiny_model_dir
from engine_utils import cached_model, make_engine, run_to_completion, submit_all
from rayspec.eagle.checkpoint import save_eagle_head
from rayspec.model.batch_layout import catch_up_pieces, prefill_groups
from rayspec.sampling.sampler import SamplingParams

VOCAB, LAYERS, HIDDEN = 256, 4, 64
_rng = random.Random(7)
# short and long prompts, the long ones several chunks of the budgets below; repetitive enough for n-gram hits
PROMPTS = [[_rng.randrange(VOCAB) for _ in range(n)] for n in (5, 37, 3, 90, 12, 61)]
PROMPTS[3] = PROMPTS[3][:30] * 3
GREEDY = SamplingParams(temperature=0.0, max_tokens=24)


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory) -> Path:
    return make_tiny_model_dir(tmp_path_factory.mktemp("chunk-target") / "model", seed=5, num_layers=LAYERS,
                               hidden=HIDDEN, vocab_size=VOCAB, with_tokenizer=False)


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory) -> Path:
    return make_tiny_model_dir(tmp_path_factory.mktemp("chunk-draft") / "model", seed=6, num_layers=1,
                               hidden=HIDDEN, vocab_size=VOCAB, with_tokenizer=False)


@pytest.fixture(scope="module")
def target(target_dir):
    return cached_model(str(target_dir))


@pytest.fixture(scope="module")
def target_only(target_dir, target) -> list[list[int]]:
    """Target-only greedy outputs of PROMPTS, 24 tokens each."""
    engine = make_engine(target_dir, "none", loaded=target)
    return [o.token_ids for o in engine.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=24))]


@pytest.fixture(scope="module")
def head_dir(target_dir, target_only, tmp_path_factory) -> Path:
    """An oracle head (eagle_utils.oracle_head): it drafts the target's greedy continuations of PROMPTS,
    so accepted tree paths (and the head's features of accepted tokens) meet chunked prefill."""
    from eagle_utils import oracle_head

    head = oracle_head(target_dir, LAYERS, HIDDEN, [p[-1:] + r for p, r in zip(PROMPTS, target_only)])
    return save_eagle_head(head, tmp_path_factory.mktemp("chunk-head") / "head", dtype=torch.float32)


def _engine(target_dir, target, method, budget, draft_dir=None, head_dir=None, **kw):
    spec = {}
    if method == "draft_model":  # the target's first 3 of 4 layers: often right, not always
        spec.update(draft_model=str(target_dir), draft_num_layers=3)
    elif method == "eagle3":
        # adaptive off: long accepted tree paths are asserted (mean accepted length > 1.5), and the
        # planner cut the oracle head's budgets (accepted length 1.19 with it on)
        spec.update(draft_model=str(head_dir), eagle_topk=2, tree_max_batch=8, adaptive=False)
    return make_engine(target_dir, method, k=4, loaded=target, max_num_batched_tokens=budget, **spec, **kw)


def _spy_target_tokens(engine, prefill_only: bool = False) -> list[list[tuple[int, int]]]:
    """Per step, the (real tokens, padded rows x longest) of every target forward (or only the
    prefill forwards)."""
    steps: list[list[tuple[int, int]]] = []
    forward, step = engine.runner.forward_hidden, engine.step

    def spy_forward(seq_ids, token_lists, trees=None, packed=False, **kw):
        if not (prefill_only and engine._requests[seq_ids[0]].prefilled):
            lengths = [len(t) for t in token_lists]
            steps[-1].append((sum(lengths), len(lengths) * max(lengths)))
        return forward(seq_ids, token_lists, trees=trees, packed=packed, **kw)

    def spy_step():
        steps.append([])
        return step()

    engine.runner.forward_hidden, engine.step = spy_forward, spy_step
    return steps


def _same_logprobs(got, ref) -> None:
    assert [t.token_id for t in got] == [t.token_id for t in ref]
    for a, b in zip(got, ref):  # the same rows computed in other batch shapes: float32 rounding only
        assert (a.logprob is None) == (b.logprob is None) and (a.logprob is None or abs(a.logprob - b.logprob) < 1e-4)


# ---- exactness ------------------------------------------------------------------------------

@pytest.mark.parametrize("method", ["none", "ngram", "draft_model", "eagle3"])
def test_chunked_prefill_changes_nothing(target_dir, target, draft_dir, head_dir, target_only, method):
    """Greedy outputs, logprobs and prompt logprobs with small budgets (prompts in 2-12 chunks,
    requests joining mid-decode) equal those of whole-prompt prefill, token for token."""
    params = SamplingParams(temperature=0.0, max_tokens=24, logprobs=2, prompt_logprobs=1)
    ref_engine = _engine(target_dir, target, method, None, draft_dir, head_dir)
    reference = ref_engine.generate(PROMPTS, params)
    for budget in (16, 29):
        engine = _engine(target_dir, target, method, budget, draft_dir, head_dir)
        steps = _spy_target_tokens(engine)
        ids = [engine.add_request(p, params) for p in PROMPTS[:2]]
        done = {}
        for _ in range(3):
            done.update({o.request_id: o for o in engine.step() if o.finished})
        ids += [engine.add_request(p, params) for p in PROMPTS[2:]]
        run_to_completion(engine, done)
        for i, ref in zip(ids, reference):
            got = done[i]
            assert got.token_ids == ref.token_ids, (method, budget, i)
            _same_logprobs(got.logprobs, ref.logprobs)
            _same_logprobs(got.prompt_logprobs, ref.prompt_logprobs)
        # the long prompts really were split: some step prefilled a chunk shorter than its prompt
        assert any(0 < n < len(PROMPTS[3]) and padded <= budget for forwards in steps for n, padded in forwards)
    assert [r.token_ids for r in reference] == target_only
    if method in ("ngram", "draft_model"):  # drafts both accepted and rejected
        assert 0 < ref_engine.stats.num_accepted_tokens < ref_engine.stats.num_draft_tokens
    if method == "eagle3":  # the oracle head: most drafted paths accepted (mean accepted length > 1.5)
        stats = engine.stats
        print(method, stats.as_dict())
        assert stats.num_accepted_tokens > 1.5 * stats.num_drafts, stats.as_dict()


def test_budget_holds_per_step_and_per_forward(target_dir, target):
    """A step prefills at most max_num_batched_tokens prompt tokens, no prefill forward's padded
    layout (rows x longest) exceeds it, and prompts are cut at fixed places (multiples of it)."""
    budget = 24
    engine = _engine(target_dir, target, "ngram", budget)
    steps = _spy_target_tokens(engine, prefill_only=True)
    cuts: dict[str, list[int]] = {}
    prefill = engine._prefill_forward

    def spy_batch(chunks):
        for seq, n in chunks:
            cuts.setdefault(seq.request_id, []).append(engine.kv.cached_len(seq.request_id) + n)
        return prefill(chunks)

    engine._prefill_forward = spy_batch
    ids = [engine.add_request(p, GREEDY) for p in PROMPTS[:2]]
    engine.step()
    ids += [engine.add_request(p, GREEDY) for p in PROMPTS[2:]]
    done = run_to_completion(engine)
    assert all(done[i].num_output_tokens == GREEDY.max_tokens or done[i].finish_reason == "stop" for i in ids)
    assert max(sum(n for n, _ in forwards) for forwards in steps) <= budget
    assert max(padded for forwards in steps for _, padded in forwards) <= budget
    for i, prompt in zip(ids, PROMPTS):  # every cut a multiple of the budget, the last the prompt's end
        want = list(range(budget, len(prompt), budget)) + [len(prompt)]
        assert cuts[i] == want, (i, cuts[i], want)
    # the 90-token prompt alone needs at least 90 / 24 steps of prefill
    assert len(steps) >= 4


def test_eagle_catch_up_in_chunks_drafts_the_same(target_dir, target, head_dir):
    """The head's first catch-up over a long prompt goes in chunks of the budget (its attention
    sees one chunk at a time); its drafts equal those of one whole catch-up."""
    drafts = {}
    for budget in (None, 16):
        engine = _engine(target_dir, target, "eagle3", budget, head_dir=head_dir)
        seen, propose = [], engine.proposer.propose
        runner, sizes = engine.proposer.runner, []

        def spied(call, _sizes=sizes):  # rows per forward, or per keys-alone write (ModelRunner.write_kv)
            def run(ids, toks, *a, **kw):
                _sizes.append(sum(len(t) for t in toks))
                return call(ids, toks, *a, **kw)
            return run

        def spy(requests, _propose=propose, _seen=seen):
            out = _propose(requests)
            _seen.append([(d.tokens, d.parents) for d in out])
            return out

        engine.proposer.propose = spy
        runner.forward_hidden, runner.write_kv = spied(runner.forward_hidden), spied(runner.write_kv)
        engine.generate([PROMPTS[3]], GREEDY)
        drafts[budget] = seen
        if budget:
            assert max(sizes) <= budget
        else:
            assert max(sizes) >= len(PROMPTS[3]) - 2  # (the last row through the layer on its own)
    assert drafts[None] == drafts[16]


def test_catch_up_pieces():
    assert catch_up_pieces([3, 5], None) == [[(0, 0, 3), (1, 0, 5)]]
    assert catch_up_pieces([3, 5], 10) == [[(0, 0, 3), (1, 0, 5)]]
    assert catch_up_pieces([3, 9], 4) == [[(0, 0, 3)], [(1, 0, 4)], [(1, 4, 8)], [(1, 8, 9)]]
    # a wave of short catch-ups shares forwards (each row was once a forward of its own: 256 of them)
    wave = catch_up_pieces([9] * 256, 2048)
    assert len(wave) == 2 and sorted(i for p in wave for i, _, _ in p) == list(range(256))
    # mixed: every row's tokens exactly once and in order, no forward over the budget
    lengths = [5, 40, 0, 17, 3, 64, 11, 2, 33]
    pieces = catch_up_pieces(lengths, 32)
    for p in pieces:
        assert len({i for i, _, _ in p}) == len(p) and len(p) * max(hi - lo for _, lo, hi in p) <= 32
    for i, n in enumerate(lengths):
        spans = [(lo, hi) for p in pieces for j, lo, hi in p if j == i]
        assert spans[0][0] == 0 and spans[-1][1] == n and all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
    assert len(pieces) < sum(max(1, -(-n // 32)) for n in lengths)


def test_prefill_groups_respect_the_padded_cap():
    lengths = [10, 10, 10, 10]
    assert prefill_groups(lengths, 1024) == [[0, 1, 2, 3]]
    groups = prefill_groups(lengths, 1024, max_padded_tokens=20)
    assert sorted(i for g in groups for i in g) == [0, 1, 2, 3]
    assert all(len(g) * 10 <= 20 for g in groups)
    assert prefill_groups([30], 24, max_padded_tokens=20) == [[0]]  # one row always goes


# ---- interleaving ---------------------------------------------------------------------------

def test_running_stream_keeps_its_tokens_while_a_long_prompt_prefills(tmp_path_factory):
    """A request decoding while a 1,500-token prompt arrives gets tokens in every step of that
    prefill (each step one chunk); its largest inter-token gap stays under two chunks' time.
    Unchunked, the same prompt holds it up for the whole prefill: one forward computes all 1,500
    tokens (counted), and the stream's gap over that step is over twice a chunk step's time."""
    model_dir = make_tiny_model_dir(tmp_path_factory.mktemp("chunk-long") / "model", seed=9, num_layers=4,
                                    hidden=128, vocab_size=VOCAB, with_tokenizer=False)
    loaded = cached_model(str(model_dir))
    long_prompt = [random.Random(3).randrange(VOCAB) for _ in range(1500)]
    params = SamplingParams(temperature=0.0, max_tokens=400, ignore_eos=True)
    results = {}
    for budget in (128, None):
        engine = make_engine(model_dir, "none", k=0, loaded=loaded, max_model_len=2048,
                             max_num_batched_tokens=budget)
        forward, step_tokens = engine.runner.forward_hidden, [0]

        def counted(seq_ids, token_lists, *args, **kwargs):  # the largest target forward this step
            step_tokens[0] = max(step_tokens[0], sum(len(t) for t in token_lists))
            return forward(seq_ids, token_lists, *args, **kwargs)

        engine.runner.forward_hidden = counted
        stream = engine.add_request([1, 2, 3, 4], params)
        for _ in range(3):
            engine.step()
        long_id = engine.add_request(long_prompt, SamplingParams(temperature=0.0, max_tokens=2))
        gaps, chunk_steps, tokens, last = [], [], [], time.perf_counter()
        while True:
            started, step_tokens[0] = time.perf_counter(), 0
            outs = {o.request_id: o for o in engine.step()}
            now = time.perf_counter()
            tokens.append(step_tokens[0])
            long_started = long_id in outs
            if stream in outs:
                gaps.append(now - last)
                last = now
            if not long_started:
                chunk_steps.append(now - started)
            else:
                break
        results[budget] = (gaps, chunk_steps, tokens)
    gaps, chunk_steps, tokens = results[128]
    # prefill took ceil(1500 / 128) steps, and the stream got a token in each of them
    assert len(chunk_steps) >= 1500 // 128
    assert len(gaps) >= len(chunk_steps)
    assert max(tokens) <= 128 and sum(tokens) >= 1500  # (the stream's decode row is a forward of its own)
    assert max(gaps) < 2 * max(chunk_steps)
    # unchunked: one step held the whole prompt, and the stream waited for all of it
    unchunked_gaps, unchunked_chunk_steps, unchunked_tokens = results[None]
    assert unchunked_chunk_steps == [] and unchunked_tokens[-1] >= 1500, unchunked_tokens
    assert max(unchunked_gaps) > 2 * max(chunk_steps)


# ---- a failing request fails alone ----------------------------------------------------------

POISON = 255  # a token that makes the target's forward raise when it is in a batch of more than one


def _poison_forward(engine, phase: str):
    """Make target forwards raise (as an out-of-memory would) whenever a row holds POISON:
    during prefill (phase 'prefill') or during verification ('decode')."""
    forward = engine.runner.forward_hidden

    def poisoned(seq_ids, token_lists, trees=None, packed=False, **kw):
        prefill = all(not engine._requests[s].prefilled for s in seq_ids)
        # in decode, from its fourth token on: the others' proposer state is mid-sequence by then
        hit = any(POISON in engine._requests[s].prompt_token_ids
                  and (phase == "prefill" or engine._requests[s].num_output_tokens >= 3) for s in seq_ids)
        if hit and (phase == "prefill") == prefill:
            raise torch.OutOfMemoryError("simulated: out of memory")
        return forward(seq_ids, token_lists, trees=trees, packed=packed, **kw)

    engine.runner.forward_hidden = poisoned


@pytest.mark.parametrize("phase", ["prefill", "decode"])
@pytest.mark.parametrize("method", ["ngram", "eagle3"])
def test_a_failing_request_fails_alone(target_dir, target, head_dir, method, phase, caplog):
    prompts = [p for p in PROMPTS if POISON not in p]
    reference = _engine(target_dir, target, method, 64, head_dir=head_dir).generate(prompts, GREEDY)
    engine = _engine(target_dir, target, method, 64, head_dir=head_dir)
    _poison_forward(engine, phase)
    ids = [engine.add_request(p, GREEDY) for p in prompts[:3]]
    bad = engine.add_request([7, POISON, 9, 11], GREEDY)
    ids += [engine.add_request(p, GREEDY) for p in prompts[3:]]
    done = run_to_completion(engine)
    assert done[bad].finish_reason == "error" and "out of memory" in done[bad].error
    for i, ref in zip(ids, reference):
        assert done[i].error is None and done[i].token_ids == ref.token_ids, i
    assert not engine.has_unfinished_requests() and engine.kv.num_free_slots == engine.num_slots
    assert "retrying them in halves" in caplog.text
    assert "decodes without drafts" not in caplog.text  # the EAGLE head rewound: the others still draft


def _state(engine, seqs) -> list:
    """What a decode step may change of each sequence and of the target's KV books."""
    feats = [torch.cat(s.features) if s.features else None for s in seqs]
    return [(list(s.token_ids), engine.kv.cached_len(s.request_id), list(engine.kv.table(s.request_id)),
             f, s.features_start, s.num_steps, s.num_draft_tokens) for s, f in zip(seqs, feats)]


@pytest.mark.parametrize("method", ["ngram", "eagle3"])
def test_a_failure_before_commit_leaves_every_sequence_as_it_was(target_dir, target, head_dir, method):
    """propose -> verify change no sequence and no KV book (the decode step is a transaction):
    when the step fails after the verification's forward wrote its rows, every sequence, its
    cached length, block table and unsent features are as before, with no rollback code; the
    step runs again and the outputs are those of an engine that never failed."""
    prompts = [p for p in PROMPTS if POISON not in p][:3]
    reference = _engine(target_dir, target, method, 64, head_dir=head_dir).generate(prompts, GREEDY)
    engine = _engine(target_dir, target, method, 64, head_dir=head_dir)
    ids = [engine.add_request(p, GREEDY) for p in prompts]
    while engine.waiting or not all(s.prefilled and s.num_output_tokens >= 3 for s in engine.running):
        assert not [out for out in engine.step() if out.finished]  # (the prompts ask for more)
    seqs = [s for s in engine.running if s.prefilled]
    before = _state(engine, seqs)
    verify, verified = engine._verify, []

    def failing(proposal):
        verified.append(verify(proposal))  # the forward ran and wrote its rows
        raise RuntimeError("simulated: fails past the verification's forward")

    engine._verify = failing
    with pytest.raises(RuntimeError, match="simulated"):
        engine._decode_prepare(seqs)
    assert verified and sum(len(e) for e in verified[0].emitted) > len(seqs) - 1
    after = _state(engine, seqs)
    for b, a in zip(before, after):
        assert b[:3] == a[:3] and b[4:] == a[4:]
        assert (b[3] is None and a[3] is None) or torch.equal(b[3], a[3])
    engine._verify = verify
    done = run_to_completion(engine)
    for i, ref in zip(ids, reference):
        assert done[i].token_ids == ref.token_ids, i


def test_a_failure_in_commit_fails_its_batch_without_retry(target_dir, target, caplog):
    """Past the commit point sequences may have taken tokens: the batch's requests fail (finish
    reason "error"), nothing is retried in halves, the engine goes on and frees every slot."""
    engine = _engine(target_dir, target, "ngram", 64)
    ids = [engine.add_request(p, GREEDY) for p in PROMPTS[:2]]
    while engine.waiting or not all(s.prefilled for s in engine.running):
        engine.step()
    commit = engine._commit

    def failing(proposal, verdict):
        commit(proposal, verdict)
        raise RuntimeError("simulated: fails in commit")

    engine._commit = failing
    done = {out.request_id: out for out in engine.step() if out.finished}
    engine._commit = commit
    done = run_to_completion(engine, done)
    assert all(done[i].finish_reason == "error" and "fails in commit" in done[i].error for i in ids), done
    assert "retrying them in halves" not in caplog.text
    assert not engine.has_unfinished_requests() and engine.kv.num_free_slots == engine.num_slots


# ---- attention kernels ----------------------------------------------------------------------

def test_masked_grouped_query_attention_stays_fused_on_cpu():
    """A prefill chunk's layout (grouped-query heads, an additive mask over cached + new keys)
    runs SDPA's fused CPU kernel, not the math path that materializes [B, heads, Q, kv_len]."""
    from torch.nn.attention import SDPBackend
    from rayspec.model.batch_layout import additive_mask
    q = torch.randn(1, 9, 256, 64)
    k, v = torch.randn(1, 3, 1024, 64), torch.randn(1, 3, 1024, 64)
    positions = 768 + torch.arange(256)
    mask = additive_mask((torch.arange(1024)[None, :] <= positions[:, None])[None, None], torch.float32)
    choice = torch._fused_sdp_choice(q, k, v, mask, 0.0, False, enable_gqa=True)
    assert choice != SDPBackend.MATH.value, choice


def test_repeating_kv_heads_is_the_same_attention():
    """The CUDA path for long masked chunks (repeat the KV heads, no enable_gqa) computes what the
    grouped-query call does; checked here on CPU, where both run."""
    from rayspec.model.batch_layout import additive_mask
    from rayspec.model.native import attention, repeats_kv_heads
    torch.manual_seed(0)
    q = torch.randn(2, 8, 130, 64)
    k, v = torch.randn(2, 2, 300, 64), torch.randn(2, 2, 300, 64)
    mask = additive_mask((torch.arange(300)[None, :] <= 170 + torch.arange(130)[:, None])[None, None].expand(2, 1, -1, -1),
                         torch.float32)
    assert torch.allclose(attention(q, k, v, mask, repeat_kv=True), attention(q, k, v, mask, repeat_kv=False), atol=1e-5)
    assert not repeats_kv_heads(q, k, mask)  # on CPU: never


# ---- memory ---------------------------------------------------------------------------------

def test_long_prefill_peak_memory_is_one_chunk(smollm2):
    """A 3,000-token prompt through SmolLM2's shapes (its first 2 layers), each run in a fresh
    process with the KV cache resident beforehand: chunked (256), the prefill's peak above the
    weights and cache stays within the planner's estimate of one chunk's activations; unchunked,
    it is many times larger. (The recorded 8,000-token, 30-layer figures: docs/benchmarks-history.md.)"""
    import importlib.util
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "prefill_memory.py"
    spec = importlib.util.spec_from_file_location("prefill_memory", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    chunked = bench.run_isolated(smollm2, 3000, 256, num_layers=2, threads=1)
    whole = bench.run_isolated(smollm2, 3000, None, num_layers=2, threads=1)
    assert chunked["steps"] >= 3000 // 256
    assert chunked["peak_above_baseline_mib"] <= chunked["estimate_mib"], chunked
    assert whole["peak_above_baseline_mib"] > 4 * max(chunked["peak_above_baseline_mib"], 8.0), (chunked, whole)


def test_engine_loop_delivers_one_requests_failure_to_that_request_only(target_dir, target):
    """Served: the failed request's stream ends with the engine's error (the ingress's 500), the
    others are delivered in full, and the loop counts it (`num_failed` in /v1/stats)."""

    from deployments.replicas.engine_loop import EngineLoop

    def factory():
        engine = _engine(target_dir, target, "ngram", 64)
        _poison_forward(engine, "prefill")
        return engine

    loop = EngineLoop(factory)
    loop.wait_ready(60)
    prompts = {"a": PROMPTS[0], "bad": [7, POISON, 9], "b": PROMPTS[2]}
    got = submit_all(loop, prompts, GREEDY, timeout=60)
    try:
        assert isinstance(got["bad"][-1], RuntimeError) and "out of memory" in str(got["bad"][-1])
        reference = _engine(target_dir, target, "ngram", 64).generate([PROMPTS[0], PROMPTS[2]], GREEDY)
        assert [got["a"][-1].token_ids, got["b"][-1].token_ids] == [r.token_ids for r in reference]
        assert loop.num_failed == 1 and loop.call(lambda engine: engine.num_running) == 0
    finally:
        loop.shutdown()
