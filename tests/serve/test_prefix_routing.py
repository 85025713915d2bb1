"""Prefix-aware routing across verifier replicas (deployments/replicas/prefix_router.py): the index, the
policy and the router's choices without Ray Serve; then 2 served verifier replicas (real local
Ray, tiny model) that repeated long prefixes reach the same replica, and that load spills over."""

from __future__ import annotations

import asyncio
import random
import uuid
from types import SimpleNamespace

import httpx
import pytest

from deployments.config import AppArgs
from deployments.replicas.prefix_router import (PrefixAwareRouter, PrefixIndex, block_hashes, preferred_replicas,
                                       prompt_units)
from deployments.transport.protocol import GenerateRequest

# ---- the policy, without Ray Serve --------------------------------------------------------------


def test_prompt_units_of_each_prompt_kind():
    assert prompt_units(GenerateRequest(prompt="hello")) == "hello"
    assert prompt_units(GenerateRequest(prompt=[5, 6, 7])) == (5, 6, 7)
    assert prompt_units({"prompt": "as a dict"}) == "as a dict"
    chat = prompt_units(GenerateRequest(messages=[{"role": "user", "content": "hi"}]))
    longer = prompt_units(GenerateRequest(messages=[{"role": "user", "content": "hi"},
                                                    {"role": "assistant", "content": "hello"}]))
    assert chat and longer.startswith(chat)  # one more turn extends the same prefix
    tools = [{"type": "function", "function": {"name": "f"}}]
    with_tools = prompt_units(GenerateRequest(messages=[{"role": "user", "content": "hi"}], tools=tools))
    assert with_tools.endswith(chat) and with_tools != chat  # the tools come first, as in the template
    assert prompt_units(SimpleNamespace()) is None and prompt_units({"tokens": [1]}) is None


def test_block_keys_stand_for_the_whole_prefix():
    a = block_hashes("abcdefgh" + "ij", 4)
    assert len(a) == 2  # the partial last block ("ij") gets no key
    assert block_hashes("abcdefgh", 4) == a
    assert block_hashes("abcdXXXX", 4)[0] == a[0] and block_hashes("abcdXXXX", 4)[1] != a[1]
    # the same second block after a different first one: a different key
    assert block_hashes("zzzzefgh", 4)[1] != a[1]
    assert block_hashes(tuple(range(8)), 4) == block_hashes(tuple(range(8)) + (9,), 4)


def test_index_matches_the_longest_prefix_per_replica():
    index = PrefixIndex(max_entries=100)
    keys = block_hashes("a" * 40, 4)  # 10 blocks
    other = block_hashes("a" * 16 + "b" * 24, 4)  # shares the first 4 blocks
    index.insert(keys, "r1")
    index.insert(other, "r2")
    assert index.match(keys, ["r1", "r2", "r3"]) == {"r1": 10, "r2": 4, "r3": 0}
    assert index.match(other, ["r1", "r2"]) == {"r1": 4, "r2": 10}
    # a replica holding later blocks but not the first matches nothing
    index.insert(block_hashes("c" * 8, 4)[1:], "r3")
    assert index.match(block_hashes("c" * 8, 4), ["r3"]) == {"r3": 0}
    assert len(index) == 10 + 10 + 1 and index.num_entries("r2") == 10


def test_index_evicts_least_recently_used_from_the_prefix_end():
    index = PrefixIndex(max_entries=12)
    first, second = block_hashes("x" * 32, 4), block_hashes("y" * 32, 4)  # 8 blocks each
    index.insert(first, "r1")
    index.insert(second, "r1")
    assert len(index) == 12
    # the first prompt lost its last 4 blocks, not its first ones; the newer one is whole
    assert index.match(first, ["r1"]) == {"r1": 4}
    assert index.match(second, ["r1"]) == {"r1": 8}
    index.insert(first[:4], "r1")  # used again: now the second prompt is the older one
    index.insert(block_hashes("z" * 16, 4), "r1")
    assert index.match(first, ["r1"]) == {"r1": 4} and index.match(second, ["r1"]) == {"r1": 4}
    assert len(index) == 12


def test_index_forgets_replicas_that_go():
    index = PrefixIndex(max_entries=100)
    keys = block_hashes("p" * 20, 4)
    for replica in ("r1", "r2", "r3"):
        index.insert(keys, replica)
    index.remove_replica("r1")
    assert index.match(keys, ["r1", "r2", "r3"]) == {"r1": 0, "r2": 5, "r3": 5}
    index.keep_only(["r3", "r4"])
    assert index.replicas == {"r3"} and len(index) == 5
    index.remove_replica("r9")  # unknown: nothing happens
    index.remove_replica("r3")
    assert len(index) == 0 and index.match(keys, ["r3"]) == {"r3": 0}


