"""Prefix reuse for every request shape: a request that ends at its prefill (max_tokens 1, what a
completions request with max_tokens 0 and echo asks of the engine) leaves its prompt's full blocks
reusable for the next request sharing them, in the target's cache and in an EAGLE head's, and the
output is the same as without prefix caching."""

from __future__ import annotations

import random

import pytest
import torch
from conftest import make_tiny_model_dir
from engine_utils import cached_model

from rayspec.config import EngineConfig, SpeculativeConfig
from rayspec.engine.llm_engine import LLMEngine
from rayspec.sampling.sampler import SamplingParams

VOCAB, LAYERS, HIDDEN = 256, 4, 64
BS = 4
_rng = random.Random(23)
DOC = [_rng.randrange(3, VOCAB) for _ in range(70)]  # shared by both prompts: 17 full blocks of 4
FIRST, SECOND = DOC + [7, 8], DOC + [9]
SHARED = len(DOC) // BS * BS


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    return make_tiny_model_dir(tmp_path_factory.mktemp("reuse-target") / "model", seed=5, num_layers=LAYERS,
                               hidden=HIDDEN, vocab_size=VOCAB, with_tokenizer=False)


@pytest.fixture(scope="module")
def target(target_dir):
    return cached_model(str(target_dir))


@pytest.fixture(scope="module")
def eagle_dir(target_dir, target, tmp_path_factory):
    from rayspec.eagle.checkpoint import new_eagle_config, save_eagle_head
    from rayspec.eagle.head import attach_target, build_head

    torch.manual_seed(3)
    head = build_head(new_eagle_config("eagle3", target_dir, LAYERS, HIDDEN))
    attach_target(head, target[0], has_own_embedding=False)
    return save_eagle_head(head, tmp_path_factory.mktemp("reuse-eagle3") / "head")


def _engine(target_dir, target, spec: dict, caching: bool = True) -> LLMEngine:
    spec = {"num_speculative_tokens": 0 if spec["method"] == "none" else 4, "adaptive": False, **spec}
    config = EngineConfig(model=str(target_dir), max_model_len=128, max_num_seqs=4, kv_cache_memory_gb=0.5,
                          block_size=BS, enable_prefix_caching=caching, speculative=SpeculativeConfig(**spec))
    return LLMEngine(config, model=target[0], tokenizer=None)


def _specs(eagle_dir) -> dict:
    return {"none": dict(method="none"), "ngram": dict(method="ngram", prompt_lookup_min=1),
            "eagle3-chain": dict(method="eagle3", draft_model=str(eagle_dir)),
            "eagle3-tree": dict(method="eagle3", draft_model=str(eagle_dir), eagle_topk=2, num_steps=3,
                                tree_max_batch=8)}


def _params(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


@pytest.mark.parametrize("name", ["none", "ngram", "eagle3-chain", "eagle3-tree"])
@pytest.mark.parametrize("first_tokens", [1, 2, 8])
def test_request_ending_at_prefill_leaves_its_prefix_reusable(target_dir, target, eagle_dir, name, first_tokens):
    """The first request makes first_tokens tokens (1: it ends at its prefill); the second, sharing
    70 tokens, with max_tokens 1 and then 8, finds the shared full blocks cached (target and head),
    and its greedy output is the one without prefix caching."""
    spec = _specs(eagle_dir)[name]
    plain = _engine(target_dir, target, spec, caching=False)
    for second_tokens in (1, 8):
        engine = _engine(target_dir, target, spec)
        first = engine.generate([FIRST], _params(first_tokens))[0]
        assert first.num_cached_tokens == 0 and len(first.token_ids) == first_tokens
        if name.startswith("eagle3"):  # the head holds the first prompt's pairs too
            assert engine.proposer.runner.kv.blocks.num_cached_blocks >= SHARED // BS
        second = engine.generate([SECOND], _params(second_tokens))[0]
        assert second.num_cached_tokens >= SHARED, (name, first_tokens, second_tokens)
        assert second.token_ids == plain.generate([SECOND], _params(second_tokens))[0].token_ids
        # and once more, the second prompt itself now cached up to its last full block
        third = engine.generate([SECOND], _params(8))[0]
        assert third.num_cached_tokens == (len(SECOND) - 1) // BS * BS
        assert third.token_ids == plain.generate([SECOND], _params(8))[0].token_ids
        assert engine.kv.num_free_slots == engine.num_slots and engine.kv_cache_usage() == 0.0


def test_scoring_requests_leave_their_prefix_too(target_dir, target, eagle_dir):
    """A completions request with max_tokens 0 and echo is an engine request of max_tokens 1; with
    logprobs it asks for prompt logprobs, which read no cached prefix (every prompt row's logits are
    needed) but still leave theirs for the requests after it."""
    from deployments.frontend.openai_requests import CompletionRequest

    (gen,) = CompletionRequest(model="m", prompt=FIRST, max_tokens=0, echo=True).to_generate()
    assert gen.max_tokens == 1 and gen.echo_prompt
    (scored,) = CompletionRequest(model="m", prompt=FIRST, max_tokens=0, echo=True, logprobs=1).to_generate()
    assert scored.max_tokens == 1 and scored.prompt_logprobs == 1
    engine = _engine(target_dir, target, _specs(eagle_dir)["eagle3-tree"])
    scoring = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=1)
    first = engine.generate([FIRST], scoring)[0]
    assert len(first.prompt_logprobs) == len(FIRST)
    again = engine.generate([FIRST], scoring)[0]  # prompt logprobs: computed again, none cached
    assert again.num_cached_tokens == 0 and again.prompt_logprobs == first.prompt_logprobs
    second = engine.generate([SECOND], _params(1))[0]
    assert second.num_cached_tokens >= SHARED
    plain = _engine(target_dir, target, _specs(eagle_dir)["eagle3-tree"], caching=False)
    assert second.token_ids == plain.generate([SECOND], _params(1))[0].token_ids


