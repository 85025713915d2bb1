"""The paged KV cache and automatic prefix caching: the block manager's books (allocation, reference
counts, the hash chain, LRU eviction, copy-on-write), and losslessness through them: greedy output
equal to target-only decoding with shared prefixes, requests joining mid-batch, and a pool so small
that sequences are preempted and recomputed; what cannot fit is refused; cached tokens reported."""

from __future__ import annotations

import random

import pytest
import torch
from conftest import make_tiny_model_dir
from engine_utils import cached_model, run_alone, run_joining, run_to_completion

from rayspec.block_manager import BlockManager, block_hash
from rayspec.config import EngineConfig, SpeculativeConfig
from rayspec.engine import InvalidRequestError, LLMEngine
from rayspec.kv_cache import KVCache
from rayspec.memory import GiB, draft_kv_fraction
from rayspec.runner import ModelRunner
from rayspec.sampling import SamplingParams

VOCAB, LAYERS, HIDDEN = 256, 4, 64
BS = 4  # small blocks: many block boundaries in short test sequences
_rng = random.Random(19)
PREFIX = [_rng.randrange(3, VOCAB) for _ in range(23)]
PROMPTS = [PREFIX + [_rng.randrange(3, VOCAB) for _ in range(n)] for n in (5, 2, 9, 1)] + \
    [[_rng.randrange(3, VOCAB) for _ in range(n)] for n in (7, 3)]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


# ---- the block manager -----------------------------------------------------------------------

def test_blocks_allocated_as_sequences_grow_and_returned():
    bm = BlockManager(num_blocks=6, block_size=4, first_block=1)
    assert bm.allocate("a") == 0 and bm.grow("a", 5)  # 2 blocks
    assert bm.tables["a"] == [1, 2] and bm.num_free_blocks == 4
    assert bm.grow("a", 8) and len(bm.tables["a"]) == 2  # still 2
    assert not bm.grow("a", 40) and len(bm.tables["a"]) == 2  # nothing taken when the pool lacks them
    bm.allocate("b")
    assert bm.grow("b", 16) and bm.num_free_blocks == 0 and not bm.can_grow("a", 9)
    assert bm.shrink("b", 5) == [] and len(bm.tables["b"]) == 2 and bm.num_free_blocks == 2
    bm.free("a")
    bm.free("b")
    assert bm.num_free_blocks == 6 and bm.num_used_blocks == 0


def test_prefix_blocks_shared_by_hash_chain_and_ref_counted():
    bm = BlockManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    tokens = list(range(10, 21))  # 11 tokens: 2 full blocks
    assert bm.allocate("a", tokens) == 0
    bm.grow("a", len(tokens))
    bm.commit("a", tokens, 11)
    assert bm.num_cached_blocks == 2
    # the same prefix: both full blocks found (at least one token is left to compute)
    assert bm.allocate("b", tokens[:9] + [99]) == 8
    assert bm.tables["b"] == bm.tables["a"][:2] and bm.ref_count(bm.tables["a"][0]) == 2
    # exactly 8 tokens: only the first block (the last token must be computed)
    assert bm.allocate("c", tokens[:8]) == 4
    # the same second block's tokens after another first block: a different chain, no hit
    assert bm.allocate("d", [0, 1, 2, 3] + tokens[4:8] + [5]) == 0
    h1 = block_hash(b"", tokens[:4])
    assert block_hash(h1, tokens[4:8]) != block_hash(block_hash(b"", [0, 1, 2, 3]), tokens[4:8])
    for s in "abcd":
        bm.free(s)
    assert bm.num_free_blocks == 8 and bm.num_cached_blocks == 2  # cached blocks nobody holds stay (LRU)


def test_lru_eviction_only_when_the_free_list_is_empty():
    bm = BlockManager(num_blocks=4, block_size=2, enable_prefix_caching=True)
    for s, toks in (("a", [1, 2, 3]), ("b", [4, 5, 6])):
        bm.allocate(s, toks)
        bm.grow(s, 3)
        bm.commit(s, toks, 3)
        bm.free(s)
    assert bm.num_cached_blocks == 2 and bm.num_free_blocks == 4
    bm.allocate("x")
    bm.grow("x", 4)  # 2 blocks from the free list: the cached ones survive
    assert bm.num_cached_blocks == 2
    bm.grow("x", 6)  # the free list is empty: the least recently released cached block ("a"'s) goes
    assert bm.num_cached_blocks == 1
    assert bm.allocate("a2", [1, 2, 3]) == 0 and bm.allocate("b2", [4, 5, 6]) == 2