def test_policy_threshold_and_match_ratio():
    matched = {"a": 10, "b": 3, "c": 0}
    # the longest match wins while it is within the threshold of the least busy
    assert preferred_replicas(matched, {"a": 4, "b": 0, "c": 0}, imbalance_threshold=4, min_matched=1) == ["a"]
    # much busier: the next longest match among those within the threshold
    assert preferred_replicas(matched, {"a": 5, "b": 0, "c": 0}, imbalance_threshold=4, min_matched=1) == ["b"]
    # ... unless that one is too short: no preference (power of two choices)
    assert preferred_replicas(matched, {"a": 5, "b": 0, "c": 0}, imbalance_threshold=4, min_matched=4) == []
    # a full or unreachable replica has no load here, and cannot be preferred
    assert preferred_replicas(matched, {"b": 1, "c": 0}, imbalance_threshold=4, min_matched=1) == ["b"]
    assert preferred_replicas(matched, {}, imbalance_threshold=4, min_matched=1) == []
    # ties: every replica with the longest match (Serve takes the less busy one)
    assert sorted(preferred_replicas({"a": 6, "b": 6}, {"a": 1, "b": 0}, 2, 1)) == ["a", "b"]
    assert preferred_replicas({"a": 0, "b": 0}, {"a": 0, "b": 0}, 2, 0) == []  # nothing matched


def _router(**kwargs) -> PrefixAwareRouter:
    """The router's own state without Serve's (no deployment, no replicas): choose_replicas and
    on_request_routed run on it with replica stand-ins and loads given by the test."""
    router = PrefixAwareRouter.__new__(PrefixAwareRouter)
    router.initialize_state(**kwargs)
    router._use_replica_queue_len_cache = False
    router.loads = {}

    async def probe(replicas, backoff_index):
        return [(r, router.loads.get(r.replica_id)) for r in replicas]

    router._probe_queue_lens = probe
    return router


def _pending(prompt, method="generate"):
    return SimpleNamespace(args=[GenerateRequest(prompt=prompt)], kwargs={},
                           metadata=SimpleNamespace(call_method=method, internal_request_id=uuid.uuid4().hex))


def test_router_prefers_the_replica_it_sent_the_prefix_to():
    router = _router(imbalance_threshold=2, min_match_ratio=0.5, block_size=8)
    a, b = (SimpleNamespace(replica_id=r, max_ongoing_requests=8) for r in ("a", "b"))
    router.loads = {"a": 0, "b": 0}
    prefix = "shared system prompt, a long one. " * 8

    def choose(pending):  # a request that is then sent elsewhere and done: its reservation goes
        ranks = asyncio.run(router.choose_replicas([a, b], pending))
        router.on_request_completed("a", pending.metadata.internal_request_id)
        return ranks

    first = choose(_pending(prefix + "question 1"))
    assert len(first) == 1 and {r.replica_id for r in first[0]} == {"a", "b"}  # nothing known: two random
    router.on_request_routed(_pending(prefix + "question 1"), "b", None)
    assert choose(_pending(prefix + "question 2"))[0] == [b]
    # much busier (by more than the threshold): no preference, the least busy of two wins in Serve
    router.loads = {"a": 0, "b": 3}
    assert len(choose(_pending(prefix + "question 3"))) == 1
    router.loads = {"a": 0, "b": 2}
    assert choose(_pending(prefix + "question 3"))[0] == [b]
    router.loads = {"a": 0, "b": 8}  # full: not preferred either
    assert len(choose(_pending(prefix + "question 3"))) == 1
    router.loads = {"a": 0, "b": 0}
    # too little of the prompt matched (min_match_ratio 0.5)
    assert len(choose(_pending(prefix + "a different and much longer question " * 12))) == 1
    # calls that carry no prompt to prefill are not routed by prefix, nor learned
    assert len(choose(_pending(prefix, method="tokenize"))) == 1
    router.on_request_routed(_pending("another prompt, long enough " * 4, method="tokenize"), "a", None)
    assert router.index.replicas == {"b"}


