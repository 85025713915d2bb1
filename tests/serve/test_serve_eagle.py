"""EAGLE-3 and EAGLE-1 served on Ray Serve, colocated and disaggregated (tiny random target,
hand-set heads).

Greedy outputs over the Python handle and over HTTP must equal the target's own greedy output
(an in-process engine without speculation) while the head drafts token trees (eagle_topk 4) or
chains (eagle_topk 1; the "chain" app serves EAGLE-1, method "eagle", with an oracle head that
drafts the target's greedy continuations). Disaggregated, the verifier's engine sends the target features of every
committed token to the proposer deployment and gets drafts back, token trees with their parents.
"""

from __future__ import annotations

import asyncio
import inspect
import pickle

import httpx
import pytest
import torch

import ray
import ray.serve as serve

from conftest import make_tiny_model_dir  # noqa: E402
from eagle_utils import PROMPTS, TARGET_LAYERS, copy_head, oracle_head  # noqa: E402
from ray_utils import serving  # noqa: E402
from serve_utils import tiny_args  # noqa: E402

from deployments.app import build_app  # noqa: E402
from deployments.transport.protocol import GenerateRequest  # noqa: E402
from deployments.replicas.proposer import Proposer  # noqa: E402
from deployments.transport.remote_proposer import RemoteProposer  # noqa: E402
from rayspec.config import EngineConfig, SpeculativeConfig  # noqa: E402
from rayspec.eagle.checkpoint import save_eagle_head  # noqa: E402
from rayspec.engine.llm_engine import LLMEngine  # noqa: E402
from rayspec.sampling.sampler import SamplingParams  # noqa: E402

MAX_TOKENS = 32
ENGINE = {"max_model_len": 1024, "max_num_seqs": 4, "kv_cache_memory_gb": 0.25}
# app name -> (topology, eagle_topk); "chain" serves EAGLE-1 (EAGLE_1_APPS), the others EAGLE-3
# (The replica-killing tests run last in this module, on "disaggregated" (its proposer) and "chain" (its
# verifier), and wait for Serve's replacement: no apps of their own to deploy.)
APPS = {"colocated": ("colocated", 4), "disaggregated": ("disaggregated", 4), "chain": ("disaggregated", 1),
        "two_proposers": ("disaggregated", 4)}  # with 2 proposer replicas
EAGLE_1_APPS = {"chain"}


def _engine(target, **spec) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(target), **ENGINE, speculative=SpeculativeConfig(**spec)))


