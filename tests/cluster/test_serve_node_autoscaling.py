"""Node autoscaling for real, on one machine: Ray's autoscaler with its fake multi-node provider
(`RAY_FAKE_CLUSTER=1`: every node it launches is a real local raylet with the resources of its node
type, logical GPUs included), a CPU-only head and two worker node types, `min_workers: 0`:
`target_gpu` (GPU + `target_node`) and `draft_gpu` (GPU + `draft_node`), the node-type convention
of configs/cluster.yaml (deployments/README.md, "Node types").

- deploying a disaggregated app launches one node of each type; the verifier lands on the target
  node, the proposer on the draft node; greedy output over HTTP equals target-only decoding;
- streamed load scales the verifier 1 -> 2 and a second target node appears, the proposer stays;
- when the load stops the verifier scales back and the idle node is removed;
- a target node lost under streamed load: every stream completes (failover) with the target-only
  text, and the autoscaler starts a node in its place.

Its own Ray instance: `ray start --head` with the autoscaling config on port 6379 (the fake provider
connects its nodes there; every other cluster of the suite takes ports chosen free), connected to by
that address, and stopped at the end by its own processes (those naming the port, with their
children), not `ray stop`, which would stop every Ray process on the machine: another test worker's
cluster may be up beside it (scripts/test).
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import psutil
import pytest
import ray
import ray.serve as serve

from serve_utils import free_port, stream_completion, target_only_texts, tiny_args, wait_for
from deployments.app import build_app

RAY = str(Path(sys.executable).with_name("ray"))
HEAD_PORT = 6379  # the fake multi-node provider's nodes join the head here
NODE_TYPES = {
    "target_gpu": {"resources": {"CPU": 2, "GPU": 1, "target_node": 1}, "node_config": {},
                   "min_workers": 0, "max_workers": 2},
    "draft_gpu": {"resources": {"CPU": 2, "GPU": 1, "draft_node": 1}, "node_config": {},
                  "min_workers": 0, "max_workers": 1},
}
PROMPTS = ["one two three four five one two three four five one two", "The quick brown fox jumps over"]
TIMINGS: dict[str, float] = {}


def _autoscaling_config() -> dict:
    """The cluster config Ray's fake multi-node provider reads (written here: the wheel does not ship
    Ray's example file). Idle nodes go after 6 s."""
    return {
        "cluster_name": "rayspec-fake", "max_workers": 4, "upscaling_speed": 1.0, "idle_timeout_minutes": 0.1,
        "provider": {"type": "fake_multinode", "use_node_id_as_ip": True, "disable_node_updaters": True,
                     "disable_launch_config_check": True},
        "head_node_type": "ray.head.default",
        "available_node_types": {"ray.head.default": {"resources": {"CPU": 3}, "node_config": {}, "max_workers": 0},
                                 **NODE_TYPES},
        "auth": {}, "docker": {}, "file_mounts": {}, "cluster_synced_files": [], "rsync_exclude": [],
        "rsync_filter": [], "file_mounts_sync_continuously": False, "initialization_commands": [],
        "setup_commands": [], "head_setup_commands": [], "worker_setup_commands": [],
        "head_start_ray_commands": [], "worker_start_ray_commands": [],
    }