def test_a_burst_chosen_at_once_spills_past_the_threshold():
    """Serve chooses for several requests before any is sent (the queue lengths it reads do not
    move in between): the router counts its own preferences until they are routed."""
    router = _router(imbalance_threshold=2, min_match_ratio=0.5, block_size=8)
    a, b = (SimpleNamespace(replica_id=r, max_ongoing_requests=16) for r in ("a", "b"))
    router.loads = {"a": 0, "b": 0}
    prefix = "shared system prompt, a long one. " * 8
    router.on_request_routed(_pending(prefix + "warm up"), "b", None)
    burst = [_pending(prefix + f"question {i}") for i in range(6)]
    ranks = [asyncio.run(router.choose_replicas([a, b], p)) for p in burst]
    preferred = [len(r) == 2 and r[0] == [b] for r in ranks]
    assert preferred == [True, True, True, False, False, False]  # b at 0, 1, 2 reserved; then 3 > 2 above a
    router.on_request_routed(burst[0], "b", None)  # routed: Serve's queue lengths count it from now
    router.loads = {"a": 0, "b": 1}
    assert asyncio.run(router.choose_replicas([a, b], _pending(prefix + "later")))[0] != [b]  # 1 + 2 reserved
    for p in burst[1:3]:
        router.on_request_completed("b", p.metadata.internal_request_id)
    assert asyncio.run(router.choose_replicas([a, b], _pending(prefix + "later")))[0] == [b]


def test_a_request_is_counted_once_from_when_serve_sends_it(monkeypatch):
    """Serve adds a request to its queue lengths (on_send_request) as soon as it has chosen the
    replica, a round trip before the replica accepts it (on_request_routed): the reservation ends at
    the choice, or a burst's other requests see that replica one request busier than it is."""
    from ray.serve.request_router import RequestRouter

    router = _router(imbalance_threshold=1, min_match_ratio=0.5, block_size=8)
    a, b = (SimpleNamespace(replica_id=r, max_ongoing_requests=16) for r in ("a", "b"))
    router.loads = {"a": 0, "b": 0}
    prefix = "shared system prompt, a long one. " * 8
    router.on_request_routed(_pending(prefix + "warm up"), "b", None)
    first = _pending(prefix + "question 1")
    assert asyncio.run(router.choose_replicas([a, b], first))[0] == [b]

    async def serve_chooses(self, pending_request, *, is_retry=False):
        return b

    monkeypatch.setattr(RequestRouter, "_choose_replica_for_request", serve_chooses)
    assert asyncio.run(router._choose_replica_for_request(first)) is b
    router.loads = {"a": 0, "b": 1}  # Serve's on_send_request; not yet accepted (no on_request_routed)
    assert asyncio.run(router.choose_replicas([a, b], _pending(prefix + "question 2")))[0] == [b]  # 1 - 0 <= 1


def test_router_falls_back_when_the_policy_fails():
    router = _router(block_size=8)
    a, b = (SimpleNamespace(replica_id=r, max_ongoing_requests=8) for r in ("a", "b"))
    router.on_request_routed(_pending("x" * 64), "a", None)

    async def broken(replicas, backoff_index):
        raise RuntimeError("probe failed")

    router._probe_queue_lens = broken
    ranks = asyncio.run(router.choose_replicas([a, b], _pending("x" * 64)))
    assert len(ranks) == 1 and len(ranks[0]) == 2


def test_config_enables_it_with_several_verifier_replicas():
    one = AppArgs.model_validate({})
    assert not one.prefix_routing_enabled and "request_router_config" not in one.verifier_options()
    two = AppArgs.model_validate({"verifier": {"num_replicas": 2}, "engine": {"max_num_seqs": 8}})
    config = two.verifier_options()["request_router_config"]
    assert config["request_router_class"] == "deployments.replicas.prefix_router.PrefixAwareRouter"
    assert config["request_router_kwargs"] == {"imbalance_threshold": 4, "min_match_ratio": 0.1, "block_size": 64,
                                               "max_entries": 200_000}
    scaled = AppArgs.model_validate({"verifier": {"autoscaling_config": {"min_replicas": 1, "max_replicas": 3}}})
    assert scaled.prefix_routing_enabled
    off = AppArgs.model_validate({"verifier": {"num_replicas": 2}, "prefix_routing": {"enabled": False}})
    assert "request_router_config" not in off.verifier_options()
    forced = AppArgs.model_validate({"prefix_routing": {"enabled": True, "imbalance_threshold": 0}})
    assert forced.verifier_options()["request_router_config"]["request_router_kwargs"]["imbalance_threshold"] == 0
    with pytest.raises(ValueError):
        AppArgs.model_validate({"prefix_routing": {"min_match_ratio": 1.5}})
    from ray.serve.config import RequestRouterConfig

    RequestRouterConfig(**config)  # Serve accepts it (imports the class)