def test_cache_salt_keeps_prefix_caching_per_tenant(target_dir, target):
    """vLLM's cache_salt: a prompt cached under one salt is not found under another salt or none
    (cached_tokens 0: one tenant cannot probe what another sent), and is found under the same salt;
    outputs are the same either way."""
    from dataclasses import replace

    engine = _engine(target_dir, target, dict(method="none"))
    tenant_a, tenant_b = replace(_params(4), cache_salt="tenant-a"), replace(_params(4), cache_salt="tenant-b")
    first = engine.generate([FIRST], tenant_a)[0]
    assert first.num_cached_tokens == 0
    others = [engine.generate([SECOND], p)[0] for p in (tenant_b, _params(4))]
    assert [o.num_cached_tokens for o in others] == [0, 0]  # another tenant, and no tenant: nothing found
    same = engine.generate([SECOND], tenant_a)[0]
    assert same.num_cached_tokens >= SHARED
    assert same.token_ids == others[0].token_ids == others[1].token_ids
    assert engine.kv.num_free_slots == engine.num_slots and engine.kv_cache_usage() == 0.0


@pytest.mark.parametrize("name", ["none", "eagle3-tree"])
def test_documents_after_a_shared_system_block_stay_cached_for_their_next_request(target_dir, target, eagle_dir,
                                                                                 name):
    """Four documents behind a shared system prompt, one request after another (conversations
    taking turns), then again: the second time each finds its whole document cached (target and
    head). A new sequence used to grow into the block after the shared one, the previous
    document's, and take that document's chain down (8 SmolLM2 documents served twice: 6 recomputed
    behind an EAGLE head, 0.68x the base's tok/s). Outputs are those without prefix caching."""
    system = [_rng.randrange(3, VOCAB) for _ in range(2 * BS)]  # two full blocks shared by all
    docs = [system + [_rng.randrange(3, VOCAB) for _ in range(n)] for n in (41, 45, 38, 50)]
    spec = _specs(eagle_dir)[name]
    engine = _engine(target_dir, target, spec)
    plain = _engine(target_dir, target, spec, caching=False)
    want = [plain.generate([d], _params(6))[0].token_ids for d in docs]
    for rnd in range(2):
        outs = [engine.generate([d], _params(6))[0] for d in docs]
        assert [o.token_ids for o in outs] == want
        cached = [o.num_cached_tokens for o in outs]
        if rnd == 0:  # the system prompt (a block less behind the head: its pairs end a token later)
            assert cached == [0] + [BS if name.startswith("eagle3") else 2 * BS] * 3, cached
        else:  # the whole document's full blocks (the head's pairs end a token later: a block less at most)
            assert all(c >= (len(d) - 1) // BS * BS - BS for c, d in zip(cached, docs)), cached
