"""Admission control and faults under load, on one local Ray cluster (one Serve instance, two apps).

- `bounded`: a colocated app with small limits at every hop (ingress gate, verifier queue, engine
  waiting queue): a burst above them gets only 200s and 429s with Retry-After (OpenAI error JSON),
  quickly; the 200s carry the target's own greedy output.
- `faults`: a disaggregated app (draft model) with two ingress and two verifier replicas and one
  proposer. Under 16 streaming clients, a proposer replica, a verifier replica and an ingress replica
  are killed in turn (`ray.kill`, no graceful shutdown). Every stream must end before a deadline,
  either complete with the target's greedy output and `[DONE]`, or (only for streams that were on the
  killed ingress replica, which held their HTTP connection) cut short; afterwards every verifier
  replica is idle again: no running or waiting request, every KV slot free.
- 100 streams whose clients go away after their first chunk leave the engines idle, each counted
  as an abort.
- Failover beyond greedy streams: sampled streams, non-streamed requests (sent again whole), and the
  colocated topology (the `bounded` app's only verifier replica killed: the stream resumes on the
  replacement). Each kill test asserts that the ingress replicas counted a failover.
"""

from __future__ import annotations

import asyncio
import json
import os
import time

import httpx
import pytest

import ray
import ray.serve as serve
from ray.serve.exceptions import BackPressureError
from ray_utils import serving
from serve_utils import astream_completion, tiny_args, wait_for

import deployments.frontend.ingress as ingress_module
from deployments.app import build_app
from rayspec.config import EngineConfig, SpeculativeConfig
from rayspec.engine.llm_engine import EngineOverloadedError, LLMEngine
from rayspec.sampling.sampler import SamplingParams

NUM_CLIENTS = 16
FAULT_TOKENS = 320  # long enough that every stream is mid-way when the kill lands
DEADLINE_S = 180.0  # no stream may take longer, kill or not
ABUSE_BODY_LIMIT = 256 << 10  # the faults app's: below benchmarks/abuse.py --dry-run's 1 MiB bodies
ABUSE_BODY_TIMEOUT_S = 10.0  # the faults app's body_timeout_s, as the proxy's (tests/ray_utils.py): 4 s gave good clients 408s on a loaded machine
PROMPTS = [f"{i} one two three four five {i} one two three four five {i} six" for i in range(NUM_CLIENTS)]

BOUNDED = {"engine": {"max_num_seqs": 2, "max_num_waiting": 0},
           "verifier": {"max_ongoing_requests": 3, "max_queued_requests": 1},
           "ingress": {"max_ongoing_requests": 5}, "retry_after_s": 2}


def _faults_args(target, draft) -> dict:
    return tiny_args(target, topology="disaggregated",
                     speculative={"method": "draft_model", "draft_model": str(draft), "num_speculative_tokens": 3,
                                  "adaptive": False},
                     engine={"max_num_seqs": NUM_CLIENTS},  # either replica can run every stream at once
                     ingress={"num_replicas": 2}, verifier={"num_replicas": 2},
                     max_request_body_bytes=ABUSE_BODY_LIMIT, body_timeout_s=ABUSE_BODY_TIMEOUT_S)


@pytest.fixture(scope="module")
def served(tiny_model_dir, tiny_draft_dir, serve_url):
    with serving(("bounded", build_app(tiny_args(tiny_model_dir, **BOUNDED)), "/bounded"),
                 ("faults", build_app(_faults_args(tiny_model_dir, tiny_draft_dir)), "/faults")):
        yield serve_url


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    """The target's own greedy outputs (no speculation), as text."""
    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir), max_model_len=1024, max_num_seqs=NUM_CLIENTS,
                                    kv_cache_memory_gb=0.25, speculative=SpeculativeConfig(method="none")))

    def texts(max_tokens: int) -> list[str]:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        return [o.text for o in engine.generate(PROMPTS, params)]

    return texts


def sampled_reference(tiny_model_dir, max_tokens: int) -> list[str]:
    """What each seeded sampled stream of _sampled_stream must say, fault or not: target-only decoding
    with its seed (a seeded request draws coupled, rayspec.sampling.sampler: the same tokens whatever
    was drafted, on whichever engine it resumes)."""
    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir), max_model_len=1024, max_num_seqs=NUM_CLIENTS,
                                    kv_cache_memory_gb=0.25, speculative=SpeculativeConfig(method="none")))
    params = [SamplingParams(temperature=0.9, top_p=0.95, seed=1000 + i, max_tokens=max_tokens, ignore_eos=True)
              for i in range(len(PROMPTS))]
    return [o.text for o in engine.generate(PROMPTS, params)]


