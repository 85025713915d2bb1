"""What a proposer is not told (#35, second round).

- A seeded request's seed reaches the proposer as it is: the verifier draws a seeded request
  coupled (rayspec.sampling.sampler), so every token it emits is the target's own draw whatever was
  drafted; a proposer that knows the seed drafts with the target's noise (what makes its drafts
  accepted) and cannot move the output. tests/engine/test_coupled_sampling.py shows the output is
  target-only decoding; here, that forged drafts built with the seed change nothing.
- An EAGLE head's prefix cache is salted like the target's (`cache_salt`): a tenant's prompt pairs
  are found in the head's cache under its salt only, not by an unsalted or other-salted lookup.
  So is a draft model's, and the salt goes with every propose request (over the channel too).
"""

from __future__ import annotations

import random

import pytest
import torch
from conftest import make_tiny_model_dir
from engine_utils import _hf_model, cached_model
from serve_utils import app_deployments, tiny_args

from deployments.app import build_app
from rayspec.config import EngineConfig, SpeculativeConfig
from rayspec.engine.llm_engine import LLMEngine
from rayspec.proposers import Draft, ProposeRequest
from rayspec.proposers.base import Proposer
from rayspec.sampling.sampler import SamplingParams


# ---- seeds ----------------------------------------------------------------------------------------
class _Result:
    def __init__(self, value):
        self.value = value

    def result(self, timeout_s=None):
        return self.value

    def cancel(self):
        pass


class _Handle:
    """A proposer deployment's handle, in this process: records every ProposeRequest it gets."""

    is_initialized = True

    def __init__(self):
        self.seen: list[ProposeRequest] = []

    def options(self, **kwargs):
        return self

    def __getattr__(self, name):
        handle = self

        class _Method:
            def remote(self, *args):
                if name == "propose":
                    handle.seen.extend(args[0])
                    return _Result([Draft([]) for _ in args[0]])
                return _Result(None)  # feature_layers, pin
        return _Method()


def test_the_request_seed_reaches_the_proposer_as_it_is():
    from deployments.transport.remote_proposer import RemoteProposer

    for seed in (0, 42, 2**63 - 1, None):
        handle = _Handle()
        RemoteProposer(handle, affinity="v", direct=False).propose(
            [ProposeRequest("s", [1, 2, 3], 2, temperature=1.0, seed=seed)])
        (request,) = handle.seen
        assert request.seed == seed


class _ForgingProposer(Proposer):
    """Knows the seed and the target: drafts, at every position, the token the target's coupled draw
    would NOT give (its second choice under the same noise), with a forged q that makes it look
    certain. A rejection rule that trusted q, or drafts that could steer the draw, would emit them."""

    def __init__(self, target):
        self.target, self.calls = target, 0

    def propose(self, requests):
        from rayspec.sampling.sampler import coupled_key, coupled_noise, logits_to_probs

        drafts = []
        for r in requests:
            self.calls += 1
            with torch.no_grad():
                logits = self.target(torch.tensor([r.token_ids])).logits[0, -1:]
            probs = logits_to_probs(logits.float(), r.temperature, r.top_k, r.top_p)
            ratio = probs.double() / coupled_noise([coupled_key(r.seed, len(r.token_ids))], probs.shape[-1], "cpu")
            second = int(ratio.topk(2).indices[0, 1])
            q = torch.zeros(1, probs.shape[-1])
            q[0, second] = 1.0
            drafts.append(Draft([second], q))
        return drafts


def test_forged_drafts_built_with_the_seed_change_nothing(tmp_path):
    """Every draft is the token the seed's noise would pick second, with q saying it is certain:
    all rejected, and the output is target-only decoding with that seed."""
    target_dir = make_tiny_model_dir(tmp_path / "target", seed=5, num_layers=2, hidden=64, vocab_size=128,
                                     with_tokenizer=False)
    base = LLMEngine(EngineConfig(model=str(target_dir), max_model_len=128, kv_cache_memory_gb=0.05))
    params = SamplingParams(temperature=1.0, seed=77, max_tokens=16, ignore_eos=True)
    want = base.generate([[3, 4, 5, 6]], params)[0]
    forger = _ForgingProposer(_hf_model(str(target_dir)))
    engine = LLMEngine(EngineConfig(model=str(target_dir), max_model_len=128, kv_cache_memory_gb=0.05,
                                    speculative=SpeculativeConfig(method="ngram", num_speculative_tokens=1,
                                                                  adaptive=False)),
                       proposer=forger)
    got = engine.generate([[3, 4, 5, 6]], params)[0]
    assert got.token_ids == want.token_ids and forger.calls >= 8
    # (HF's logits may differ from ours in a last bit: a forged "second choice" may rarely be the first)
    assert engine.stats.num_accepted_tokens <= engine.stats.num_draft_tokens // 4


def test_build_app_gives_the_channel_secret_to_verifier_and_proposer_alone(tmp_path):
    args = tiny_args(tmp_path, topology="disaggregated",
                     speculative={"method": "draft_model", "draft_model": str(tmp_path), "num_speculative_tokens": 2})
    deployments = app_deployments(build_app(args))
    secret = deployments["Verifier"].init_args[2]
    assert "*" in repr(secret) and len(deployments["Verifier"].init_args) == 3  # a SecretStr: logs show stars
    assert deployments["Proposer"].init_args[1].get_secret_value() == secret.get_secret_value()
    assert all(getattr(a, "get_secret_value", lambda: None)() is None for a in deployments["OpenAIIngress"].init_args)


