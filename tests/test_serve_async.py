"""The asynchronous proposer served (disaggregated, proposer_async_hypotheses > 0): greedy outputs
over HTTP equal the target alone's, the speculation cache's hits and misses reach /v1/stats, and
a proposer replica killed mid-stream leaves every stream completing with the same output.

The draft is the target itself (every draft accepted, the bonus its own top token), so the
verdict is always among the hypotheses and hits are certain whenever a pre-draft finished."""

from __future__ import annotations

import concurrent.futures
import json

import httpx
import pytest

import ray
import ray.serve as serve

from serve_utils import free_port, target_only_texts, tiny_args, wait_for

from deployments.app import build_app

PROMPTS = ["one two three four five", "the quick brown fox", "alpha beta gamma", "red green blue yellow"]
MAX_TOKENS = 160


def _args(target) -> dict:
    return tiny_args(target, topology="disaggregated", proposer_async_hypotheses=5,
                     speculative={"method": "draft_model", "draft_model": str(target), "num_speculative_tokens": 3,
                                  "adaptive": False})


@pytest.fixture(scope="module")
def served(tiny_model_dir):
    ray.init(address="local", num_cpus=4, num_gpus=0, include_dashboard=False, log_to_driver=False)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        serve.run(build_app(_args(tiny_model_dir)), name="async", route_prefix="/")
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    return target_only_texts(tiny_model_dir, PROMPTS)


def _stream(url: str, prompt: str, max_tokens: int, progress: list[int], i: int) -> dict:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}
    out = {"status": None, "text": "", "done": False, "error": None}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=180) as resp:
        out["status"] = resp.status_code
        for line in resp.iter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: "):]
            progress[i] += 1
            if data == "[DONE]":
                out["done"] = True
            elif "error" in (event := json.loads(data)):
                out["error"] = event
            else:
                out["text"] += "".join(c["text"] for c in event["choices"])
    return out


def _run(url: str, fault=None, after_events: int = 8) -> list[dict]:
    progress = [0] * len(PROMPTS)
    with concurrent.futures.ThreadPoolExecutor(len(PROMPTS)) as pool:
        futures = [pool.submit(_stream, url, p, MAX_TOKENS, progress, i) for i, p in enumerate(PROMPTS)]
        if fault is not None:
            wait_for(lambda: min(progress) >= after_events or all(f.done() for f in futures), timeout=120, interval=0.02)
            assert not any(f.done() for f in futures), "a stream ended before the fault"
            fault()
        return [f.result(timeout=180) for f in futures]


def _stats(url: str) -> dict:
    return httpx.get(url + "/v1/stats", timeout=30).json()


def test_greedy_matches_target_and_counts_hits(served, reference):
    want = reference(MAX_TOKENS)
    before = _stats(served)
    for i, prompt in enumerate(PROMPTS[:2]):  # alone: pre-drafting for one sequence
        r = httpx.post(served + "/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS,
                                                         "temperature": 0, "ignore_eos": True}, timeout=180)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == want[i]
    results = _run(served)  # together: hypotheses batched over the sequences
    assert [r["text"] for r in results] == want and all(r["done"] and r["error"] is None for r in results)
    stats = _stats(served)
    hits = stats["speculation_cache_hits"] - before.get("speculation_cache_hits", 0)
    misses = stats["speculation_cache_misses"] - before.get("speculation_cache_misses", 0)
    proposer = serve.get_deployment_handle("Proposer", app_name="async").stats.remote().result(timeout_s=30)
    assert hits > 0 and misses > 0, json.dumps([stats, proposer])  # each sequence's first call misses


def test_sampled_requests_complete(served):
    body = {"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 32, "temperature": 0.8, "ignore_eos": True}
    r = httpx.post(served + "/v1/completions", json=body, timeout=180)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 32


def test_killed_proposer_mid_stream_keeps_outputs(served, reference):
    want = reference(MAX_TOKENS)
    [proposer] = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                  if a["name"].startswith("SERVE_REPLICA::async#Proposer#")]
    results = _run(served, lambda: ray.kill(ray.get_actor(proposer, namespace="serve"), no_restart=True))
    for i, r in enumerate(results):
        assert r["status"] == 200 and r["error"] is None and r["done"], (i, r)
        assert r["text"] == want[i], i