# ---- helpers ------------------------------------------------------------------------------------
def _replicas(app: str, deployment: str) -> list[str]:
    return sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                  if a["name"].startswith(f"SERVE_REPLICA::{app}#{deployment}#"))


def _kill(name: str) -> None:
    ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)


def _wait_replaced(app: str, deployment: str, killed: str, count: int, timeout: float = 120) -> None:
    """Until Serve runs `count` replicas of the deployment again, the killed one not among them."""
    def replaced():
        names = _replicas(app, deployment)
        return len(names) == count and killed not in names
    wait_for(replaced, timeout=timeout, interval=0.5)
    serve_status = lambda: serve.status().applications[app].status == "RUNNING"  # noqa: E731
    wait_for(serve_status, timeout=timeout, interval=0.5)


def _per_replica(app: str, deployment: str, count: int) -> list[dict]:
    """Each running replica's own `record_routing_stats`, asked through its actor (a handle call goes
    where the router sends it: under load, always to the idle replica). Waits until `count` replicas
    run and answer (a replacement may still be starting)."""
    got: list[dict] = []

    def answered() -> bool:
        got.clear()
        for name in _replicas(app, deployment):
            try:
                got.append(ray.get(ray.get_actor(name, namespace="serve").record_routing_stats.remote(), timeout=60))
            except (ValueError, ray.exceptions.RayError):  # gone or not yet up: ask again
                return False
        return len(got) == count
    wait_for(answered, timeout=120, interval=0.2)
    return list(got)


def _verifier_stats(app: str, count: int) -> dict[str, dict]:
    """Stats of every verifier replica, by replica."""
    return {s["replica"]: s for s in _per_replica(app, "Verifier", count)}


def _busiest_verifier(app: str, count: int) -> str | None:
    """The actor name of the verifier replica running the most sequences now, None if none runs any
    (just after a replacement came up, the ingress routers may send every stream to one replica)."""
    stats = _verifier_stats(app, count)
    busy = sorted((-s["num_running"], r) for r, s in stats.items() if s["num_running"] > 0)
    names = [n for n in _replicas(app, "Verifier") if busy and n.endswith("#" + busy[0][1])]
    return names[0] if names else None


def _idle(app: str, count: int) -> bool:
    stats = _verifier_stats(app, count)
    return all(s["num_running"] == 0 and s["num_waiting"] == 0 and s["num_free_slots"] == s["num_slots"]
               for s in stats.values())


def _failovers(app: str, count: int) -> dict[str, dict]:
    """Failover counts of every ingress replica (each counts its own): replica id -> counts."""
    return {s["ingress_replica"]: {k: s[k] for k in ("num_stream_failovers", "num_request_failovers")}
            for s in _per_replica(app, "OpenAIIngress", count)}


def _failovers_since(app: str, before: dict[str, dict], count: int) -> dict[str, int]:
    """Failovers the ingress replicas counted since `before` (a replica not in it counts from 0)."""
    after = _failovers(app, count)
    return {key: sum(a[key] - before.get(rid, {}).get(key, 0) for rid, a in after.items())
            for key in ("num_stream_failovers", "num_request_failovers")}


async def _until_under_way(tasks: list[asyncio.Task], progress: list[int], events: int) -> None:
    """Until every stream has had `events` events or has ended. A stream may end before the fault
    only complete ([DONE], no error): the proxy and the routers need not spread the streams evenly
    (just after a replacement came up, one replica may run a single stream and finish it while the
    other still runs 15), but a stream that ended any other way before the fault is a failure of its
    own, reported with what it got (CI run 26 saw "a stream ended before the fault" and no more)."""
    started = time.monotonic()
    while any(n < events and not t.done() for n, t in zip(progress, tasks)):
        assert time.monotonic() - started < DEADLINE_S, ("streams did not start", progress)
        await asyncio.sleep(0.02)
    for i, t in enumerate(tasks):
        if t.done():
            r = t.result()
            assert r["status"] == 200 and r["error"] is None and r["done"], (
                f"stream {i} ended before the fault, not complete", r, progress)
    assert not all(t.done() for t in tasks), ("every stream ended before the fault", progress)


