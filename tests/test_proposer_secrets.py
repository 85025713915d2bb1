"""What a proposer is not told (#35, second round).

- A seeded request's seed stays in the verifier: it fixes the target's random stream (the uniforms
  that accept or reject each draft token), so a proposer that knew it could time its drafts to
  those draws, and the direct channel carries frames in the clear. The proposer gets an HMAC of
  the seed under a key only the verifier deployment holds (deployments.transport.remote_proposer): the same
  on every verifier replica of an application (a seeded request still reproduces), unrelated to
  the seed without the key.
- An EAGLE head's prefix cache is salted like the target's (`cache_salt`): a tenant's prompt pairs
  are found in the head's cache under its salt only, not by an unsalted or other-salted lookup.
  So is a draft model's, and the salt goes with every propose request (over the channel too).
"""

from __future__ import annotations

import random

import pytest
import torch
from conftest import make_tiny_model_dir
from engine_utils import cached_model
from serve_utils import app_deployments, tiny_args

from deployments.app import build_app
from rayspec.config import EngineConfig, SpeculativeConfig
from rayspec.engine import LLMEngine
from rayspec.proposers import Draft, ProposeRequest
from rayspec.sampling import SamplingParams


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


def _sent_seed(seed_key, seed):
    from deployments.transport.remote_proposer import RemoteProposer

    handle = _Handle()
    remote = RemoteProposer(handle, affinity="v", direct=False, seed_key=seed_key)
    remote.propose([ProposeRequest("s", [1, 2, 3], 2, temperature=1.0, seed=seed)])
    (request,) = handle.seen
    return request.seed


def test_the_request_seed_does_not_reach_the_proposer():
    from deployments.transport.remote_proposer import proposer_seed

    for seed in (0, 42, 2**64 + 5, -7):
        sent = _sent_seed("key-a", seed)
        assert sent is not None and sent != seed and sent not in (seed + 1, seed + 0x5EED)
        assert 0 <= sent < 2**63
        assert sent == proposer_seed(b"key-a", seed)
    # the same key (every verifier replica of an app): the same drafts for the same seed
    assert _sent_seed("key-a", 42) == _sent_seed("key-a", 42) != _sent_seed("key-b", 42)
    assert _sent_seed("key-a", 42) != _sent_seed("key-a", 43)
    # no key given: a random one per RemoteProposer, still never the seed
    assert _sent_seed(None, 42) not in (42, None)
    assert _sent_seed("key-a", None) is None  # unseeded stays unseeded


def test_build_app_gives_the_seed_key_to_the_verifiers_alone(tmp_path):
    args = tiny_args(tmp_path, topology="disaggregated",
                     speculative={"method": "draft_model", "draft_model": str(tmp_path), "num_speculative_tokens": 2})
    deployments = app_deployments(build_app(args))
    verifier_args = deployments["Verifier"].init_args
    channel_secret, seed_secret = verifier_args[2], verifier_args[3]
    assert seed_secret is not None and "*" in repr(seed_secret)  # a SecretStr: logs show stars
    assert seed_secret.get_secret_value() != channel_secret.get_secret_value()
    held = [a for name in ("Proposer", "OpenAIIngress") for a in deployments[name].init_args]
    assert all(getattr(a, "get_secret_value", lambda: None)() != seed_secret.get_secret_value() for a in held)


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
    assert engine.proposer.runner.blocks.num_cached_blocks >= SHARED // BS  # the head holds A's pairs
    assert _head_lookup(engine, SECOND) == 0  # (before: the unsalted chain found all of them)
    assert _head_lookup(engine, SECOND, "tenant-b") == 0
    assert _head_lookup(engine, SECOND, "tenant-a") >= SHARED
    other = engine.generate([SECOND], _params("tenant-b"))[0]
    same = engine.generate([SECOND], _params("tenant-a"))[0]
    assert other.num_cached_tokens == 0 and same.num_cached_tokens >= SHARED
    assert same.token_ids == other.token_ids
    assert engine.runner.num_free_slots == engine.num_slots and engine.kv_cache_usage() == 0.0


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
    draft = engine.proposer.runner
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