# ---- served: 2 verifier replicas ----------------------------------------------------------------

WORDS = ("river", "stone", "cloud", "garden", "water", "light", "green", "house", "paper", "table", "music",
         "bread", "snow", "field", "road", "tree")  # one token each (with its space), in the tiny models' 8,192 ids
PREFIX_WORDS = 1500  # about 1,500 tokens (one per word)


def _prefix(k: int) -> str:
    rng = random.Random(k)
    return f"Document {k}. " + " ".join(rng.choice(WORDS) for _ in range(PREFIX_WORDS))


@pytest.fixture(scope="module")
def served(tiny_model_dir, serve_url):
    from ray import serve
    from ray_utils import serving
    from serve_utils import tiny_args

    from deployments.app import build_app

    # prefix_routing left at its defaults: on (2 replicas), imbalance_threshold max_num_seqs // 2 = 2
    args = tiny_args(tiny_model_dir, engine={"max_model_len": 2048},
                     verifier={"num_replicas": 2, "ray_actor_options": {"num_cpus": 0.5}})
    assert AppArgs.model_validate(args).verifier_options()["request_router_config"]
    with serving(("rayspec", build_app(args), "/")):
        yield SimpleNamespace(url=serve_url, handle=serve.get_app_handle("rayspec"))


def _replica(response) -> str:
    """The verifier replica that served a handle call: its engine request ids are '<replica>-<n>'."""
    return response.request_id.rsplit("-", 1)[0]


def test_repeated_prefixes_reach_the_same_replica(served):
    owner: dict[int, str] = {}
    same = cached = 0
    for round_ in range(4):
        for k in range(4):  # interleaved: prefix 0, 1, 2, 3, 0, 1, ...
            request = GenerateRequest(prompt=_prefix(k) + f"\nQuestion {round_}: what comes next?", max_tokens=4,
                                      temperature=0)
            response = served.handle.generate.remote(request).result(timeout_s=120)
            assert response.num_prompt_tokens > 1400
            if round_ == 0:
                owner[k] = _replica(response)
                continue
            same += _replica(response) == owner[k]
            cached += response.num_cached_tokens >= 1024
    print(f"prefix routing: {same}/12 repeated requests on their prefix's replica, {cached}/12 with cached tokens, "
          f"first requests on {len(set(owner.values()))} replica(s)")
    assert same >= 11, f"{same}/12 repeated requests reached the replica holding their prefix"
    assert cached >= 11, f"{cached}/12 repeated requests found their prefix in the prefix cache"
    # over HTTP (the same ingress, so the same router): OpenAI's usage reports the cache hit
    for k in range(4):
        body = {"model": "tiny", "prompt": _prefix(k) + "\nQuestion 9: and then?", "max_tokens": 4, "temperature": 0}
        usage = httpx.post(served.url + "/v1/completions", json=body, timeout=120).raise_for_status().json()["usage"]
        assert usage["prompt_tokens_details"]["cached_tokens"] >= 1024, usage


def test_a_saturated_replica_spills_to_the_other(served):
    prefix = _prefix(7)
    first = served.handle.generate.remote(GenerateRequest(prompt=prefix + "\nWarm up.", max_tokens=2,
                                                          temperature=0)).result(timeout_s=120)
    owner = _replica(first)
    # many long requests pinned to the owner by their prefix, all at once: past imbalance_threshold
    # (2) more ongoing requests than the other replica, the rest go to the other one
    responses = [served.handle.generate.remote(GenerateRequest(prompt=prefix + f"\nLoad {i}.", max_tokens=48,
                                                               ignore_eos=True, temperature=0))
                 for i in range(10)]
    replicas = [_replica(r.result(timeout_s=180)) for r in responses]
    on_owner = replicas.count(owner)
    print(f"saturated: {on_owner}/10 on the prefix's replica, {len(replicas) - on_owner}/10 spilled to the other")
    # the router prefers the owner while it has at most 2 more ongoing requests (3 of the burst); of
    # the rest, Serve sends each to the less busy replica by its own queue-length cache, whose entries
    # replicas' late accept replies can move down: how many spill varies run to run (1 to 6 of 10
    # seen in 14 runs), that some do does not
    assert on_owner >= 3 and len(replicas) - on_owner >= 1, replicas