def _run_with_fault(url: str, max_tokens: int, fault=None, after_events: int = 12) -> list[dict]:
    """NUM_CLIENTS concurrent streams; once each has had `after_events` events (or ended complete),
    fault() runs. Every stream must end within DEADLINE_S."""
    async def main():
        progress = [0] * NUM_CLIENTS
        async with httpx.AsyncClient(timeout=DEADLINE_S) as client:
            tasks = [asyncio.create_task(astream_completion(client, url, p, max_tokens, progress, i))
                     for i, p in enumerate(PROMPTS)]
            if fault is not None:
                await _until_under_way(tasks, progress, after_events)
                await asyncio.to_thread(fault)
            return await asyncio.wait_for(asyncio.gather(*tasks), DEADLINE_S)
    return asyncio.run(main())


def _assert_complete(results: list[dict], want: list[str]) -> None:
    for i, r in enumerate(results):
        assert r["status"] == 200 and r["error"] is None and r["done"], (i, r)
        assert r["text"] == want[i], i


# ---- admission control ------------------------------------------------------------------------------
def test_overload_gets_only_200s_and_429s_with_retry_after(served, reference):
    """A burst of 16 requests (streamed and not) into an app that runs 2, lets 5 into its ingress
    replica, queues 1 per caller for the verifier and keeps none waiting in the engine: each one is
    a 200 with the target's greedy output or a 429 with Retry-After and OpenAI error JSON, refused
    within seconds; the three bounds each refused some (in one of up to 3 bursts)."""
    max_tokens = 200
    want = reference(max_tokens)
    url = f"{served}/bounded/v1/completions"

    async def one(client, i):
        body = {"model": "tiny", "prompt": PROMPTS[i], "max_tokens": max_tokens, "temperature": 0,
                "ignore_eos": True, "stream": i % 2 == 0}
        started = time.monotonic()
        resp = await client.post(url, json=body)
        return i, resp, time.monotonic() - started

    async def burst():
        async with httpx.AsyncClient(timeout=DEADLINE_S) as client:
            return await asyncio.wait_for(asyncio.gather(*(one(client, i) for i in range(NUM_CLIENTS))), DEADLINE_S)

    refused = {"gate": 0, "downstream": 0, "engine": 0}
    # arrivals race with the refusals (a refused request leaves the gate at once), so which bound
    # refuses whom varies: a burst at a time, up to 3, until each bound has refused some
    for _ in range(3):
        wait_for(lambda: _idle("bounded", 1), timeout=60)
        before = httpx.get(f"{served}/bounded/v1/stats", timeout=60).json()
        results = asyncio.run(burst())
        statuses = sorted(resp.status_code for _, resp, _ in results)
        assert set(statuses) <= {200, 429}, statuses
        # (at least one served: under load the verifier's router may pass on one request before the
        # others' arrivals are refused, so the engine's 2 slots need not both fill; seen once in CI)
        assert 1 <= statuses.count(200) <= 5 and statuses.count(429) >= NUM_CLIENTS - 5, statuses
        for i, resp, seconds in results:
            if resp.status_code == 429:
                assert resp.headers["retry-after"] == "2"
                assert resp.headers["content-type"] == "application/json", (resp.headers, resp.text)
                error = resp.json()["error"]
                assert error["type"] == "rate_limit_error" and error["code"] == "server_overloaded", error
                assert seconds < 30, seconds  # refused, not queued until the others are done
            elif i % 2 == 0:
                events = [line[len("data: "):] for line in resp.text.splitlines() if line.startswith("data: ")]
                assert events[-1] == "[DONE]"
                assert "".join(c["text"] for e in events[:-1] for c in json.loads(e)["choices"]) == want[i]
            else:
                assert resp.json()["choices"][0]["text"] == want[i]
        after = httpx.get(f"{served}/bounded/v1/stats", timeout=60).json()
        gate = after["num_refused_at_ingress"] - before["num_refused_at_ingress"]
        downstream = after["num_refused_downstream"] - before["num_refused_downstream"]
        engine = after["num_rejected"] - before["num_rejected"]
        assert gate + downstream == statuses.count(429) and downstream >= engine
        refused = {"gate": refused["gate"] + gate, "downstream": refused["downstream"] + downstream,
                   "engine": refused["engine"] + engine}
        if refused["gate"] and refused["engine"]:
            break
    assert refused["gate"] >= 1 and refused["downstream"] >= refused["engine"] >= 1, refused
    assert after["ingress_in_flight"] == 0  # every request, refused or served, left the gate
    wait_for(lambda: _idle("bounded", 1), timeout=60)
    # the server takes requests again once the burst is over
    resp = httpx.post(url, json={"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 8, "temperature": 0,
                                 "ignore_eos": True}, timeout=60)
    assert resp.status_code == 200, resp.text


