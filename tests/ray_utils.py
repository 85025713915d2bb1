"""The test session's shared local Ray cluster and its Serve instance (one per pytest-xdist worker), not a test module.

Starting a local Ray cluster and Serve's controller and proxy costs 10-30 s on the 2-core CI
machine, stopping them as much again; modules used to do both once each. Now every module that
needs nothing special of its cluster takes this one (the `ray_cluster` and `serve_url` fixtures in
tests/conftest.py): it is started on first use and stopped at the end of the session, or by
`release_shared_cluster()` before a test that brings its own cluster (a `ray.cluster_utils.Cluster`,
`ray start`, a cluster with its own environment or runtime_env, a `rayspec serve` process). The
conftest runs those modules (tier `cluster`) before the serve tier, so the shared cluster starts once.

Its settings are the union of what the modules asked of their own clusters: logical CPUs for the
largest (12, test_serve_pool_scaling) with headroom, no GPUs, Serve's autoscaling metrics pushed
every 0.5 s (test_serve_pool_scaling; the default is 10 s), Ray's metrics exported on a port of its
own and reported every second (test_serve_openai).
"""

from __future__ import annotations

import contextlib
import os

NUM_CPUS = 16

# given to the cluster's raylet, which every worker inherits (not left in the driver's environment)
CLUSTER_ENV = {"RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S": "0.5",
               "RAY_SERVE_HANDLE_AUTOSCALING_METRIC_PUSH_INTERVAL_S": "0.5",
               # Serve's proxy bounded as `rayspec serve` bounds it (deployments/frontend/proxy_guard.py),
               # its body deadline shorter than the ingress's 30 s: a test can tell whose 408 it got
               "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH": "deployments.frontend.proxy_guard:middlewares",
               "RAYSPEC_PROXY_BODY_TIMEOUT_S": "10"}

def head_node_args(**args) -> dict:
    """ray.cluster_utils.Cluster's head_node_args with a dashboard port of its own: CI's two serve workers
    may each run a cluster test at once, and a second head on Ray's default 8265 fails to bind it and
    starts no dashboard, which Ray's state API (list_actors) then cannot reach."""
    return {"dashboard_port": free_port(), **args}


_shared: dict | None = None  # while the shared cluster is up: its metrics port, and Serve's HTTP port once started


_issued: set[int] = set()
PORT_RANGE = (20000, 32767)  # below Linux's ephemeral ports (32768-60999), above Ray's worker ports (10002-19999)


def free_port() -> int:
    """A port free now, for a server a test starts, from PORT_RANGE, never the same twice in a process.

    Not a port the kernel picks (binding port 0): Ray's own processes take theirs that way (GCS,
    raylet, object manager, agents, metrics), so a port picked so and then left free until the test's
    server binds it could be handed to one of them meanwhile: a test that picked a port and then
    started a Ray cluster behind `rayspec serve` found a Ray process answering on it (CI run of
    2026-12-05 03:38: httpx's RemoteProtocolError "illegal request line")."""
    import random
    import socket

    rng = random.Random()
    for _ in range(1000):
        port = rng.randint(*PORT_RANGE)
        if port in _issued:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _issued.add(port)
        return port
    raise RuntimeError(f"no free port in {PORT_RANGE}")



def shared_cluster() -> dict:
    """Start the shared cluster unless it is up; {"metrics_port": ..., ["http_port": ...]}."""
    global _shared
    import ray

    if _shared is not None and ray.is_initialized():
        return _shared
    if ray.is_initialized():  # a test's own cluster left connected: not ours to keep
        ray.shutdown()
    metrics_port = free_port()
    saved = {key: os.environ.get(key) for key in CLUSTER_ENV}
    os.environ.update(CLUSTER_ENV)
    try:
        ray.init(address="local", num_cpus=NUM_CPUS, num_gpus=0, include_dashboard=False, log_to_driver=False,
                 _metrics_export_port=metrics_port, _system_config={"metrics_report_interval_ms": 1000})
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
    _shared = {"metrics_port": metrics_port}
    return _shared


def shared_serve_url() -> str:
    """Serve on the shared cluster (started unless it runs): its HTTP proxy's base URL."""
    from ray import serve

    info = shared_cluster()
    if "http_port" not in info:
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        info["http_port"] = port
    return f"http://127.0.0.1:{info['http_port']}"


def release_shared_cluster() -> None:
    """Stop the shared cluster if it runs (a test about to start its own calls this)."""
    global _shared
    import ray

    if _shared is None:
        return
    try:
        if "http_port" in _shared and ray.is_initialized():
            from ray import serve

            serve.shutdown()
    finally:
        _shared = None
        ray.shutdown()


def stop_cluster(cluster) -> None:
    """Stop a test's own ray.cluster_utils.Cluster at once: the driver disconnected, then each node's
    processes killed, not stopped gracefully (Cluster.shutdown() sends SIGTERM and waits process by
    process; nothing of a test's cluster is kept). Serve's controller, proxy and replicas go with
    their nodes: no serve.shutdown() first."""
    import ray

    ray.shutdown()
    for node in list(cluster.worker_nodes):
        cluster.remove_node(node, allow_graceful=False)
    if cluster.head_node is not None:
        cluster.remove_node(cluster.head_node, allow_graceful=False)
    ray.experimental.internal_kv._internal_kv_reset()


@contextlib.contextmanager
def serving(*apps):
    """Deploy (name, application, route_prefix) triples on the shared Serve instance, all at once (their
    replicas start beside each other, not app after app); delete them on exit, so the next module finds
    the cluster's resources free and its route prefixes unused."""
    from ray import serve
    from ray.serve.api import RunTarget  # (a DeveloperAPI of serve.run_many)

    names = [name for name, _, _ in apps]  # a deploy that fails part-way is deleted too
    try:
        serve.run_many([RunTarget(app, name=name, route_prefix=route_prefix)
                        for name, app, route_prefix in apps])
        yield
    finally:
        delete_apps(names)


def cpus_in_use(settle_s: float = 0.0, expect: float | None = None) -> float:
    """Logical CPUs of the cluster that actors hold now; with `expect`, polled up to settle_s until it
    is that (Ray's available count trails placement by a moment)."""
    import time

    import ray

    deadline = time.monotonic() + settle_s
    while True:
        used = ray.cluster_resources().get("CPU", 0.0) - ray.available_resources().get("CPU", 0.0)
        if expect is None or abs(used - expect) < 1e-6 or time.monotonic() > deadline:
            return used
        time.sleep(0.2)


def delete_apps(names=None) -> None:
    """Delete these apps (all of them: None) from the shared Serve instance, if it runs."""
    from ray import serve

    if _shared is None or "http_port" not in _shared:
        return
    status = serve.status().applications
    names = [name for name in (list(status) if names is None else names) if name in status]
    if names:  # all at once: each app's replicas drain and stop beside the others'
        from ray.serve.context import _get_global_client

        _get_global_client().delete_apps(names, blocking=True)