def _app_args(model_dir) -> dict:
    return tiny_args(
        model_dir, topology="disaggregated",
        verifier={"max_ongoing_requests": 8,
                  "autoscaling_config": {"min_replicas": 1, "max_replicas": 2, "target_ongoing_requests": 1,
                                         "upscale_delay_s": 1, "downscale_delay_s": 3,
                                         # (metrics every 0.5 s: tests/serve/test_serve_autoscaling.py)
                                         "look_back_period_s": 2, "metrics_interval_s": 0.5},
                  "ray_actor_options": {"num_cpus": 1, "num_gpus": 1, "resources": {"target_node": 0.01}}},
        proposer={"num_replicas": 1,
                  "ray_actor_options": {"num_cpus": 1, "num_gpus": 1, "resources": {"draft_node": 0.01}}})


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, own_cluster):
    config = tmp_path_factory.mktemp("autoscaler") / "cluster.json"
    config.write_text(json.dumps(_autoscaling_config()))
    # RAY_AUTH_MODE disabled: a head started with an autoscaling config turns Ray's token
    # authentication on, whose token only address="auto" finds (from the session it reads)
    env = {**os.environ, "RAY_FAKE_CLUSTER": "1", "AUTOSCALER_UPDATE_INTERVAL_S": "1", "RAY_AUTH_MODE": "disabled"}
    subprocess.run([RAY, "start", "--head", f"--port={HEAD_PORT}", "--num-cpus=3", "--num-gpus=0",
                    "--include-dashboard=false", f"--autoscaling-config={config}",
                    # a lost node is declared dead after ~3 s instead of ~15
                    '--system-config={"health_check_period_ms":1000,"health_check_failure_threshold":3}'], env=env, check=True,
                   stdout=subprocess.DEVNULL, timeout=120)
    try:
        # the head just started here, by its address: "auto" takes the cluster started last on this
        # machine, which may be another test worker's
        ray.init(address=f"{ray.util.get_node_ip_address()}:{HEAD_PORT}", log_to_driver=False)
        port = free_port()
        serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port})
        yield f"http://127.0.0.1:{port}"
    finally:  # (no serve.shutdown(): the whole cluster stops)
        ray.shutdown()
        _stop_cluster(HEAD_PORT)


def _stop_cluster(port: int) -> None:
    """Stop the Ray processes of the cluster whose head listens on `port` (those naming it: its GCS,
    raylets, agents, the autoscaler and the raylets it launched) and their children (workers, whose
    process titles no longer name it)."""
    naming = re.compile(rf"[:=]{port}\b")
    mine: dict[int, psutil.Process] = {}
    for proc in psutil.process_iter(["cmdline"]):
        try:
            if proc.pid != os.getpid() and naming.search(" ".join(proc.info["cmdline"] or [])):
                for p in [proc, *proc.children(recursive=True)]:
                    mine[p.pid] = p
        except psutil.Error:
            continue
    for p in mine.values():
        try:
            p.terminate()
        except psutil.Error:
            pass
    # (the raylets, the GCS and the autoscaler took the whole 20 s this waited at first: two seconds,
    # then they are killed)
    _, alive = psutil.wait_procs(list(mine.values()), timeout=2)
    for p in alive:
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(alive, timeout=10)
    # and the address `ray start` left for ray.init() without an address to join (`ray stop` removes
    # it too): a later one would wait on this dead head
    try:
        from ray._common.utils import get_ray_address_file

        path = Path(get_ray_address_file(None))
        if path.is_file() and naming.search(path.read_text()):
            path.unlink()
    except (ImportError, OSError):
        pass


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    return target_only_texts(tiny_model_dir, PROMPTS)


def _nodes(kind: str) -> list[str]:
    """Alive nodes carrying the `kind` resource (target_node / draft_node)."""
    return [n["NodeID"] for n in ray.nodes() if n["Alive"] and kind in n["Resources"]]


def _replica_nodes(deployment: str) -> list[str]:
    """Nodes of the deployment's live replica actors (from the GCS: no dashboard here)."""
    actors = ray._private.state.actors().values()
    return [a["Address"]["NodeID"] for a in actors
            if a["State"] == "ALIVE" and a.get("ActorClassName") == f"ServeReplica:rayspec:{deployment}"]


def _running(deployment: str) -> int:
    return serve.status().applications["rayspec"].deployments[deployment].replica_states.get("RUNNING", 0)