def test_downstream_refusals_map_to_429_or_503():
    """A full verifier queue (Serve's BackPressureError) -> 429, or 503 `not_ready` while no verifier
    replica has answered yet; a full engine queue -> 429; each with Retry-After."""
    pressure = BackPressureError(num_queued_requests=4, max_queued_requests=4)
    for err, ready, status, code in [(pressure, True, 429, "server_overloaded"), (pressure, False, 503, "not_ready"),
                                     (EngineOverloadedError("full"), True, 429, "server_overloaded")]:
        mapped = ingress_module._as_openai_error(err, None, 1.5, ready)
        response = ingress_module._error_response(mapped)
        assert (response.status_code, response.headers["retry-after"]) == (status, "2")
        assert json.loads(response.body)["error"]["code"] == code


# ---- faults under load ---------------------------------------------------------------------------
def test_killed_proposer_replica_under_load(served, reference):
    """The proposer replica dies mid-load: every stream completes with the target's output (steps
    whose proposer call failed ran without drafts); Serve replaces it; the verifiers end idle."""
    want = reference(FAULT_TOKENS)
    [proposer] = _replicas("faults", "Proposer")
    results = _run_with_fault(f"{served}/faults/v1/completions", FAULT_TOKENS, lambda: _kill(proposer))
    _assert_complete(results, want)
    _wait_replaced("faults", "Proposer", proposer, 1)
    wait_for(lambda: _idle("faults", 2), timeout=60)


def test_killed_verifier_replica_under_load(served, reference):
    """A verifier replica dies mid-load: its streams resume on the other replica (or the replacement)
    with the tokens they had, and every stream completes with the target's output, unbroken."""
    want = reference(FAULT_TOKENS)
    before = _failovers("faults", 2)
    victims: list[str] = []

    def kill_a_busy_one():  # not a fixed one: the routers may have sent it none (CI, stop 61)
        victims.append(_busiest_verifier("faults", 2))
        assert victims[0] is not None, "no verifier replica runs the streams"
        _kill(victims[0])

    results = _run_with_fault(f"{served}/faults/v1/completions", FAULT_TOKENS, kill_a_busy_one)
    _assert_complete(results, want)
    # the victim's streams did fail over
    assert _failovers_since("faults", before, 2)["num_stream_failovers"] >= 1
    _wait_replaced("faults", "Verifier", victims[0], 2)
    wait_for(lambda: _idle("faults", 2), timeout=60)
    # the proposer dropped what the lost replica's sequences held as soon as others needed the slots,
    # and drafts are still accepted after the fault
    results = _run_with_fault(f"{served}/faults/v1/completions", 24)
    _assert_complete(results, reference(24))


