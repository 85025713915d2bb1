"""Pairing (issue 20, `proposer_placement: paired`): each verifier replica reserves one more
placement group bundle and runs its own proposer actor there (deployments/replicas/pairing.py).

Without Ray: the config's checks and the Serve options it makes (the verifier's bundles and
strategy, no Proposer deployment; with tensor parallelism the proposer's bundle after the ranks').
Then one ray.cluster_utils.Cluster with fake GPUs (a head with two, two nodes with one each)
serving two paired apps on the tiny model, its own draft pre-drafting asynchronously: "pack"
(STRICT_PACK: the proposer on the verifier's node, on the other GPU) and "spread" (STRICT_SPREAD:
the proposer on another node). Both place as their strategy says, their greedy output over HTTP
equals the target alone's, and a paired proposer killed mid-stream costs drafts, not requests: every
stream ends with the same text, and the replica starts a new proposer that drafts again."""

from __future__ import annotations

import httpx
import pytest
import ray
from pydantic import ValidationError
from ray import serve
from ray.cluster_utils import Cluster
from serve_utils import app_deployments, app_stats, free_port, run_streams, target_only_texts, tiny_args, wait_for

from deployments.app import build_app
from deployments.config import AppArgs
from deployments.operations.kuberay import deployment_units, worker_groups
from deployments.operations.plan import plan_app
from ray_utils import head_node_args, stop_cluster

PROMPTS = ["one two three four five", "the quick brown fox", "alpha beta gamma"]
MAX_TOKENS = 96
APPS = {"pack": "STRICT_PACK", "spread": "STRICT_SPREAD"}


def _paired_args(model_dir, strategy: str = "STRICT_PACK", **overrides) -> dict:
    """Disaggregated, paired: the target as its own draft (every draft accepted), pre-drafted."""
    args = tiny_args(model_dir, topology="disaggregated", proposer_placement="paired", proposer_async_hypotheses=3,
                     speculative={"method": "draft_model", "draft_model": str(model_dir),
                                  "num_speculative_tokens": 3, "adaptive": False},
                     verifier={"ray_actor_options": {"num_cpus": 0.5, "num_gpus": 1},
                               "placement_group_strategy": strategy},
                     proposer={"ray_actor_options": {"num_cpus": 0.5, "num_gpus": 1}})
    return {**args, **overrides}


# ---- the config, without Ray ----------------------------------------------------------------------

def test_paired_options_and_no_proposer_deployment(tmp_path):
    cfg = AppArgs.model_validate(_paired_args(tmp_path, "STRICT_SPREAD"))
    opts = cfg.verifier_options()
    assert opts["placement_group_bundles"] == [{"CPU": 0.5, "GPU": 1.0}, {"CPU": 0.5, "GPU": 1.0}]
    assert opts["placement_group_strategy"] == "STRICT_SPREAD"
    assert cfg.proposer_num_slots() == cfg.engine.max_num_seqs  # its own verifier's sequences only
    deployments = app_deployments(build_app(cfg))
    assert set(deployments) == {"OpenAIIngress", "Verifier"}
    assert deployments["Verifier"].init_args[1] is None  # no pool handle: the replica starts its own
    # kuberay: no Proposer unit; the replica's pod (spread: each bundle's node) holds a bundle
    units = {u.deployment: u for u in deployment_units(cfg)}
    assert set(units) == {"OpenAIIngress", "Verifier"} and units["Verifier"].count == 2


def test_kuberay_gives_a_spread_pair_both_node_types(tmp_path):
    verifier = {"ray_actor_options": {"num_cpus": 4, "num_gpus": 1, "resources": {"target_node": 0.01}},
                "placement_group_strategy": "STRICT_SPREAD", "num_replicas": 2}
    proposer = {"ray_actor_options": {"num_cpus": 2, "num_gpus": 1, "resources": {"draft_node": 0.01}}}
    cfg = AppArgs.model_validate(_paired_args(tmp_path, verifier=verifier, proposer=proposer))
    groups = {g.name: g for g in worker_groups([cfg])}
    assert {(u.deployment, u.count, u.resources["CPU"]) for u in groups["target"].units} == {("Verifier", 2, 4)}
    assert {(u.deployment, u.count, u.resources["CPU"]) for u in groups["draft"].units} == {("Verifier", 2, 2)}


def test_pool_stays_the_default(tmp_path):
    cfg = AppArgs.model_validate(tiny_args(tmp_path, topology="disaggregated"))
    assert cfg.proposer_placement == "pool" and "placement_group_bundles" not in cfg.verifier_options()
    assert set(app_deployments(build_app(cfg))) == {"OpenAIIngress", "Verifier", "Proposer"}


def test_paired_with_tensor_parallel_puts_the_proposer_bundle_last(tmp_path):
    args = _paired_args(tmp_path, engine={"tensor_parallel_size": 2, "max_num_seqs": 4},
                        proposer={"ray_actor_options": {"num_cpus": 2, "num_gpus": 1, "resources": {"draft_node": 0.01}}})
    opts = AppArgs.model_validate(args).verifier_options()
    assert opts["placement_group_bundles"] == [{"CPU": 0.5, "GPU": 1.0}, {"CPU": 0.5, "GPU": 1.0},
                                               {"CPU": 2.0, "GPU": 1.0, "draft_node": 0.01}]
    assert opts["placement_group_strategy"] == "STRICT_PACK"