def _complete(url: str, prompt: str, max_tokens: int) -> str:
    r = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": max_tokens,
                                                   "temperature": 0, "ignore_eos": True}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def _stream(url: str, prompt: str, max_tokens: int, temperature: float = 0.0) -> str:
    out = stream_completion(url + "/v1/completions", prompt, max_tokens, temperature)
    assert out["status"] == 200 and out["error"] is None, out
    return out["text"]


def test_deploy_launches_a_node_of_each_type(cluster, tiny_model_dir, reference):
    assert _nodes("target_node") == [] and _nodes("draft_node") == []
    started = time.monotonic()
    serve.run(build_app(_app_args(tiny_model_dir)), name="rayspec", route_prefix="/")
    TIMINGS["deploy_to_serving_s"] = time.monotonic() - started
    targets, drafts = _nodes("target_node"), _nodes("draft_node")
    assert len(targets) == 1 and len(drafts) == 1
    assert _replica_nodes("Verifier") == targets
    assert _replica_nodes("Proposer") == drafts
    assert [_complete(cluster, p, 24) for p in PROMPTS] == reference(24)
    print(f"demand to serving on new nodes: {TIMINGS['deploy_to_serving_s']:.1f} s")


def test_load_adds_a_target_node_and_removing_it_gives_it_back(cluster, reference):
    stop = threading.Event()
    failures: list[str] = []

    def loop() -> None:
        while not stop.is_set():
            try:
                _stream(cluster, "load load load", 300, temperature=0.9)
            except Exception as err:  # noqa: BLE001
                failures.append(repr(err))
                return

    threads = [threading.Thread(target=loop, daemon=True) for _ in range(4)]
    started = time.monotonic()
    for t in threads:
        t.start()
    try:
        wait_for(lambda: (_running("Verifier") == 2 and len(_nodes("target_node")) == 2) or failures,
                 timeout=120, interval=0.5)
        assert not failures, failures
        TIMINGS["scale_up_to_serving_s"] = time.monotonic() - started
        assert len(_nodes("target_node")) == 2 and len(set(_replica_nodes("Verifier"))) == 2
        assert _running("Proposer") == 1 and len(_nodes("draft_node")) == 1
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=120)
    assert not failures, failures
    print(f"load to a second verifier serving on a new node: {TIMINGS['scale_up_to_serving_s']:.1f} s")
    started = time.monotonic()
    wait_for(lambda: _running("Verifier") == 1 and len(_nodes("target_node")) == 1, timeout=90, interval=0.5)
    print(f"idle to the node given back: {time.monotonic() - started:.1f} s")
    assert _nodes("target_node") == _replica_nodes("Verifier")


def _kill_node(node_id: str) -> int:
    """Kill every process of one fake node (its raylet and workers), as a lost machine would go."""
    killed = 0
    for proc in psutil.process_iter():
        try:
            if proc.environ().get("RAY_OVERRIDE_NODE_ID_FOR_TESTING") == node_id:
                proc.send_signal(signal.SIGKILL)
                killed += 1
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return killed


def test_a_lost_target_node_is_replaced_and_streams_complete(cluster, reference):
    (victim,) = _nodes("target_node")
    expected = reference(160)
    out: dict[int, str] = {}
    errors: list[str] = []

    def one(i: int) -> None:
        try:
            out[i] = _stream(cluster, PROMPTS[i], 160)
        except Exception as err:  # noqa: BLE001
            errors.append(repr(err))

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    time.sleep(1.0)  # the streams are under way on the victim's verifier
    assert _kill_node(victim) > 0
    started = time.monotonic()
    for t in threads:
        t.join(timeout=240)
    assert not errors, errors
    assert [out[i] for i in range(len(PROMPTS))] == expected
    wait_for(lambda: _running("Verifier") >= 1 and _nodes("target_node") and victim not in _nodes("target_node"),
             timeout=120, interval=0.5)
    print(f"node lost to a verifier serving on its replacement: {time.monotonic() - started:.1f} s")
    assert [_complete(cluster, p, 24) for p in PROMPTS] == reference(24)
