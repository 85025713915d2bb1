"""Disaggregated topology on a multi-node ray.cluster_utils.Cluster (fake GPU nodes with custom resources).

The proposer (draft model) and the verifier (target engine) must land on the nodes the config
asks for, generate exactly what an in-process engine generates greedily, and the verifier must
call the proposer once per engine step with the whole batch.
"""

from __future__ import annotations

import concurrent.futures
import json

import httpx
import pytest

import ray
import ray.serve as serve

from ray.cluster_utils import Cluster  # noqa: E402
from serve_utils import free_port, tiny_args  # noqa: E402

from deployments.app import build_app  # noqa: E402
from rayspec.config import EngineConfig, SpeculativeConfig  # noqa: E402
from rayspec.engine.llm_engine import LLMEngine  # noqa: E402
from rayspec.sampling.sampler import SamplingParams  # noqa: E402
from ray_utils import head_node_args, stop_cluster

PROMPT = "one two three four five six seven one two three four five six seven one two"


def _spec(draft_dir) -> dict:
    return {"method": "draft_model", "draft_model": str(draft_dir), "num_speculative_tokens": 3}


@pytest.fixture(scope="module")
def cluster_app(tiny_model_dir, tiny_draft_dir, own_cluster):
    cluster = Cluster(initialize_head=True, head_node_args=head_node_args(**{"num_cpus": 2, "num_gpus": 0}))
    draft_node = cluster.add_node(num_cpus=2, num_gpus=1, resources={"draft_node": 1})
    target_node = cluster.add_node(num_cpus=2, num_gpus=1, resources={"target_node": 1})
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    port = free_port()
    serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port})
    args = tiny_args(tiny_model_dir, topology="disaggregated", speculative=_spec(tiny_draft_dir),
                     proposer={"ray_actor_options": {"num_cpus": 0.5, "num_gpus": 1, "resources": {"draft_node": 0.01}}},
                     verifier={"ray_actor_options": {"num_cpus": 0.5, "num_gpus": 1,
                                                     "resources": {"target_node": 0.01}}})
    app = build_app(args)
    serve.run(app, name="rayspec", route_prefix="/")
    yield {"url": f"http://127.0.0.1:{port}", "draft_node": draft_node.node_id, "target_node": target_node.node_id,
           "head_node": cluster.head_node.node_id}
    stop_cluster(cluster)


def _replica_nodes(deployment: str) -> set[str]:
    from ray.util.state import list_actors

    actors = list_actors(address=ray.get_runtime_context().gcs_address,  # not "the" cluster: CI runs two
                         filters=[("class_name", "=", f"ServeReplica:rayspec:{deployment}"),
                                  ("state", "=", "ALIVE")])
    return {a.node_id for a in actors}


def test_actors_land_on_configured_nodes(cluster_app):
    assert _replica_nodes("Proposer") == {cluster_app["draft_node"]}
    assert _replica_nodes("Verifier") == {cluster_app["target_node"]}
    assert cluster_app["head_node"] not in _replica_nodes("Proposer") | _replica_nodes("Verifier")


def _complete(url: str, prompt: str, max_tokens: int, **extra) -> dict:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, **extra}
    r = httpx.post(url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_greedy_matches_in_process_engine(cluster_app, tiny_model_dir, tiny_draft_dir):
    got = _complete(cluster_app["url"], PROMPT, 24, ignore_eos=True)
    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir), max_model_len=1024, max_num_seqs=4,
                                    kv_cache_memory_gb=0.25, speculative=SpeculativeConfig(**_spec(tiny_draft_dir))))
    ref = engine.generate([PROMPT], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))[0]
    assert got["choices"][0]["text"] == ref.text
    details = got["usage"]["completion_tokens_details"]
    assert details["accepted_prediction_tokens"] + details["rejected_prediction_tokens"] > 0