async def _sampled_stream(client, url: str, prompt: str, max_tokens: int, progress: list[int], index: int) -> dict:
    """A seeded sampled streamed completion: {status, done, error, tokens (usage), headers}."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.9, "top_p": 0.95,
            "seed": 1000 + index, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    out = {"status": None, "done": False, "error": None, "tokens": None, "text": "", "headers": None}
    try:
        async with client.stream("POST", url, json=body) as resp:
            out["status"], out["headers"] = resp.status_code, dict(resp.headers)
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[len("data: "):]
                if data == "[DONE]":
                    out["done"] = True
                    continue
                event = json.loads(data)
                if "error" in event:
                    out["error"] = event
                elif event.get("usage"):
                    out["tokens"] = event["usage"]["completion_tokens"]
                out["text"] += "".join(c.get("text", "") for c in event.get("choices", []))
                progress[index] += 1
    except (httpx.RemoteProtocolError, httpx.ReadError) as err:
        out["error"] = repr(err)
    return out


SAMPLED_TOKENS = 96  # the tiny random models' sampled rows are nearly flat: each costs a top-p over most of
# the 49,152-token vocabulary, so 16 sampled streams of 320 tokens took 136 s on both replicas unfaulted


def test_killed_verifier_replica_under_sampled_load(served, tiny_model_dir):
    """Sampled (temperature 0.9, seeded) streams while a verifier replica dies: every stream ends
    with [DONE], no error, exactly max_tokens tokens (the resumed ones continue from the tokens they
    had, counted once), and says what it says unfaulted: target-only decoding with its seed (issue
    #53, item 4); the ingress replicas counted the failovers. The SSE
    responses carry the no-buffering headers (deployments/frontend/sse.py). The replica killed is
    one running streams (just after the previous test's replacement came up, the routers may send
    every stream to the other: killing an idle one, nothing failed over; seen once in a full run)."""
    before = _failovers("faults", 2)
    victims: list[str] = []
    url = f"{served}/faults/v1/completions"

    async def main():
        progress = [0] * NUM_CLIENTS
        async with httpx.AsyncClient(timeout=DEADLINE_S) as client:
            tasks = [asyncio.create_task(_sampled_stream(client, url, p, SAMPLED_TOKENS, progress, i))
                     for i, p in enumerate(PROMPTS)]
            await _until_under_way(tasks, progress, 12)
            victims[:] = [await asyncio.to_thread(_busiest_verifier, "faults", 2)]
            assert victims[0] is not None, "no verifier replica runs the streams"
            await asyncio.to_thread(_kill, victims[0])
            return await asyncio.wait_for(asyncio.gather(*tasks), DEADLINE_S)

    results = asyncio.run(main())
    want = sampled_reference(tiny_model_dir, SAMPLED_TOKENS)
    for i, r in enumerate(results):
        assert r["status"] == 200 and r["error"] is None and r["done"], (i, r)
        assert r["tokens"] == SAMPLED_TOKENS and r["text"] == want[i], (i, r["tokens"], r["text"], want[i])
        assert r["headers"]["x-accel-buffering"] == "no" and r["headers"]["cache-control"] == "no-cache"
    assert _failovers_since("faults", before, 2)["num_stream_failovers"] >= 1
    _wait_replaced("faults", "Verifier", victims[0], 2)
    wait_for(lambda: _idle("faults", 2), timeout=60)


def test_killed_verifier_replica_under_non_streamed_load(served, reference):
    """Non-streamed requests while a verifier replica that runs some of them dies: each request on it
    is sent again whole, and every response is a 200 with the target's greedy output and its usage;
    the ingress replicas counted request failovers. (Not "once both run some": just after the previous
    test's replacement came up, the ingress routers may not know it yet and send all 16 to the other,
    which takes them all; then the one running them is killed, and all fail over.)"""
    want = reference(FAULT_TOKENS)
    before = _failovers("faults", 2)
    victims: list[str] = []
    url = f"{served}/faults/v1/completions"

    async def main():
        async with httpx.AsyncClient(timeout=DEADLINE_S) as client:
            tasks = [asyncio.create_task(client.post(url, json={
                "model": "tiny", "prompt": p, "max_tokens": FAULT_TOKENS, "temperature": 0, "ignore_eos": True}))
                for p in PROMPTS]

            def one_running() -> bool:
                victims[:] = [_busiest_verifier("faults", 2)]
                return victims[0] is not None

            await asyncio.to_thread(wait_for, one_running, DEADLINE_S, 0.1)
            await asyncio.sleep(1.0)  # some tokens in: the lost work is real
            # one may have ended (alone on a replica, as in the sampled test): it is checked below like the rest
            assert not all(t.done() for t in tasks), "every request ended before the fault"
            await asyncio.to_thread(_kill, victims[0])
            return await asyncio.wait_for(asyncio.gather(*tasks), DEADLINE_S)

    responses = asyncio.run(main())
    for i, resp in enumerate(responses):
        assert resp.status_code == 200, (i, resp.text)
        body = resp.json()
        assert body["choices"][0]["text"] == want[i], i
        assert body["usage"]["completion_tokens"] == FAULT_TOKENS
    assert _failovers_since("faults", before, 2)["num_request_failovers"] >= 1
    _wait_replaced("faults", "Verifier", victims[0], 2)
    wait_for(lambda: _idle("faults", 2), timeout=60)


def test_killed_colocated_verifier_replica(served, reference):
    """The colocated topology (the `bounded` app: the n-gram proposer inside the verifier's engine,
    one verifier replica): its replica dies mid-stream; the stream waits for Serve's replacement,
    resumes there and completes unbroken with the target's greedy output; the ingress counted the
    failover. One stream: the app queues one request per caller for the verifier."""
    want = reference(FAULT_TOKENS)
    [victim] = _replicas("bounded", "Verifier")
    before = _failovers("bounded", 1)
    url = f"{served}/bounded/v1/completions"

    async def main():
        progress = [0]
        async with httpx.AsyncClient(timeout=DEADLINE_S) as client:
            task = asyncio.create_task(astream_completion(client, url, PROMPTS[0], FAULT_TOKENS, progress, 0))
            started = time.monotonic()
            while progress[0] < 12 and not task.done():
                assert time.monotonic() - started < DEADLINE_S, "the stream did not start"
                await asyncio.sleep(0.02)
            assert not task.done(), "the stream ended before the fault"
            await asyncio.to_thread(_kill, victim)
            return await asyncio.wait_for(task, DEADLINE_S)

    result = asyncio.run(main())
    assert result["status"] == 200 and result["error"] is None and result["done"], result
    assert result["text"] == want[0]
    _wait_replaced("bounded", "Verifier", victim, 1)
    assert _failovers_since("bounded", before, 1)["num_stream_failovers"] >= 1
    wait_for(lambda: _idle("bounded", 1), timeout=60)


def _busiest_ingress(app: str, count: int) -> tuple[str, int]:
    """The actor name of the ingress replica with the most generation requests in flight (its
    admission gate's count), and that count."""
    stats = max(_per_replica(app, "OpenAIIngress", count), key=lambda s: s["ingress_in_flight"])
    [name] = [n for n in _replicas(app, "OpenAIIngress") if n.endswith("#" + stats["ingress_replica"])]
    return name, stats["ingress_in_flight"]


def test_killed_ingress_replica_under_load(served, reference):
    """An ingress replica dies mid-load. The streams it carried lose their HTTP connection (the
    replica held it: Serve's proxy cannot move an open response elsewhere) and end at once, cut
    short; every other stream completes with the target's output. The verifier requests of the cut
    streams are aborted (nothing keeps decoding for a client no one serves), and new requests
    succeed on the surviving and the replacement replicas. The replica killed is the one holding
    the most streams at the fault (not a fixed one: Serve's proxy put all 16 on the other in CI run
    25, and nothing was cut); the streams cut are at most those it held."""
    want = reference(FAULT_TOKENS)
    before = _verifier_stats("faults", 2)
    victims: list[tuple[str, int]] = []

    def kill_the_busiest():
        victim, held = _busiest_ingress("faults", 2)
        assert held >= 1, "no ingress replica holds a stream"
        victims.append((victim, held))
        _kill(victim)

    results = _run_with_fault(f"{served}/faults/v1/completions", FAULT_TOKENS, kill_the_busiest)
    [(victim, held)] = victims
    cut = [r for r in results if not r["done"]]
    for i, r in enumerate(results):
        assert r["status"] == 200, r
        if r["done"]:
            assert r["error"] is None and r["text"] == want[i]
        else:  # a prefix of the right output, then nothing
            assert want[i].startswith(r["text"]), (i, r)
    # the victim's streams were cut (one may have completed between the count and the kill), no other
    assert 1 <= len(cut) <= held, (len(cut), held)
    _wait_replaced("faults", "OpenAIIngress", victim, 2)
    wait_for(lambda: _idle("faults", 2), timeout=60)
    after = _verifier_stats("faults", 2)
    aborted = sum(s["num_aborted"] for s in after.values()) - sum(s["num_aborted"] for s in before.values())
    assert aborted == len(cut), (aborted, len(cut))
    results = _run_with_fault(f"{served}/faults/v1/completions", 24)
    _assert_complete(results, reference(24))


def test_hundred_abandoned_streams_leave_the_engines_idle(served):
    """100 streams whose clients go away after the first chunk: each is aborted on its verifier
    replica, and both replicas end with nothing running or waiting and every KV slot free."""
    before = _verifier_stats("faults", 2)

    async def abandon(client, i):
        body = {"model": "tiny", "prompt": PROMPTS[i % NUM_CLIENTS], "max_tokens": 500, "temperature": 0,
                "ignore_eos": True, "stream": True}
        async with client.stream("POST", f"{served}/faults/v1/completions", json=body) as resp:
            assert resp.status_code == 200
            async for line in resp.aiter_lines():
                if line.startswith("data: "):
                    return  # leaving the block closes the connection

    async def main():
        limit = asyncio.Semaphore(NUM_CLIENTS)

        async def bounded(client, i):
            async with limit:
                await abandon(client, i)

        async with httpx.AsyncClient(timeout=DEADLINE_S) as client:
            await asyncio.wait_for(asyncio.gather(*(bounded(client, i) for i in range(100))), DEADLINE_S)

    asyncio.run(main())
    wait_for(lambda: _idle("faults", 2), timeout=60)
    after = _verifier_stats("faults", 2)
    count = lambda key, stats: sum(s[key] for s in stats.values())  # noqa: E731
    assert count("num_aborted", after) - count("num_aborted", before) == 100
    assert count("num_finished", after) == count("num_finished", before)


def test_choices_of_a_prompt_the_router_has_placed_are_all_answered(served):
    """n > 1 on two verifier replicas with prefix routing (the faults app's), the prompt already placed
    once so the router prefers a replica for it: every choice is answered. The choices are separate
    verifier calls sharing the HTTP request's internal id; before deployments/replicas/prefix_router.py
    took Serve's FIFOMixin, only the first was ever routed, the others' routing tasks probed the replicas'
    queue lengths in a loop without backoff, the request never answered and the ingress's probes piled
    up (thousands) until no call reached a verifier (found by the abuse dry run below: its heavy request
    is n x the same prompt)."""
    url = f"{served}/faults/v1/completions"
    prompt = [7] * 200  # 4 blocks of the router's 64: long enough to be preferred
    first = httpx.post(url, json={"model": "tiny", "prompt": prompt, "max_tokens": 2}, timeout=60)
    assert first.status_code == 200, first.text
    for body in ({"n": 4, "max_tokens": 0, "echo": True, "logprobs": 20}, {"n": 3, "max_tokens": 4, "logprobs": 2}):
        resp = httpx.post(url, json={"model": "tiny", "prompt": prompt, **body}, timeout=60)
        assert resp.status_code == 200, resp.text[:300]
        assert len(resp.json()["choices"]) == body["n"], body


def test_abuse_benchmark_dry_run(served, tmp_path):
    """benchmarks/abuse.py --dry-run against the faults app (after its faults: replicas replaced):
    2 well-behaved streaming clients beside 2 clients sending 1 MiB bodies (past the app's 256 KiB
    limit), 2 streams never read and 4 clients hammering /tokenize and /health, and the hardening
    round's (#51): slow bodies without a key (POST /health, POST /v1/completions chunked and with a
    Content-Length, a byte every 0.5 s) each answered (405, 408) within the app's body_timeout_s, the
    two heavy requests (echo with 20 logprobs in 4 choices; 2 sampled choices streamed) each served or
    refused, and a burst of 6 streams each a 200 or a 429 with Retry-After. The well-behaved clients
    see no error in either phase; every big body gets a 413 or is cut; /health answers
    200 and /tokenize 200 or 429; the report has the processes' memory and the ITL ratio. Well under a minute."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    import abuse

    # after the kills above the app may still be replacing a replica: the benchmark's clients start
    # on a whole app (its /tokenize hammer otherwise waits on a replica still loading its model)
    wait_for(lambda: serve.status().applications["faults"].status == "RUNNING" and all(
        d.status == "HEALTHY" for d in serve.status().applications["faults"].deployments.values()), timeout=180)
    wait_for(lambda: httpx.post(f"{served}/faults/tokenize", json={"model": "tiny", "prompt": "hi"},
                                timeout=30).status_code == 200, timeout=180)
    out = tmp_path / "abuse.json"
    assert abuse.main(["--dry-run", "--url", f"{served}/faults", "--model", "tiny", "--output-json", str(out),
                       "--memory-root-pid", str(os.getpid()),
                       "--body-deadline-s", str(ABUSE_BODY_TIMEOUT_S)]) == 0  # the shared cluster's processes: ours
    # ~15 s on an idle 2-core machine, 135 s seen beside a loaded CI: its time is not what it checks
    report = json.loads(out.read_text())
    # none of the bounded kinds still waits for an answer; heavy and burst requests may (a generation
    # request waits for a verifier place while stalled streams hold them: deployments/README.md,
    # "What is not bounded here")
    assert set(report["abusive_unfinished"]) <= {"heavy", "burst"}, report["abusive_unfinished"]
    for phase in ("unloaded", "loaded"):
        assert report[phase]["errors"] == 0 and report[phase]["requests"] == 4, report[phase]
        assert report[phase]["itl_ms_median"] is not None
        assert {"ingress", "verifier"} <= set(report[phase]["memory"]["peak_mib"]), report[phase]["memory"]
    big = report["abusive"]["big_bodies"]
    assert big and all(k == "413" or k.startswith("cut") for k in big), big
    hammer = report["abusive"]["tokenize_health"]
    # /health stays 200 while generation fills every verifier place (a chunk is a health answer too:
    # before, the ingress's probe queued behind generation and /health went 503); /tokenize waits at
    # most 10 s for a place, then a 429 (before: 60 s and the client's timeout)
    assert hammer and set(hammer) <= {"tokenize 200", "tokenize 429", "health 200"}, hammer
    idle = report["abusive"]["idle_streams"]
    assert sum(idle.values()) == 2, idle
    slow = report["abusive"]["slow_bodies"]
    assert {k.split()[0] for k in slow} == {"health", "chunked", "content_length"}, slow
    # POST /health: 405 once its body is whole, or 408 from Serve's proxy when the body is not whole
    # within the proxy's deadline (deployments/frontend/proxy_guard.py reads every route's body)
    assert all(k in ("health 405", "health 408", "chunked 408", "content_length 408") or k.endswith(" cut")
               for k in slow), slow
    assert report["abusive_answer_s_max"]["slow_bodies"] <= ABUSE_BODY_TIMEOUT_S + 5, report["abusive_answer_s_max"]
    heavy = report["abusive"]["heavy"]
    assert {k.split()[0] for k in heavy} == {"echo_n64", "n8_long"}, heavy
    assert all(k.split(" ", 1)[1] in ("200", "400", "429", "200 complete", "200 left at phase end") for k in heavy), heavy
    burst = report["abusive"]["burst"]
    assert sum(burst.values()) == 6 and set(burst) <= {"200 complete", "429", "200 left at phase end"}, burst
    verdict = report["verdict"]
    for key in ("slow_bodies_all_4xx_or_cut", f"slow_bodies_answered_within_{ABUSE_BODY_TIMEOUT_S:g}s_deadline", "heavy_4xx_429_or_served",
                "burst_200_or_429_with_retry_after"):  # (not the RSS bounds: the shared cluster has two apps)
        assert verdict[key], (key, verdict)
    assert report["itl_ratio_loaded_vs_unloaded"] is not None and report["verdict"]["good_clients_no_error"]


def test_soak_with_faults_dry_run(served):
    """benchmarks/soak.py --dry-run --kill-every-s against the faults app (last in this module: it kills
    replicas by their processes): 20 s of 2 clients' exact greedy requests while the proposer replica's
    process is killed at 5 s and 15 s and a verifier replica's at 10 s. Every request is answered or
    given a retryable error; none lost, none duplicated; memory per window recorded."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    import soak

    out = Path(os.environ.get("TMPDIR", "/tmp")) / f"soak_dry_{os.getpid()}.json"
    assert soak.main(["--dry-run", "--kill-every-s", "120", "--url", f"{served}/faults", "--model", "tiny",
                      "--app", "faults", "--output-json", str(out)]) == 0
    report = json.loads(out.read_text())
    # the schedule's kills (Proposer at 5 s, Verifier at 10 s, Proposer at 15 s), of which one may come
    # too late on a loaded machine (a replica still starting again has no process to kill yet)
    assert {"Proposer", "Verifier"} <= {k["deployment"] for k in report["kills"]}, report["kills"]
    assert all(k["pid"] for k in report["kills"]), report["kills"]
    outcomes = report["outcomes"]
    assert outcomes.get("answered", 0) > 0, outcomes
    verdict = report["fault_verdict"]
    assert verdict["none_lost"] and verdict["none_duplicated"] and verdict["every_request_answered_or_retryable"], outcomes
    assert report["windows"] and all("rss_mib" in w for w in report["windows"])