def test_plan_counts_one_proposer_per_verifier_replica(tiny_model_dir):
    verifier = {"num_replicas": 2, "ray_actor_options": {"num_cpus": 0.5, "num_gpus": 1}}
    app = plan_app("paired.yaml", "paired", _paired_args(tiny_model_dir, verifier=verifier))
    assert [(d.name, d.replicas, d.num_gpus) for d in app.deployments] == [("Verifier", 2, 1),
                                                                           ("Proposer (paired)", 2, 1)]
    assert app.deployments[1].process.draft_kv.num_slots == 4  # its own verifier's max_num_seqs


@pytest.mark.parametrize("overrides, message", [
    ({"topology": "colocated", "proposer_async_hypotheses": 0}, "needs topology 'disaggregated'"),
    ({"proposer": {"num_replicas": 2}}, "num_replicas"),
    ({"proposer": {"autoscaling_config": {"min_replicas": 1, "max_replicas": 2}}}, "autoscaling_config"),
    ({"proposer_repin_interval_s": 10}, "proposer_repin_interval_s"),
])
def test_bad_combinations_are_refused(tmp_path, overrides, message):
    with pytest.raises(ValidationError, match=message):
        AppArgs.model_validate(_paired_args(tmp_path, **overrides))


# ---- served on a cluster with fake GPUs -----------------------------------------------------------

@pytest.fixture(scope="module")
def served(tiny_model_dir, own_cluster):
    """app name -> its URL; and the ids of the nodes with GPUs."""
    # STRICT_PACK (deployed first) needs a node with two free GPUs: the head; STRICT_SPREAD then
    # gets the two one-GPU nodes
    cluster = Cluster(initialize_head=True, head_node_args=head_node_args(**{"num_cpus": 3, "num_gpus": 2}))
    nodes = [cluster.add_node(num_cpus=2, num_gpus=1) for _ in range(2)]
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    port = free_port()
    serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port})
    try:
        for name, strategy in APPS.items():
            serve.run(build_app(_paired_args(tiny_model_dir, strategy)), name=name, route_prefix=f"/{name}")
        yield {name: f"http://127.0.0.1:{port}/{name}" for name in APPS}, \
            {cluster.head_node.node_id} | {n.node_id for n in nodes}
    finally:
        stop_cluster(cluster)


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    return target_only_texts(tiny_model_dir, PROMPTS)


@pytest.fixture(scope="module")
def want(reference) -> list[str]:
    return reference(MAX_TOKENS)


def _placement(app: str) -> dict:
    return serve.get_deployment_handle("Verifier", app_name=app).placement.remote().result(timeout_s=60)


def test_pairs_land_where_the_strategy_says(served):
    _, gpu_nodes = served
    for app, strategy in APPS.items():
        assert "Proposer" not in serve.status().applications[app].deployments
        verifier = _placement(app)
        proposer = verifier["proposer"]
        assert {verifier["node_id"], proposer["node_id"]} <= gpu_nodes, app
        assert len(verifier["gpu_ids"]) == len(proposer["gpu_ids"]) == 1, (app, verifier)
        if strategy == "STRICT_PACK":  # one node, the other GPU
            assert proposer["node_id"] == verifier["node_id"] and proposer["gpu_ids"] != verifier["gpu_ids"], verifier
        else:
            assert proposer["node_id"] != verifier["node_id"], verifier


def test_greedy_matches_target_over_the_direct_channel(served, want):
    urls, _ = served
    for app, url in urls.items():
        before = app_stats(url)
        results = run_streams(url, PROMPTS, MAX_TOKENS)
        assert [r["text"] for r in results] == want and all(r["done"] and r["error"] is None for r in results), app
        stats = app_stats(url)
        assert stats["proposer_direct_calls"] > before.get("proposer_direct_calls", 0), stats
        assert stats["num_accepted_tokens"] > before.get("num_accepted_tokens", 0), stats


def test_killed_paired_proposer_mid_stream_keeps_outputs(served, want, reference):
    urls, _ = served
    url, first = urls["pack"], _placement("pack")["proposer"]

    def kill():
        ray.kill(ray.get_actor(first["name"], namespace=first["namespace"]), no_restart=True)

    results = run_streams(url, PROMPTS, MAX_TOKENS, kill)
    for i, r in enumerate(results):
        assert r["status"] == 200 and r["error"] is None and r["done"], (i, r)
        assert r["text"] == want[i], i
    # a later step pins again, finds the actor gone and starts another in the same bundle; once it
    # has loaded, the drafts come back over its channel
    calls, short = app_stats(url)["proposer_direct_calls"], reference(16)[0]

    def drafting_again() -> bool:
        r = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": PROMPTS[0], "max_tokens": 16,
                                                      "temperature": 0, "ignore_eos": True}, timeout=120)
        assert r.status_code == 200 and r.json()["choices"][0]["text"] == short
        return app_stats(url)["proposer_direct_calls"] > calls

    wait_for(drafting_again, timeout=180, interval=0.5)
    second = _placement("pack")["proposer"]
    assert second["num_restarts"] >= 1 and second["node_id"] == first["node_id"], second


def test_deleting_the_app_ends_its_proposers(served):
    proposer = _placement("spread")["proposer"]
    serve.delete("spread")

    def gone() -> bool:
        try:
            ray.get_actor(proposer["name"], namespace=proposer["namespace"])
        except ValueError:
            return True
        return False

    wait_for(gone, timeout=60)
