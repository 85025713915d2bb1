"""The slot KV cache: the model matches Hugging Face, rolling back rejected drafts leaves the
cache as if they were never written, and slot compaction keeps every sequence intact."""

from __future__ import annotations

import pytest
import torch

from engine_utils import cached_model, make_engine, run_alone, run_to_completion
from rayspec.model.runner import CacheFullError, make_runner
from rayspec.sampling.sampler import SamplingParams

ATOL = 1e-4


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return cached_model(str(tiny_model_dir))


def fresh_logits(model, tokens: list[int], n_last: int) -> torch.Tensor:
    """Logits of the last n_last positions from a runner that only ever saw `tokens`."""
    runner = make_runner(model, max_model_len=256, num_slots=1, slack=8)
    runner.kv.allocate("fresh")
    return runner.forward(["fresh"], [tokens], last_only=False)[0, -n_last:]


def test_model_matches_huggingface(tiny_model_dir, tiny):
    from transformers import LlamaForCausalLM

    hf = LlamaForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    tokens = [5, 17, 300, 4000, 12, 9, 777, 8000, 3]
    with torch.no_grad():
        expected = hf(torch.tensor([tokens])).logits[0]
    assert torch.allclose(fresh_logits(tiny[0], tokens, len(tokens)), expected, atol=ATOL)


def test_incremental_equals_full_forward(tiny):
    model = tiny[0]
    tokens = [11, 22, 33, 44, 55, 66, 77, 88]
    runner = make_runner(model, 256, 1, slack=8)
    runner.kv.allocate("s")
    steps = [runner.forward(["s"], [tokens[:3]], last_only=True)[0]]
    for t in tokens[3:]:
        steps.append(runner.forward(["s"], [[t]], last_only=True)[0])
    assert runner.kv.cached_len("s") == len(tokens)
    assert torch.allclose(torch.stack(steps), fresh_logits(model, tokens, len(tokens) - 2), atol=ATOL)


@pytest.mark.parametrize("keep", [0, 1, 2])  # of 3 drafts written, keep this many
def test_rollback_then_overwrite(tiny, keep):
    """Write drafts, roll back with set_cached_len, write other tokens: same logits as a cache
    that only ever saw the final tokens."""
    model = tiny[0]
    prompt, drafts, replacement = [7, 8, 9, 10, 11], [100, 200, 300], [41, 42, 43]
    runner = make_runner(model, 256, num_slots=2, slack=8)
    runner.kv.allocate("s")
    runner.forward(["s"], [prompt], last_only=True)
    runner.forward(["s"], [drafts], last_only=False)
    assert runner.kv.cached_len("s") == len(prompt) + 3
    runner.kv.set_cached_len("s", len(prompt) + keep)
    got = runner.forward(["s"], [replacement], last_only=False)[0]
    final = prompt + drafts[:keep] + replacement
    assert runner.kv.cached_len("s") == len(final)
    assert torch.allclose(got, fresh_logits(model, final, len(replacement)), atol=ATOL)


def test_rollback_batched_rows_of_different_lengths(tiny):
    """Two sequences in one batch, different draft lengths and different rollbacks."""
    model = tiny[0]
    runner = make_runner(model, 256, num_slots=3, slack=8)
    prompts = {"a": [1, 2, 3, 4, 5, 6], "b": [9, 8, 7]}
    for s in prompts:
        runner.kv.allocate(s)
    runner.forward(list(prompts), list(prompts.values()), last_only=True)
    runner.forward(["a", "b"], [[50, 51, 52, 53], [60]], last_only=False)  # b is padded
    runner.kv.set_cached_len("a", 6 + 1)  # a keeps one draft
    runner.kv.set_cached_len("b", 3)  # b keeps none
    got = runner.forward(["a", "b"], [[70, 71], [80, 81, 82]], last_only=False)
    a_final, b_final = prompts["a"] + [50, 70, 71], prompts["b"] + [80, 81, 82]
    assert torch.allclose(got[0, :2], fresh_logits(model, a_final, 2), atol=ATOL)
    assert torch.allclose(got[1, :3], fresh_logits(model, b_final, 3), atol=ATOL)