def test_one_proposer_call_per_step_for_the_batch(cluster_app):
    proposer = serve.get_deployment_handle("Proposer", app_name="rayspec")
    before = proposer.stats.remote().result()
    verifier_before = httpx.get(cluster_app["url"] + "/v1/stats", timeout=30).json()
    prompts = [f"{PROMPT} {i}" for i in range(4)]
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda p: _complete(cluster_app["url"], p, 32, ignore_eos=True), prompts))
    assert all(r["usage"]["completion_tokens"] == 32 for r in results)
    after = proposer.stats.remote().result()
    calls = after["num_calls"] - before["num_calls"]
    requests = after["num_requests"] - before["num_requests"]
    assert after["method"] == "draft_model" and calls > 0
    assert requests > calls  # several sequences per RPC: batched, not one call per request
    stats = httpx.get(cluster_app["url"] + "/v1/stats", timeout=30).json()
    # this test's per-step calls went over the direct channel between the two nodes, not through Serve
    direct = stats["proposer_direct_calls"] - verifier_before["proposer_direct_calls"]
    # (the verifier also counts its release-only flushes, which the proposer does not)
    assert direct == stats["proposer_calls"] - verifier_before["proposer_calls"] >= calls
    # authenticated with the app's secret (deployments.app), nothing refused
    assert after["channel_connections"] >= 1 and after["channel_rejected"] == 0
    # at most one call per engine step: each sequence needs < 32 steps
    assert calls <= 4 * 32


def test_sampled_and_streamed(cluster_app, tiny_model_dir, tiny_draft_dir):
    """A seeded sampled stream (drafts sampled in the proposer's actor, with their probabilities)
    is what an in-process engine samples with the same seed (coupled draws, rayspec.sampling.sampler: the
    proposer gets the seed and drafts with the target's noise), and its usage counts it."""
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 12, "temperature": 0.7, "seed": 1, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", cluster_app["url"] + "/v1/completions", json=body, timeout=120) as r:
        lines = [line for line in r.iter_lines() if line]
    assert r.status_code == 200 and lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[len("data: "):]) for line in lines[:-1]]
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    # the reference drafts at a fixed length (the planner, timed on a loaded machine, drafted nothing in
    # these 12 tokens once in CI); a coupled draw's output does not depend on what was drafted
    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir), max_model_len=1024, max_num_seqs=4,
                                    kv_cache_memory_gb=0.25,
                                    speculative=SpeculativeConfig(**_spec(tiny_draft_dir), adaptive=False)))
    ref = engine.generate([PROMPT], SamplingParams(temperature=0.7, seed=1, max_tokens=12, ignore_eos=True))[0]
    assert text == ref.text and ref.num_draft_tokens > 0
    assert chunks[-1]["usage"]["completion_tokens"] == ref.num_output_tokens == 12


def test_output_controls_in_the_disaggregated_graph(cluster_app, tiny_model_dir, tiny_draft_dir):
    """Structured output, penalties, logprobs and n live in the verifier's engine: with the draft in
    another actor they still give what an in-process engine gives."""
    from rayspec.sampling.structured import StructuredOutput

    engine = LLMEngine(EngineConfig(model=str(tiny_model_dir), max_model_len=1024, max_num_seqs=4,
                                    kv_cache_memory_gb=0.25, speculative=SpeculativeConfig(**_spec(tiny_draft_dir))))
    regex = "[0-9]{3}-[a-z]{2,4}"
    got = _complete(cluster_app["url"], PROMPT, 16, guided_regex=regex, frequency_penalty=1.0, logprobs=2, n=2)
    ref = engine.generate([PROMPT], SamplingParams(temperature=0, max_tokens=16, frequency_penalty=1.0, logprobs=2,
                                                   structured=StructuredOutput("regex", regex)))[0]
    assert [c["text"] for c in got["choices"]] == [ref.text] * 2
    lp = got["choices"][0]["logprobs"]
    assert lp["tokens"] == [e.token for e in ref.logprobs]
    assert lp["token_logprobs"] == pytest.approx([e.logprob for e in ref.logprobs], abs=1e-4)
