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

from rayspec.config import EngineConfig, SpeculativeConfig
from rayspec.engine.llm_engine import InvalidRequestError, LLMEngine
from rayspec.memory.plan import GiB, draft_kv_fraction
from rayspec.kv.block_manager import BlockManager, block_hash
from rayspec.model.kv_cache import KVCache
from rayspec.model.runner import make_runner
from rayspec.sampling.sampler import SamplingParams

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


def _two_chains(bm):
    """a (4 blocks of 2) and b right after it in the pool, both registered and given back."""
    a, b = [1, 2, 3, 4, 5, 6, 7, 8], [11, 12, 13, 14]
    for s, toks in (("a", a), ("b", b)):
        bm.allocate(s, toks)
        bm.grow(s, len(toks))
        bm.commit(s, toks, len(toks))
    table_a, table_b = list(bm.tables["a"]), list(bm.tables["b"])
    assert table_b[0] == table_a[-1] + 1  # b lies right after a
    bm.free("a")
    bm.free("b")
    return a, b, table_a, table_b


def test_a_short_shared_prefix_is_copied_rather_than_another_chain_evicted():
    """A new sequence after a short shared prefix (a chat template's system block) whose next block
    continues another request's text: the prefix blocks are copied to a free run (the runner copies
    their rows) and it grows on there, consecutively; the other request's chain stays whole."""
    bm = BlockManager(num_blocks=16, block_size=2, enable_prefix_caching=True)
    a, b, table_a, table_b = _two_chains(bm)
    c = a[:4] + [90, 91, 92, 93, 94]
    assert bm.allocate("c", c) == 4 and bm.tables["c"] == table_a[:2]
    bm.grow("c", len(c))
    table_c = bm.tables["c"]
    assert table_c == list(range(table_c[0], table_c[0] + 5))  # consecutive: its keys read as a view
    assert not set(table_c) & set(table_a + table_b)
    assert bm.pop_copies() == list(zip(table_a[:2], table_c[:2])) and bm.pop_copies() == []
    assert bm.ref_count(table_a[0]) == 0  # the originals stay cached, held by nobody
    assert bm.allocate("a2", a) == 6 and bm.tables["a2"] == table_a[:3]  # a's prefix found whole
    assert bm.allocate("b2", b + [15]) == 4
    # growing on from its own (unregistered) rows moves nothing
    bm.grow("c", 12)
    assert bm.pop_copies() == []


def test_a_long_prefix_is_copied_only_where_its_sequence_holds_it_alone():
    """Past relocate_max_tokens the copies' memory counts: a prefix the sequence holds alone (it will
    likely run alone, where a view pays) is copied; one another running sequence holds too is not, and
    the sequence goes on elsewhere. In neither case is the other request's chain evicted."""
    for held in (False, True):
        bm = BlockManager(num_blocks=16, block_size=2, enable_prefix_caching=True, relocate_max_tokens=2)
        a, b, table_a, table_b = _two_chains(bm)
        c = a[:4] + [90, 91, 92, 93, 94]
        if held:
            assert bm.allocate("other", a[:4] + [70]) == 4
        assert bm.allocate("c", c) == 4
        bm.grow("c", len(c))
        copies, table_c = bm.pop_copies(), bm.tables["c"]
        if held:
            assert copies == [] and table_c[:2] == table_a[:2] and table_c[2] not in table_a + table_b
        else:
            assert copies == list(zip(table_a[:2], table_c[:2]))
            assert table_c == list(range(table_c[0], table_c[0] + 5))
        assert bm.allocate("a2", a) == 6 and bm.allocate("b2", b + [15]) == 4  # both chains whole