@pytest.fixture(scope="session")  # session: its tests run in two tiers (tests/conftest.py), it is built once
def eagle_setup(tmp_path_factory):
    """A tiny 8-layer target, its greedy outputs (no speculation) and an EAGLE-3 head for it."""
    root = tmp_path_factory.mktemp("serve-eagle")
    target = make_tiny_model_dir(root / "target", num_layers=TARGET_LAYERS)
    ref = _engine(target, method="none").generate(
        PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
    draft_tokens = sorted({t for o in ref for t in o.token_ids} | set(range(3, 67)))
    head_dir = save_eagle_head(copy_head(target, draft_tokens), root / "head")
    # EAGLE-1: an oracle head (its drafts are the target's greedy continuations of these prompts)
    head1 = save_eagle_head(oracle_head(target, TARGET_LAYERS, 64, [o.token_ids for o in ref], kind="eagle"),
                            root / "head1")
    return {"target": target, "head": head_dir, "head1": head1, "ref": ref}


def _spec(head_dir, topk: int, method: str = "eagle3") -> dict:
    return {"method": method, "draft_model": str(head_dir), "num_speculative_tokens": 4, "eagle_topk": topk,
            "num_steps": 3, "adaptive": False, "tree_max_batch": 8}


# ---- the remote proposer without Ray: a handle that pickles, as between Ray actors -------------
class _Response:
    def __init__(self, handle, value, error):
        self.handle, self.value, self.error = handle, value, error

    def result(self, timeout_s=None):
        if self.error is not None:
            raise self.error
        return self.value

    def cancel(self):
        self.handle.cancelled += 1


class _LocalHandle:
    """Calls go to `route(call number)`-th replica; arguments and results are pickled both ways."""

    def __init__(self, *replicas, route=lambda n: 0):
        self.replicas, self.route, self.calls, self.options_seen = replicas, route, [], []
        self.cancelled = 0  # responses cancelled by the caller

    def options(self, **kwargs):
        self.options_seen.append(kwargs)
        return self

    def __getattr__(self, name):
        handle = self

        class _Method:
            def remote(self, *args):
                args = pickle.loads(pickle.dumps(args))
                replica = handle.replicas[handle.route(len(handle.calls)) % len(handle.replicas)]
                handle.calls.append((name, args))
                try:
                    value = getattr(replica, name)(*args)
                    if inspect.iscoroutine(value):
                        value = asyncio.run(value)
                    value, error = pickle.loads(pickle.dumps(value)), None
                except Exception as err:  # noqa: BLE001 - raised by result(), as a DeploymentResponse does
                    value, error = None, err
                return _Response(handle, value, error)

        return _Method()


def test_remote_proposer_carries_features_and_trees(eagle_setup):
    args = tiny_args(eagle_setup["target"], topology="disaggregated", speculative=_spec(eagle_setup["head"], 4),
                     engine={**ENGINE, "device": "cpu"})
    replica = Proposer.func_or_class(args)  # the deployment's class, in this process
    handle = _LocalHandle(replica)
    remote = RemoteProposer(handle, device="cpu", affinity="verifier-a", direct=False)
    assert remote.feature_layers == (2, 4, 5)
    assert handle.options_seen == [{"multiplexed_model_id": "verifier-a"}]  # calls stick to one replica
    engine = LLMEngine(EngineConfig(model=str(eagle_setup["target"]), **ENGINE,
                                    speculative=SpeculativeConfig(**_spec(eagle_setup["head"], 4))), proposer=remote)
    out = engine.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
    assert [o.token_ids for o in out] == [o.token_ids for o in eagle_setup["ref"]]
    assert [name for name, _ in handle.calls].count("feature_layers") == 1  # asked once
    assert [name for name, _ in handle.calls].count("pin") == 1  # the tag registered once, before proposing
    sent = [r for name, args in handle.calls if name == "propose" for r in args[0]]
    assert sent and all(r.features is not None and r.features.device.type == "cpu" for r in sent)
    assert sent[0].features.shape[-1] == 3 * 64 and sent[0].features_start == 0
    stats = replica.stats()
    assert stats["num_tree_drafts"] > 0 and stats["feature_layers"] == [2, 4, 5]
    assert sum(o.num_accepted_tokens for o in out) > 0
    remote.flush()  # finished sequences are released on the proposer side too
    name, (requests, released) = handle.calls[-1]
    assert name == "propose" and not requests and released
    assert remote.num_resent == 0 and not remote._sent  # one replica: never resent; host copies freed


def test_remote_eagle1_proposer_drafts_chains_from_the_last_hidden_state(eagle_setup):
    """EAGLE-1 (method "eagle") through the proposer deployment's class and RemoteProposer, as the
    "chain" app serves it, without Ray: the verifier sends the target's last hidden state, the oracle
    head's chains come back, most are accepted, and the output is the target's own greedy output."""
    spec = _spec(eagle_setup["head1"], 1, "eagle")
    args = tiny_args(eagle_setup["target"], topology="disaggregated", speculative=spec,
                     engine={**ENGINE, "device": "cpu"})
    handle = _LocalHandle(Proposer.func_or_class(args))
    remote = RemoteProposer(handle, device="cpu", affinity="verifier-a", direct=False)
    assert remote.feature_layers == ()
    engine = LLMEngine(EngineConfig(model=str(eagle_setup["target"]), **ENGINE,
                                    speculative=SpeculativeConfig(**spec)), proposer=remote)
    out = engine.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
    assert [o.token_ids for o in out] == [o.token_ids for o in eagle_setup["ref"]]
    sent = [r for name, args in handle.calls if name == "propose" for r in args[0]]
    assert sent and sent[0].features.shape[-1] == 64  # the last hidden state, one position per row
    stats = engine.stats
    print("eagle1 remote", stats.as_dict())
    assert stats.num_accepted_tokens > stats.num_draft_tokens / 2, stats.as_dict()


@pytest.mark.parametrize("route", ["replaced", "round-robin"])
def test_remote_eagle_proposer_survives_other_replicas(eagle_setup, route):
    """Several proposer replicas: the verifier's calls may land on a replica that lacks a
    sequence's features (routing before affinity holds, a replaced replica). It answers
    resend_features_from, the call is retried with the kept features, and the output stays the
    target's own. "replaced": replica A serves the first calls, then B (A is gone); "round-robin":
    every call changes replica (the worst routing: each step rebuilds the sequence)."""
    args = tiny_args(eagle_setup["target"], topology="disaggregated", speculative=_spec(eagle_setup["head"], 4),
                     engine={**ENGINE, "device": "cpu"})
    replicas = [Proposer.func_or_class(args), Proposer.func_or_class(args)]
    handle = _LocalHandle(*replicas, route={"replaced": lambda n: int(n > 6), "round-robin": lambda n: n}[route])
    remote = RemoteProposer(handle, device="cpu", affinity="verifier-a", direct=False)
    engine = LLMEngine(EngineConfig(model=str(eagle_setup["target"]), **ENGINE,
                                    speculative=SpeculativeConfig(**_spec(eagle_setup["head"], 4))), proposer=remote)
    out = engine.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
    assert [o.token_ids for o in out] == [o.token_ids for o in eagle_setup["ref"]]
    assert remote.num_resent >= len(PROMPTS)  # every running sequence was caught up on the new replica
    assert all(r.stats()["num_calls"] > 0 for r in replicas)
    accepted = sum(o.num_accepted_tokens for o in out)
    assert accepted > 0  # drafts after the switch were real, not empty
    if route == "replaced":  # after one catch-up per sequence, B drafts on as A did
        assert remote.num_resent == len(PROMPTS)


def test_remote_proposer_call_that_fails_costs_drafts_not_requests(eagle_setup):
    """A proposer replica dies mid-generation: its call raises. That step runs without drafts
    (a plain target step), the next calls reach the replacement, which asks for the features
    again; the requests finish with the target's own output."""
    args = tiny_args(eagle_setup["target"], topology="disaggregated", speculative=_spec(eagle_setup["head"], 4),
                     engine={**ENGINE, "device": "cpu"})
    first, replacement = Proposer.func_or_class(args), Proposer.func_or_class(args)

    class Dying:  # replica 0: answers 4 propose calls, then its actor is gone
        calls = 0

        def feature_layers(self):
            return first.feature_layers()

        async def pin(self):
            return await first.pin()

        async def propose(self, requests, released=None):
            Dying.calls += 1
            if Dying.calls > 4:
                raise RuntimeError("the replica's actor died")
            return await first.propose(requests, released)

    # call 0 asks feature_layers, call 1 pins, calls 2-6 propose on replica 0 (the 5th raises), then replica 1
    handle = _LocalHandle(Dying(), replacement, route=lambda n: 0 if n <= 6 else 1)
    ticks = iter(range(10**6))  # a clock that moves 0.25 s per reading: the 1 s back-off passes in steps
    remote = RemoteProposer(handle, device="cpu", affinity="verifier-a", clock=lambda: next(ticks) * 0.25,
                            direct=False)
    engine = LLMEngine(EngineConfig(model=str(eagle_setup["target"]), **ENGINE,
                                    speculative=SpeculativeConfig(**_spec(eagle_setup["head"], 4))), proposer=remote)
    out = engine.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
    assert [o.token_ids for o in out] == [o.token_ids for o in eagle_setup["ref"]]
    assert remote.num_failed_calls == 1  # call 6 raised; the engine went on
    names = [name for name, _ in handle.calls]
    assert names[:3] == ["feature_layers", "pin", "propose"] and names.count("pin") == 2  # pinned again
    assert names[names.index("pin", 2) + 1] == "propose"  # after the failure: pin first, then propose
    assert remote.num_skipped_steps >= 1  # then left the proposer alone for its back-off
    assert remote.num_resent >= len(PROMPTS)  # the replacement caught every sequence up
    assert replacement.stats()["num_calls"] > 0 and sum(o.num_accepted_tokens for o in out) > 0


def test_remote_proposer_direct_channel(eagle_setup):
    """The per-step calls go over the pinned replica's direct channel, not the handle; the output is
    the target's own. When that replica's channel dies mid-generation, the step runs without
    drafts, the verifier pins again (here: a replacement replica), connects to its channel, and the
    replacement catches the sequences up from the resent features. (The channel itself, against
    hostile input: tests/unit/test_direct_channel.py.)"""
    args = tiny_args(eagle_setup["target"], topology="disaggregated", speculative=_spec(eagle_setup["head"], 4),
                     engine={**ENGINE, "device": "cpu"})
    secret = "an application's channel secret"  # deployments.app makes one per app
    first, replacement = Proposer.func_or_class(args, secret), Proposer.func_or_class(args, secret)
    handle = _LocalHandle(first, replacement, route=lambda n: 0 if n < 2 else 1)  # feature_layers, pin: first
    ticks = iter(range(10**6))
    remote = RemoteProposer(handle, device="cpu", affinity="verifier-a", clock=lambda: next(ticks) * 0.25,
                            channel_secret=secret)
    engine = LLMEngine(EngineConfig(model=str(eagle_setup["target"]), **ENGINE,
                                    speculative=SpeculativeConfig(**_spec(eagle_setup["head"], 4))), proposer=remote)
    remote.vocab_size = engine.model.args.vocab_size  # as the Verifier does: drafts are checked against it
    steps = [0]
    original_propose = first._propose

    def dying(requests, released):  # the first replica answers 4 calls, then its channel is gone
        steps[0] += 1
        if steps[0] > 4:
            first._channel.close()
            raise ConnectionError("replica died")
        return original_propose(requests, released)

    first._channel_address()  # start it, then route its handler through `dying`
    first._channel._handler = dying
    out = engine.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
    assert [o.token_ids for o in out] == [o.token_ids for o in eagle_setup["ref"]]
    names = [name for name, _ in handle.calls]
    assert "propose" not in names and names.count("pin") == 2  # every step direct; pinned again after the loss
    assert remote.num_failed_calls == 1 and remote.num_direct_calls == remote.num_calls > 4
    assert first.stats()["num_calls"] == 4 and replacement.stats()["num_calls"] > 0
    assert remote.num_resent >= len(PROMPTS) and sum(o.num_accepted_tokens for o in out) > 0
    for replica in (first, replacement):  # one authenticated connection each, nothing refused
        assert replica.stats()["channel_connections"] == 1 and replica.stats()["channel_rejected"] == 0


def test_remote_proposer_backs_off_after_failures():
    """A proposer that keeps failing (down, or hanging into timeouts) is called again only after
    1 s, then 2 s, ...: the steps in between get no drafts at once instead of waiting on it."""
    from rayspec.proposers import ProposeRequest

    class Down:
        calls = 0

        def feature_layers(self):
            return None

        async def propose(self, requests, released=None):
            Down.calls += 1
            raise TimeoutError("no answer")

    now = [0.0]
    handle = _LocalHandle(Down())
    remote = RemoteProposer(handle, clock=lambda: now[0])
    request = ProposeRequest("s", [1, 2, 3], 2)
    for t, calls, skipped in [(0.0, 1, 0), (0.5, 1, 1), (1.0, 2, 1), (2.9, 2, 2), (3.0, 3, 2)]:
        now[0] = t
        assert [d.tokens for d in remote.propose([request])] == [[]]
        assert (Down.calls, remote.num_skipped_steps) == (calls, skipped), t
    assert remote.num_failed_calls == 3
    assert handle.cancelled == 3  # a timed-out call is cancelled, not left to run later on stale state


# ---- served -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def served(eagle_setup, serve_url):
    apps = []
    for name, (topology, topk) in APPS.items():
        spec = (_spec(eagle_setup["head1"], topk, "eagle") if name in EAGLE_1_APPS
                else _spec(eagle_setup["head"], topk))
        args = tiny_args(eagle_setup["target"], topology=topology, speculative=spec,
                         engine=ENGINE)
        if name == "two_proposers":
            args["proposer"] = {**args["proposer"], "num_replicas": 2}
        apps.append((name, build_app(args), f"/{name}"))
    with serving(*apps):
        yield serve_url


@pytest.mark.parametrize("app", list(APPS))
def test_greedy_matches_target_alone(served, eagle_setup, app):
    handle = serve.get_app_handle(app)
    responses = [handle.generate.remote(GenerateRequest(prompt=p, max_tokens=MAX_TOKENS, temperature=0,
                                                        ignore_eos=True)) for p in PROMPTS]  # one batch
    results = [r.result(timeout_s=120) for r in responses]
    ref = eagle_setup["ref"]
    assert [r.token_ids for r in results] == [o.token_ids for o in ref]
    assert sum(r.num_draft_tokens for r in results) > 0
    assert sum(r.num_accepted_tokens for r in results) > 0
    if app in EAGLE_1_APPS:  # the oracle head: most of its drafts accepted
        print(app, [(r.num_draft_tokens, r.num_accepted_tokens) for r in results])
        assert sum(r.num_accepted_tokens for r in results) > sum(r.num_draft_tokens for r in results) / 2
    body = {"model": "tiny", "prompt": PROMPTS[1], "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    resp = httpx.post(f"{served}/{app}/v1/completions", json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["text"] == ref[1].text


def test_two_eagle_proposer_replicas(served, eagle_setup):
    """Two proposer replicas: the verifier's calls carry its tag (multiplexed model id), registered
    on one replica, so once the router knows that, they stick to it; whatever the router does,
    outputs stay the target's and drafts keep being accepted."""
    handle = serve.get_app_handle("two_proposers")

    def one_round() -> int:
        """Sequences whose features were resent (a call landed on the replica without them) in one round."""
        before = handle.stats.remote().result(timeout_s=60)["proposer_features_resent"]
        results = [r.result(timeout_s=120) for r in [
            handle.generate.remote(GenerateRequest(prompt=p, max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True))
            for p in PROMPTS]]
        assert [r.token_ids for r in results] == [o.token_ids for o in eagle_setup["ref"]]
        assert sum(r.num_accepted_tokens for r in results) > 0
        return handle.stats.remote().result(timeout_s=60)["proposer_features_resent"] - before

    # the router learns the registration a moment late: calls sent before may land anywhere
    warmup = [one_round()]
    while warmup[-1] and len(warmup) < 5:
        warmup.append(one_round())
    assert warmup[-1] == 0, warmup
    assert [one_round() for _ in range(3)] == [0, 0, 0]  # affinity holds: every call reaches the same replica
    stats = handle.stats.remote().result(timeout_s=60)
    assert stats["proposer_calls"] > 0 and stats["proposer_failed_calls"] == 0


def _stream_long_request(app: str, eagle_setup, n: int):
    """-> (the target's own greedy output, an iterator over the app's chunks) for a long request."""
    prompt = PROMPTS[1]
    want = _engine(eagle_setup["target"], method="none").generate(
        [prompt], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))[0]
    stream = serve.get_app_handle(app).options(stream=True).generate_stream.remote(
        GenerateRequest(prompt=prompt, max_tokens=n, temperature=0, ignore_eos=True))
    return want, iter(stream)


def _replica_names(app: str, deployment: str) -> list[str]:
    return [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
            if a["name"].startswith(f"SERVE_REPLICA::{app}#{deployment}#")]


@pytest.mark.parametrize("app", ["disaggregated", "chain"])
def test_proposer_deployment_drafts_from_sent_features(served, eagle_setup, app):
    """This test's requests (one batch) are drafted by the proposer deployment from the features
    the verifier sent: its counters move, by token trees for eagle_topk > 1, chains otherwise."""
    proposer = serve.get_deployment_handle("Proposer", app_name=app)
    before = proposer.stats.remote().result(timeout_s=60)
    handle = serve.get_app_handle(app)
    results = [r.result(timeout_s=120) for r in [
        handle.generate.remote(GenerateRequest(prompt=p, max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True))
        for p in PROMPTS]]
    assert [r.token_ids for r in results] == [o.token_ids for o in eagle_setup["ref"]]
    assert sum(r.num_accepted_tokens for r in results) > 0
    stats = proposer.stats.remote().result(timeout_s=60)
    if app in EAGLE_1_APPS:  # EAGLE-1: the target's last hidden state
        assert stats["method"] == "eagle" and stats["feature_layers"] == [], stats
    else:
        assert stats["method"] == "eagle3" and stats["feature_layers"] == [2, 4, 5]
    calls = stats["num_calls"] - before["num_calls"]
    assert calls > 0 and stats["num_requests"] - before["num_requests"] > calls  # batched: several sequences a call
    trees = stats["num_tree_drafts"] - before["num_tree_drafts"]
    # trees came back to the verifier with their parents, for eagle_topk > 1 only
    assert (trees > 0) == (APPS[app][1] > 1), trees


def test_sampled_requests_draft_chains_remotely(served, eagle_setup):
    """temperature > 0: chains with draft probabilities over the wire; a seeded request samples
    exactly what an in-process engine samples with that seed, target-only decoding (coupled draws,
    rayspec.sampling.sampler), and drafts were verified."""
    params = {"max_tokens": 24, "temperature": 0.8, "seed": 7, "ignore_eos": True}
    handle = serve.get_app_handle("disaggregated")
    engine = _engine(eagle_setup["target"], method="none")
    for prompt in PROMPTS[:2]:
        got = handle.generate.remote(GenerateRequest(prompt=prompt, **params)).result(timeout_s=120)
        want = engine.generate([prompt], SamplingParams(**params))[0]
        assert got.token_ids == want.token_ids and got.num_draft_tokens > 0 and want.num_draft_tokens == 0


def test_eagle_proposer_evicts_the_stalest_sequence(eagle_setup):
    """Out of slots (sequences another verifier's routing left behind), the proposer frees the one it
    saw last longest ago; when that one comes back it asks for its features again."""
    from rayspec.proposers import ProposeRequest

    args = tiny_args(eagle_setup["target"], topology="disaggregated", speculative=_spec(eagle_setup["head"], 1),
                     engine={**ENGINE, "device": "cpu", "max_num_seqs": 2})  # two draft slots
    replica = Proposer.func_or_class(args)
    torch.manual_seed(0)

    def ask(seq_id, ids, start):
        req = ProposeRequest(seq_id, ids, 2, features=torch.randn(len(ids) - 1 - start, 3 * 64), features_start=start)
        return asyncio.run(replica.propose([req]))[0]

    assert ask("a", [5, 6, 7], 0).tokens
    assert ask("b", [8, 9, 10], 0).tokens
    assert ask("a", [5, 6, 7, 11], 2).tokens  # a continues; b is now the stalest
    assert ask("c", [13, 14, 15], 0).tokens  # no free slot: b goes
    assert ask("a", [5, 6, 7, 11, 16], 3).tokens  # a kept its state
    back = ask("b", [8, 9, 10, 12], 2)
    assert back.resend_features_from == 0 and not back.tokens
    assert ask("b", [8, 9, 10, 12], 0).tokens  # features from the start: rebuilt (c is evicted for it)


def test_killed_proposer_replica_loses_no_request(served, eagle_setup):
    """The proposer replica's actor is killed while a request streams: the request finishes with
    the target's own output (steps whose proposer call failed ran without drafts), and once Serve
    has replaced the replica, requests draft again on the new one."""
    import time

    want, chunks = _stream_long_request("disaggregated", eagle_setup, 400)  # in flight when the kill lands
    handle = serve.get_app_handle("disaggregated")
    got = []
    while len(got) < 64:  # the sequence's draft state now lives on that replica
        got += next(chunks).delta_token_ids
    [replica] = _replica_names("disaggregated", "Proposer")
    ray.kill(ray.get_actor(replica, namespace="serve"), no_restart=True)
    got += [t for chunk in chunks for t in chunk.delta_token_ids]
    assert got == want.token_ids
    stats = handle.stats.remote().result(timeout_s=60)
    # the kill landed mid-request: the next call either failed (that step ran without drafts) or Serve
    # routed it to the replacement once up, which lacked the sequence and was sent its features again
    assert stats["proposer_failed_calls"] + stats["proposer_features_resent"] >= 1

    request = GenerateRequest(prompt=PROMPTS[0], max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    deadline = time.monotonic() + 90
    while True:  # until the replacement replica is up and drafting
        result = handle.generate.remote(request).result(timeout_s=120)
        assert result.token_ids == eagle_setup["ref"][0].token_ids
        if result.num_accepted_tokens > 0 or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert result.num_accepted_tokens > 0
    new = _replica_names("disaggregated", "Proposer")
    assert new and replica not in new


def test_killed_verifier_replica_loses_no_request(served, eagle_setup):
    """The verifier replica's actor is killed while a request streams through the ingress: the
    ingress sends the request again with the tokens streamed so far, Serve's replacement replica
    prefills them and goes on, and the caller gets one unbroken stream equal to the target's output.

    The kill is triggered by the request's progress (after its first chunks reached the caller),
    long before its 600 tokens are done (seconds of decoding are left when the kill lands, a few
    milliseconds after the caller got the chunk that triggers it), and the ingress's failover count
    shows the request did cross the kill (it was resumed on another replica, not finished before)."""
    n = 600
    app = serve.get_app_handle("chain")

    def failovers() -> dict:
        stats = app.stats.remote().result(timeout_s=60)
        return {k: stats[k] for k in ("num_stream_failovers", "num_request_failovers")}

    before = failovers()
    [replica] = _replica_names("chain", "Verifier")
    actor = ray.get_actor(replica, namespace="serve")  # looked up before: the kill lands at once
    want, chunks = _stream_long_request("chain", eagle_setup, n)
    got, text = [], ""
    while len(got) < 32:
        chunk = next(chunks)
        got, text = got + chunk.delta_token_ids, text + chunk.delta_text
    ray.kill(actor, no_restart=True)
    rest = list(chunks)
    got += [t for chunk in rest for t in chunk.delta_token_ids]
    text += "".join(chunk.delta_text for chunk in rest)
    assert got == want.token_ids and text == want.text  # nothing lost, nothing twice
    assert rest[-1].finished and rest[-1].finish_reason == "length" and rest[-1].num_output_tokens == n
    after = failovers()
    assert after["num_stream_failovers"] >= before["num_stream_failovers"] + 1, (before, after)  # it was resumed
    assert after["num_request_failovers"] == before["num_request_failovers"]  # and no whole request re-sent
    new = _replica_names("chain", "Verifier")
    assert new and replica not in new
    stats = app.stats.remote().result(timeout_s=60)
    # it finished on the replacement (actor names end in the replica id the stats report)
    assert stats["num_finished"] == 1 and [stats["replica"]] == [r.rsplit("#", 1)[-1] for r in new]

    # the same over HTTP: an SSE stream whose verifier replica is killed stays one valid stream
    import json

    [replica] = new
    actor = ray.get_actor(replica, namespace="serve")
    before = after
    body = {"model": "tiny", "prompt": PROMPTS[1], "max_tokens": n, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    events = []
    with httpx.stream("POST", f"{served}/chain/v1/completions", json=body, timeout=180) as resp:
        assert resp.status_code == 200
        for line in resp.iter_lines():
            if not line.startswith("data: "):
                continue
            events.append(line[len("data: "):])
            if len(events) == 16:
                ray.kill(actor, no_restart=True)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all("error" not in c for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == want.text
    assert chunks[-1]["usage"]["completion_tokens"] == n
    assert replica not in _replica_names("chain", "Verifier")
    resp = httpx.get(f"{served}/chain/v1/stats", timeout=60)
    assert resp.status_code == 200, resp.text
    stats = resp.json()
    assert stats["num_stream_failovers"] >= before["num_stream_failovers"] + 1, (before, stats)
    assert stats["num_request_failovers"] == before["num_request_failovers"]
    new = _replica_names("chain", "Verifier")
    assert stats["num_finished"] == 1 and [stats["replica"]] == [r.rsplit("#", 1)[-1] for r in new]