def test_growing_keeps_blocks_consecutive_without_breaking_other_prefixes():
    """A sequence takes the block after its last where it can (its keys then read as a view): a free
    one, a cached one that continues its own prefix (another request's text after it), or one no lookup
    can reach; never the head of another prefix's chain."""
    bm = BlockManager(num_blocks=16, block_size=2, enable_prefix_caching=True)
    a, b = [1, 2, 3, 4, 5, 6, 7, 8], [11, 12, 13, 14]  # a: blocks of 2, b after it in the pool
    for s, toks in (("a", a), ("b", b)):
        bm.allocate(s, toks)
        bm.grow(s, len(toks))
        bm.commit(s, toks, len(toks))
    table_a, table_b = list(bm.tables["a"]), list(bm.tables["b"])
    assert table_b[0] == table_a[-1] + 1  # b lies right after a
    bm.free("a")
    bm.free("b")
    # a's first 2 blocks again, then its own text: a's third block (a sibling after the shared prefix)
    # and its fourth (now unreachable) are taken, so the table is consecutive
    c = a[:4] + [90, 91, 92, 93, 94]
    assert bm.allocate("c", c) == 4
    bm.grow("c", len(c))
    assert bm.tables["c"][:4] == table_a  # 2 shared, then a's sibling block and its orphaned successor
    # the next block would be b's head: b's chain stays, c's fifth block comes from elsewhere
    assert bm.tables["c"][4] != table_b[0]
    assert bm.allocate("b2", b + [15]) == 4  # b's prefix still found whole


def test_shrinking_into_a_shared_block_copies_it():
    bm = BlockManager(num_blocks=6, block_size=4, enable_prefix_caching=True)
    tokens = list(range(1, 10))
    bm.allocate("a", tokens)
    bm.grow("a", 9)
    bm.commit("a", tokens, 9)
    assert bm.allocate("b", tokens) == 8
    shared = bm.tables["b"][1]
    copies = bm.shrink("b", 6)  # b will rewrite positions 6.. of a block a holds too
    assert copies == [(shared, bm.tables["b"][1])] and bm.tables["b"][1] != shared
    assert bm.ref_count(shared) == 1 and bm.tables["a"][1] == shared


# ---- engines ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("paged-target") / "model", seed=5, num_layers=LAYERS,
                               hidden=HIDDEN, vocab_size=VOCAB, with_tokenizer=False)


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("paged-draft") / "model", seed=6, num_layers=1,
                               hidden=HIDDEN, vocab_size=VOCAB, with_tokenizer=False)


@pytest.fixture(scope="module")
def target(target_dir):
    return cached_model(str(target_dir))


@pytest.fixture(scope="module")
def eagle_dir(target_dir, reference, tmp_path_factory):
    """An oracle head (eagle_utils.oracle_head): its drafts are the target's greedy continuations, so
    accepted tree paths (and the head's cache blocks of accepted nodes) are exercised."""
    from eagle_utils import oracle_head
    from rayspec.eagle.checkpoint import save_eagle_head

    head = oracle_head(target_dir, LAYERS, HIDDEN, [p + r for p, r in zip(PROMPTS, reference)])
    return save_eagle_head(head, tmp_path_factory.mktemp("paged-eagle3") / "head")


def _engine(target_dir, target, method="none", pool_tokens=None, caching=True, max_num_seqs=8, **spec):
    """pool_tokens: a KV budget of that many tokens (in blocks of BS, the scratch block besides)."""
    spec.setdefault("num_speculative_tokens", 0 if method == "none" else 4)
    speculative = SpeculativeConfig(method=method, adaptive=False, **spec)
    # a draft model's cache is paid from the same budget, at its own size per token
    share = draft_kv_fraction(speculative, str(target_dir), target[0].args, torch.float32) \
        if method == "draft_model" else 0.0
    per_token = KVCache.bytes_per_token(target[0].args, torch.float32) * (1 + share)
    budget = 2.0 if pool_tokens is None else (pool_tokens + BS + 0.5) * per_token / GiB
    config = EngineConfig(model=str(target_dir), max_model_len=128, max_num_seqs=max_num_seqs,
                          kv_cache_memory_gb=budget, block_size=BS, enable_prefix_caching=caching,
                          speculative=speculative)
    return LLMEngine(config, model=target[0], tokenizer=None)


@pytest.fixture(scope="module")
def reference(target_dir, target):
    """Target-only greedy decoding, each prompt alone, no prefix caching."""
    return run_alone(_engine(target_dir, target, caching=False), PROMPTS, GREEDY)


def _specs(draft_dir, eagle_dir) -> dict:
    return {"none": dict(method="none"), "ngram": dict(method="ngram", prompt_lookup_min=1),
            "draft_model": dict(method="draft_model", draft_model=str(draft_dir)),
            "eagle3-tree": dict(method="eagle3", draft_model=str(eagle_dir), eagle_topk=2, num_steps=3,
                                tree_max_batch=8)}