def test_a_short_tail_after_a_long_prefix_is_evicted_to_stay_consecutive():
    """A prompt asked again: its earlier answer's blocks follow its cached prefix. Short beside the
    prefix (EVICT_TAIL_RATIO), that tail is taken (the table stays consecutive, nothing is copied);
    a block after the prefix that is free, or unreachable, is taken as it is."""
    from rayspec.kv.block_manager import EVICT_TAIL_RATIO

    bm = BlockManager(num_blocks=128, block_size=2, enable_prefix_caching=True)
    prompt = list(range(3, 3 + 2 * 2 * EVICT_TAIL_RATIO))  # 2 x EVICT_TAIL_RATIO full blocks
    first = prompt + [200, 201, 202, 203]  # then a 2-block answer
    bm.allocate("a", first)
    bm.grow("a", len(first))
    bm.commit("a", first, len(first))
    table_a = list(bm.tables["a"])
    bm.free("a")
    again = prompt + [7]
    assert bm.allocate("b", again) == len(prompt)
    bm.grow("b", len(again) + 4)
    assert bm.pop_copies() == [] and bm.tables["b"][: len(table_a)] == table_a
    # free next block: grown in place
    bm2 = BlockManager(num_blocks=8, block_size=2, enable_prefix_caching=True)
    bm2.allocate("x", [1, 2, 3])
    bm2.grow("x", 3)
    bm2.commit("x", [1, 2, 3], 3)
    bm2.free("x")  # its partial block goes back free, its full one stays cached
    assert bm2.allocate("y", [1, 2, 9, 9]) == 2
    bm2.grow("y", 4)
    assert bm2.pop_copies() == [] and bm2.tables["y"][1] == bm2.tables["y"][0] + 1


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
    assert engine.kv.num_free_slots == engine.num_slots and engine.kv_cache_usage() == 0.0
    assert engine.kv.blocks.num_cached_blocks > 0
    again = engine.generate([PROMPTS[0]], GREEDY)[0]  # its whole prompt cached (all but its last block)
    assert again.token_ids == reference[0] and again.num_cached_tokens == (len(PROMPTS[0]) - 1) // BS * BS
    if name == "eagle3-tree":  # the head's cache too; most drafted paths accepted
        assert engine.proposer.runner.kv.blocks.num_cached_blocks > 0
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
        assert engine.kv.num_free_blocks == engine.num_blocks


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
    from rayspec.model.batch_layout import TreeQuery

    model = target[0]
    runner = make_runner(model, 64, num_slots=1, slack=16, block_size=BS)
    runner.kv.allocate("s")
    prompt = [5, 6, 7, 8, 9, 10]
    runner.forward(["s"], [prompt], last_only=True)
    nodes, parents = [11, 12, 13, 14, 15], [-1, -1, 1, 2, 2]
    runner.forward_hidden(["s"], [nodes], trees=[TreeQuery(parents)])
    runner.kv.keep_paths([("s", [1, 2, 4])])  # tokens 12, 13, 15
    assert runner.kv.cached_len("s") == 9
    got = runner.forward(["s"], [[16]], last_only=True)[0]
    fresh = make_runner(model, 64, num_slots=1, slack=16, block_size=BS)
    fresh.kv.allocate("f")
    want = fresh.forward(["f"], [prompt + [12, 13, 15, 16]], last_only=True)[0]
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert runner.kv.kv_cache_usage() == 3 / runner.kv.num_blocks


def test_a_relocated_prefix_keeps_its_keys_and_values(target):
    """A shared prefix block copied to where the sequence grows on (BlockManager._relocate): the runner
    copies its rows, every layer, and the sequence's logits are those of a fresh computation."""
    model = target[0]
    runner = make_runner(model, 64, num_slots=2, slack=16, num_blocks=16, block_size=BS, enable_prefix_caching=True)
    first = PREFIX[:BS] + [5, 6, 7, 8, 9, 10, 11, 12]  # one shared block, then its own text
    runner.kv.allocate("a", first)
    runner.forward(["a"], [first], last_only=True)
    runner.kv.commit("a", first)
    table_a = list(runner.kv.blocks.tables["a"])
    runner.kv.free("a")
    second = PREFIX[:BS] + [40, 41, 42, 43, 44]
    assert runner.kv.allocate("b", second) == BS
    got = runner.forward(["b"], [second[BS:]], last_only=True)[0]
    table_b = runner.kv.blocks.tables["b"]
    assert table_b[0] != table_a[0] and table_b == list(range(table_b[0], table_b[0] + len(table_b)))
    for cache in runner.cache.tensors():
        torch.testing.assert_close(cache[table_b[0] * BS: (table_b[0] + 1) * BS], cache[table_a[0] * BS: (table_a[0] + 1) * BS],
                                   rtol=0, atol=0)
    fresh = make_runner(model, 64, num_slots=1, slack=16, block_size=BS)
    fresh.kv.allocate("f")
    torch.testing.assert_close(got, fresh.forward(["f"], [second], last_only=True)[0], rtol=1e-4, atol=1e-4)
    assert runner.kv.allocate("a2", first) == 2 * BS  # a's chain (its own text included) found whole



def test_sequences_growing_in_lockstep_copy_nothing():
    """Two requests decoding side by side take blocks in turn, so the block after each one's last is
    its neighbour's. Their full blocks are registered as they fill (prefix caching), which made each
    table look like a bare cached prefix: every block boundary relocated the whole context (its
    rows copied), for both. Only a table that is a cached prefix alone, before the sequence takes a
    block of its own, is moved."""
    bm = BlockManager(num_blocks=64, block_size=2, enable_prefix_caching=True)
    seqs = {"a": [3, 4, 5], "b": [6, 7, 8]}
    for seq_id, tokens in seqs.items():
        assert bm.allocate(seq_id, tokens) == 0
        bm.grow(seq_id, len(tokens))
    for step in range(12):  # one token each per step, verified and committed
        for seq_id, tokens in seqs.items():
            tokens.append(10 + step)
            assert bm.grow(seq_id, len(tokens))
            bm.commit(seq_id, tokens, len(tokens))
        assert bm.pop_copies() == [], step
    assert len(bm.tables["a"]) == len(bm.tables["b"]) == 8
    # a request that starts from a's cached prefix still gets it moved where it can grow on consecutively
    bm.free("a")
    c = seqs["a"][:8] + [99]
    assert bm.allocate("c", c) == 8
    bm.grow("c", len(c) + 2)
    table_c = bm.tables["c"]
    assert table_c == list(range(table_c[0], table_c[0] + len(table_c)))
    assert len(bm.pop_copies()) == 4