# ---- the EAGLE head's prefix cache ------------------------------------------------------------------
VOCAB, LAYERS, HIDDEN, BS = 256, 4, 64, 4
_rng = random.Random(29)
DOC = [_rng.randrange(3, VOCAB) for _ in range(70)]
FIRST, SECOND = DOC + [7, 8], DOC + [9]
SHARED = len(DOC) // BS * BS


@pytest.fixture(scope="module")
def eagle_engine(tmp_path_factory):
    from rayspec.eagle.checkpoint import new_eagle_config, save_eagle_head
    from rayspec.eagle.head import attach_target, build_head

    target_dir = make_tiny_model_dir(tmp_path_factory.mktemp("salt-target") / "model", seed=5, num_layers=LAYERS,
                                     hidden=HIDDEN, vocab_size=VOCAB, with_tokenizer=False)
    target = cached_model(str(target_dir))
    torch.manual_seed(3)
    head = build_head(new_eagle_config("eagle3", target_dir, LAYERS, HIDDEN))
    attach_target(head, target[0], has_own_embedding=False)
    head_dir = save_eagle_head(head, tmp_path_factory.mktemp("salt-eagle3") / "head")
    config = EngineConfig(model=str(target_dir), max_model_len=128, max_num_seqs=4, kv_cache_memory_gb=0.5,
                          block_size=BS, enable_prefix_caching=True,
                          speculative=SpeculativeConfig(method="eagle3", draft_model=str(head_dir),
                                                        num_speculative_tokens=4, adaptive=False))
    return LLMEngine(config, model=target[0], tokenizer=None)


def _params(salt):
    return SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, cache_salt=salt)


def _head_lookup(engine, token_ids, *salt) -> int:
    """How many of token_ids' positions the head's own cache holds for a new sequence (then freed)."""
    head = engine.proposer
    cached = head.cached_prefix("probe", token_ids, *salt)
    head.release("probe")
    return cached


def test_the_eagle_heads_prefix_cache_is_salted(eagle_engine):
    """Tenant A's prompt goes into the head's cache under A's salt: an unsalted lookup of the head's
    cache (and another tenant's) finds none of it, A's own finds it; end to end, A's next request
    reuses the prefix in target and head, B's reuses nothing, outputs equal."""
    engine = eagle_engine
    first = engine.generate([FIRST], _params("tenant-a"))[0]
    assert first.num_cached_tokens == 0
    assert engine.proposer.runner.kv.blocks.num_cached_blocks >= SHARED // BS  # the head holds A's pairs
    assert _head_lookup(engine, SECOND) == 0  # (before: the unsalted chain found all of them)
    assert _head_lookup(engine, SECOND, "tenant-b") == 0
    assert _head_lookup(engine, SECOND, "tenant-a") >= SHARED
    other = engine.generate([SECOND], _params("tenant-b"))[0]
    same = engine.generate([SECOND], _params("tenant-a"))[0]
    assert other.num_cached_tokens == 0 and same.num_cached_tokens >= SHARED
    assert same.token_ids == other.token_ids
    assert engine.kv.num_free_slots == engine.num_slots and engine.kv_cache_usage() == 0.0


# ---- the draft model's prefix cache -----------------------------------------------------------------
def test_the_draft_models_prefix_cache_is_salted(tmp_path_factory):
    """A draft model keeps its own KV cache with prefix caching: tenant A's prompt is found there by
    A's next sequence only, not by another tenant's or an unsalted one (the draft's catch-up forward
    of a found prefix is shorter: a timing channel between tenants). The salt reaches a remote
    proposer too (deployments/transport/wire.py)."""
    from deployments.transport.wire import CallLimits, decode_call, encode_call

    root = tmp_path_factory.mktemp("salt-draft")
    target_dir = make_tiny_model_dir(root / "target", seed=5, num_layers=2, hidden=HIDDEN, vocab_size=VOCAB,
                                     with_tokenizer=False)
    draft_dir = make_tiny_model_dir(root / "draft", seed=6, num_layers=1, hidden=HIDDEN, vocab_size=VOCAB,
                                    with_tokenizer=False)
    config = EngineConfig(model=str(target_dir), max_model_len=128, max_num_seqs=4, kv_cache_memory_gb=0.5,
                          block_size=BS, enable_prefix_caching=True,
                          speculative=SpeculativeConfig(method="draft_model", draft_model=str(draft_dir),
                                                        num_speculative_tokens=3, adaptive=False))
    engine = LLMEngine(config, model=cached_model(str(target_dir))[0], tokenizer=None)
    engine.generate([FIRST], _params("tenant-a"))
    draft = engine.proposer.kv
    assert draft.blocks.num_cached_blocks >= SHARED // BS  # the draft holds A's prompt

    def lookup(*salt) -> int:
        cached = draft.allocate("probe", SECOND, cache_salt=salt[0] if salt else None)
        draft.free("probe")
        return cached

    assert lookup() == 0 and lookup("tenant-b") == 0
    assert lookup("tenant-a") >= SHARED
    # end to end: the salt goes with every proposer request, and over the wire
    asked = []
    propose = engine.proposer.propose
    engine.proposer.propose = lambda requests: asked.extend(requests) or propose(requests)
    engine.generate([SECOND], _params("tenant-b"))
    assert asked and {r.cache_salt for r in asked} == {"tenant-b"}
    frame = encode_call(asked[:1], [])
    [back], _ = decode_call(frame[8:], CallLimits(max_seq_tokens=128, max_draft_tokens=8))  # (after the length)
    assert back.cache_salt == "tenant-b"