@pytest.mark.parametrize("name", ["none", "ngram", "draft_model", "eagle3-tree"])
def test_greedy_equals_target_only_with_shared_prefixes(target_dir, target, draft_dir, eagle_dir, reference, name):
    """Batched (prompts sharing a 23-token prefix), then joining mid-batch (the later ones find the
    earlier ones' blocks cached): token for token target-only's."""
    spec = _specs(draft_dir, eagle_dir)[name]
    engine = _engine(target_dir, target, **spec)
    ids = [engine.add_request(p, GREEDY) for p in PROMPTS]
    done = run_to_completion(engine)
    assert [done[i].token_ids for i in ids] == reference
    assert run_joining(engine, PROMPTS, GREEDY) == reference
    assert engine.runner.num_free_slots == engine.num_slots and engine.kv_cache_usage() == 0.0
    assert engine.runner.blocks.num_cached_blocks > 0
    again = engine.generate([PROMPTS[0]], GREEDY)[0]  # its whole prompt cached (all but its last block)
    assert again.token_ids == reference[0] and again.num_cached_tokens == (len(PROMPTS[0]) - 1) // BS * BS
    if name == "eagle3-tree":  # the head's cache too; most drafted paths accepted
        assert engine.proposer.runner.blocks.num_cached_blocks > 0
        stats = engine.stats
        print(f"{name}: {stats.as_dict()}")
        assert stats.num_accepted_tokens > 1.5 * stats.num_drafts, stats.as_dict()


@pytest.mark.parametrize("name", ["none", "ngram", "draft_model", "eagle3-tree"])
def test_preempted_sequences_resume_losslessly(target_dir, target, draft_dir, eagle_dir, reference, name):
    """A pool of 96 tokens for six requests of up to 56: the youngest are preempted when it runs
    out, recomputed when admitted again, and every output is still target-only's."""
    spec = _specs(draft_dir, eagle_dir)[name]
    for caching in (True, False):
        engine = _engine(target_dir, target, pool_tokens=96, caching=caching, **spec)
        assert engine.num_blocks == 96 // BS
        assert run_joining(engine, PROMPTS, GREEDY, first=3) == reference
        assert engine.num_preemptions > 0
        assert engine.runner.num_free_blocks == engine.num_blocks


def test_request_that_can_never_fit_is_refused(target_dir, target):
    engine = _engine(target_dir, target, "ngram", pool_tokens=48)
    with pytest.raises(InvalidRequestError, match="exceed the whole KV cache"):
        engine.add_request(list(range(3, 33)), SamplingParams(max_tokens=20))
    with pytest.raises(InvalidRequestError, match="max_model_len"):
        _engine(target_dir, target).add_request(list(range(3, 103)), SamplingParams(max_tokens=40))
    engine.add_request(list(range(3, 23)), SamplingParams(max_tokens=20))  # 20 + 20 + 4 drafts fit


def test_cached_tokens_reported(target_dir, target):
    long = [_rng.randrange(3, VOCAB) for _ in range(70)]
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    for caching in (True, False):
        engine = _engine(target_dir, target, "ngram", caching=caching)
        first = engine.generate([long + [7, 8]], params)[0]
        second = engine.generate([long + [9]], params)[0]
        assert first.num_cached_tokens == 0
        # 70 shared tokens: 17 full blocks of 4
        assert second.num_cached_tokens == (68 if caching else 0)
        assert second.token_ids == _engine(target_dir, target, caching=False).generate([long + [9]], params)[0].token_ids


def test_runner_keep_path_across_blocks(target):
    """A tree's accepted rows moved to follow the prefix across a block boundary read back as a
    fresh computation of the path does."""
    from rayspec.batch_layout import TreeQuery

    model = target[0]
    runner = ModelRunner(model, 64, num_slots=1, slack=16, block_size=BS)
    runner.allocate("s")
    prompt = [5, 6, 7, 8, 9, 10]
    runner.forward(["s"], [prompt], last_only=True)
    nodes, parents = [11, 12, 13, 14, 15], [-1, -1, 1, 2, 2]
    runner.forward_hidden(["s"], [nodes], trees=[TreeQuery(parents)])
    runner.keep_path("s", [1, 2, 4])  # tokens 12, 13, 15
    assert runner.cached_len("s") == 9
    got = runner.forward(["s"], [[16]], last_only=True)[0]
    fresh = ModelRunner(model, 64, num_slots=1, slack=16, block_size=BS)
    fresh.allocate("f")
    want = fresh.forward(["f"], [prompt + [12, 13, 15, 16]], last_only=True)[0]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert runner.kv_cache_usage() == 3 / runner.num_blocks