def test_padded_rows_are_not_computed(tiny):
    """Rows of different lengths: projections and MLPs see only the real tokens, and the packed
    output is the padded output's real rows."""
    model = tiny[0]
    prompts = {"a": [1, 2, 3, 4, 5], "b": [9, 8], "c": [7, 6, 5]}
    seen_rows = []
    hook = model.model.layers[0].mlp.register_forward_pre_hook(lambda m, args: seen_rows.append(args[0].shape[0]))
    outputs = {}
    try:
        for packed in (False, True):
            runner = make_runner(model, 256, num_slots=3, slack=8)
            for s in prompts:
                runner.kv.allocate(s)
            with torch.inference_mode():
                outputs[packed], lengths = runner.forward_hidden(list(prompts), list(prompts.values()), packed=packed)
    finally:
        hook.remove()
    assert seen_rows == [10, 10]  # 5 + 2 + 3 real tokens, not 3 x 5
    padded, packed = outputs[False], outputs[True]
    assert padded.shape[:2] == (3, 5) and packed.shape[0] == 10
    real = torch.cat([padded[i, :n] for i, n in enumerate(lengths)])
    assert torch.equal(packed, real)


@pytest.mark.parametrize("freed", ["a", "b", "c"])
def test_freed_blocks_keep_other_sequences(tiny, freed):
    """Freeing a sequence returns its blocks to the pool; the others decode on unchanged."""
    model = tiny[0]
    runner = make_runner(model, 256, num_slots=3, slack=8)
    prompts = {"a": [1, 2, 3, 4], "b": [5, 6, 7, 8, 9, 10], "c": [11, 12, 13]}
    for s in prompts:
        runner.kv.allocate(s)
    runner.forward(list(prompts), list(prompts.values()), last_only=True)
    held = runner.kv.num_blocks - runner.kv.num_free_blocks
    runner.kv.free(freed)
    assert runner.kv.num_free_slots == 1 and not runner.kv.has(freed)
    assert runner.kv.num_blocks - runner.kv.num_free_blocks == held - 1  # one block each (prompts under 16 tokens)
    rest = [s for s in prompts if s != freed]
    nxt = {s: [20 + i, 30 + i] for i, s in enumerate(rest)}
    got = runner.forward(rest, [nxt[s] for s in rest], last_only=False)
    for i, s in enumerate(rest):
        assert torch.allclose(got[i], fresh_logits(model, prompts[s] + nxt[s], 2), atol=ATOL), s
    # the hole is reusable, and a new sequence starts from an empty cache
    runner.kv.allocate("d")
    got = runner.forward(["d"], [[3, 2, 1]], last_only=False)[0]
    assert torch.allclose(got, fresh_logits(model, [3, 2, 1], 3), atol=ATOL)


def test_cache_capacity_is_enforced(tiny):
    runner = make_runner(tiny[0], max_model_len=8, num_slots=1, slack=2)
    runner.kv.allocate("s")
    runner.forward(["s"], [list(range(1, 9))], last_only=True)
    with pytest.raises(CacheFullError):
        runner.forward(["s"], [[1, 2, 3]], last_only=True)
    runner.kv.allocate("s")  # allocating twice is a no-op
    with pytest.raises(CacheFullError):
        runner.kv.allocate("t")


@pytest.mark.parametrize("method,spec", [
    ("ngram", dict(k=4, prompt_lookup_min=1)),
    ("draft_model", dict(k=3)),  # an unrelated draft model: nearly every draft rejected
])
def test_engine_cache_after_rejections_equals_recomputation(tiny_model_dir, tiny_draft_dir, tiny, method, spec):
    """Mid-generation, after drafts were rejected, the target cache of every running sequence
    holds exactly its tokens: the next logits equal a fresh computation over them."""
    spec = dict(spec)
    if method == "draft_model":
        spec["draft_model"] = str(tiny_draft_dir)
    # adaptive off: the test needs drafts rejected within its 12 steps, and the planner (on) drafted
    # nothing that early for the n-gram proposer at this batch
    engine = make_engine(tiny_model_dir, method, loaded=tiny, adaptive=False, **spec)
    prompts = ["one two three one two three one two", "The cat sat on the mat. The cat", "x y z"]
    ids = [engine.add_request(p, SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)) for p in prompts]
    for _ in range(12):
        engine.step()
    assert engine.stats.num_accepted_tokens < engine.stats.num_draft_tokens  # rejections happened
    seqs = [engine._requests[i] for i in ids]
    assert all(not s.finished for s in seqs)
    for s in seqs:
        assert engine.kv.cached_len(s.request_id) == len(s.token_ids) - 1
    logits = engine.runner.forward(ids, [[s.token_ids[-1]] for s in seqs], last_only=True)
    for i, s in enumerate(seqs):
        assert torch.allclose(logits[i], fresh_logits(tiny[0], s.token_ids, 1)[0], atol=ATOL)
        engine.kv.set_cached_len(s.request_id, len(s.token_ids) - 1)  # undo the probe
    if method == "draft_model":  # the draft's own cache (rolled back implicitly) is right too
        runner = engine.proposer.runner
        for s in seqs:
            fed = engine.proposer._fed[s.request_id]
            assert runner.kv.cached_len(s.request_id) == len(fed)
            probe = runner.forward([s.request_id], [[5]], last_only=True)[0]
            assert torch.allclose(probe, fresh_logits(runner.model, fed + [5], 1)[0], atol=ATOL)
            runner.kv.set_cached_len(s.request_id, len(fed))
    run_to_completion(engine)


