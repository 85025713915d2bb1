"""A tensor-parallel verifier on a multi-node ray.cluster_utils.Cluster with fake GPUs: the replica
reserves one placement group bundle per rank, the ranks land where the strategy says (STRICT_PACK:
the replica's node; STRICT_SPREAD: another), greedy output over HTTP equals TP=1 target-only
decoding, and a rank that dies ends its replica: Serve starts a new one and the streams in flight
fail over to it, ending with the same text."""

from __future__ import annotations

import asyncio

import httpx
import pytest
import ray
import ray.serve as serve
from ray.cluster_utils import Cluster

from serve_utils import astream_completion, free_port, target_only_texts, tiny_args, wait_for
from deployments.app import build_app
from deployments.replicas.tensor_parallel import rank_actor_name
from ray_utils import head_node_args, stop_cluster

PROMPTS = ["one two three four five one two three four five one two", "The quick brown fox jumps over"]
DEADLINE_S = 240


def _tp_args(model_dir, strategy: str) -> dict:
    return tiny_args(model_dir, engine={"tensor_parallel_size": 2, "device": "cpu", "max_num_seqs": 4},
                     verifier={"ray_actor_options": {"num_cpus": 0.5, "num_gpus": 1},
                               "placement_group_strategy": strategy})


@pytest.fixture(scope="module")
def apps(tiny_model_dir, own_cluster):
    cluster = Cluster(initialize_head=True, head_node_args=head_node_args(**{"num_cpus": 3, "num_gpus": 0}))
    # STRICT_PACK needs a node with 2 GPUs; STRICT_SPREAD then gets the two 1-GPU nodes
    nodes = [cluster.add_node(num_cpus=2, num_gpus=gpus) for gpus in (2, 1, 1)]
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    port = free_port()
    serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port})
    try:
        for name, strategy in (("pack", "STRICT_PACK"), ("spread", "STRICT_SPREAD")):
            serve.run(build_app(_tp_args(tiny_model_dir, strategy)), name=name, route_prefix=f"/{name}")
        yield {"url": f"http://127.0.0.1:{port}", "gpu_nodes": {n.node_id for n in nodes}}
    finally:
        stop_cluster(cluster)


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    return target_only_texts(tiny_model_dir, PROMPTS)


def _replica(app: str):
    from ray.util.state import list_actors

    actors = list_actors(address=ray.get_runtime_context().gcs_address,  # not "the" cluster: CI runs two
                         filters=[("class_name", "=", f"ServeReplica:{app}:Verifier"), ("state", "=", "ALIVE")])
    assert len(actors) == 1, actors
    return actors[0]


def _rank_node(replica_actor_id: str) -> str:
    from ray.util.state import get_actor

    rank = ray.get_actor(rank_actor_name(replica_actor_id, 1), namespace=None)
    return get_actor(rank._actor_id.hex(), address=ray.get_runtime_context().gcs_address).node_id


def _rank_handle(replica_actor_id: str):
    return ray.get_actor(rank_actor_name(replica_actor_id, 1))


def test_ranks_land_where_the_strategy_says(apps):
    for app, same_node in (("pack", True), ("spread", False)):
        replica = _replica(app)
        rank_node = _rank_node(replica.actor_id)
        assert replica.node_id in apps["gpu_nodes"] and rank_node in apps["gpu_nodes"], app
        assert (rank_node == replica.node_id) == same_node, (app, replica.node_id, rank_node)


@pytest.mark.parametrize("app", ["pack", "spread"])
def test_greedy_over_http_equals_tp1(apps, reference, app):
    want = reference(16)
    for prompt, text in zip(PROMPTS, want):
        resp = httpx.post(f"{apps['url']}/{app}/v1/completions", timeout=DEADLINE_S,
                          json={"model": "tiny", "prompt": prompt, "max_tokens": 16, "temperature": 0,
                                "ignore_eos": True})
        assert resp.status_code == 200, resp.text
        assert resp.json()["choices"][0]["text"] == text


def test_a_dead_rank_replaces_the_replica_and_streams_fail_over(apps, reference):
    max_tokens = 160
    want = reference(max_tokens)
    before = _replica("pack").actor_id
    rank = _rank_handle(before)
    url = f"{apps['url']}/pack/v1/completions"

    async def main():
        progress = [0] * len(PROMPTS)
        async with httpx.AsyncClient(timeout=DEADLINE_S) as client:
            tasks = [asyncio.create_task(astream_completion(client, url, p, max_tokens, progress, i))
                     for i, p in enumerate(PROMPTS)]
            while min(progress) < 8:
                assert not any(t.done() for t in tasks), "a stream ended before the fault"
                await asyncio.sleep(0.02)
            ray.kill(rank, no_restart=True)
            return await asyncio.wait_for(asyncio.gather(*tasks), DEADLINE_S)

    results = asyncio.run(main())
    for i, r in enumerate(results):
        assert r["status"] == 200 and r["error"] is None and r["done"], (i, r)
        assert r["text"] == want[i], i
    after = wait_for(lambda: _replica("pack").actor_id != before and _replica("pack").actor_id, timeout=DEADLINE_S)
    assert after != before
    stats = httpx.get(f"{apps['url']}/pack/v1/stats", timeout=60).json()
    assert stats["num_stream_failovers"] >= 1, stats