@pytest.mark.parametrize("method,spec", [
    ("none", {}),
    ("ngram", dict(k=4, prompt_lookup_min=1)),
    ("draft_model", dict(k=3, draft_num_layers=1)),
])
def test_engine_compaction_when_middle_sequence_leaves(tiny_model_dir, tiny, method, spec):
    """The middle of three sequences finishes first (its blocks go back to the pool);
    the two others still decode exactly as when run alone."""
    engine = make_engine(tiny_model_dir, method, loaded=tiny, **spec)
    long = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    prompts = ["The cat sat on the mat. The cat", "a b c a b c a b", "one two three one two three"]
    alone = run_alone(make_engine(tiny_model_dir, "none", loaded=tiny), prompts, long)
    ids = [engine.add_request(prompts[0], long),
           engine.add_request(prompts[1], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)),
           engine.add_request(prompts[2], long)]
    engine.step()
    assert all(engine.kv.has(i) for i in ids)
    done: dict = {}
    while ids[1] not in done:
        done.update({o.request_id: o for o in engine.step() if o.finished})
    assert not engine.kv.has(ids[1]) and engine.kv.has(ids[2])
    run_to_completion(engine, done)
    assert done[ids[0]].token_ids == alone[0]
    assert done[ids[1]].token_ids == alone[1][:3]
    assert done[ids[2]].token_ids == alone[2]


def _rss_bytes() -> int:
    import os

    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_pool_is_zero_and_takes_memory_only_where_written(dtype):
    """A CPU pool of 1 MiB or more is an anonymous map (rayspec.model.kv_cache.zeroed_pool): all zeros as
    torch.zeros would give, holding the memory of the pages written and not of the whole pool, and
    writes and reads land as in any tensor; a small pool is a plain torch.zeros tensor."""
    import gc
    import sys

    from rayspec.model.kv_cache import LAZY_ZERO_MIN_BYTES, zeroed_pool

    if not sys.platform.startswith("linux"):
        pytest.skip("/proc/self/statm")
    shape = (1 << 16, 4, 256)  # 256 MiB in fp32, 128 MiB in bf16
    gc.collect()
    before = _rss_bytes()
    pool = zeroed_pool(shape, dtype, "cpu")
    assert pool.shape == shape and pool.dtype == dtype and pool.is_contiguous()
    assert _rss_bytes() - before < 16 << 20  # not one page of it written yet
    rows = torch.tensor([0, 7, 1 << 15, (1 << 16) - 1])
    assert not pool[rows].any()
    values = torch.randn(4, 4, 256).to(dtype)
    pool.index_copy_(0, rows, values)
    assert torch.equal(pool[rows], values) and not pool[1:7].any()
    assert _rss_bytes() - before < 32 << 20  # the written rows' pages (and the zero page read above)
    # the rest still zeros (reading an unwritten page maps the kernel's shared zero page)
    assert pool.count_nonzero().item() == values.count_nonzero().item()
    small = zeroed_pool((8, 2, 16), dtype, "cpu")
    assert small.numel() * small.element_size() < LAZY_ZERO_MIN_BYTES and not small.any()
    del pool
    gc.collect()
