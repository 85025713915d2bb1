"""Verifier autoscaling 1 -> 2 -> 1 under streamed load (real local Ray, tiny model). Slow-ish (~1 min)."""

from __future__ import annotations

import threading

import httpx
import pytest

ray = pytest.importorskip("ray")
serve = pytest.importorskip("ray.serve")

from serve_utils import free_port, tiny_args, wait_for  # noqa: E402

from deployments.app import build_app  # noqa: E402


@pytest.fixture(scope="module")
def autoscaled(tiny_model_dir):
    ray.init(num_cpus=8, num_gpus=0, include_dashboard=False, log_to_driver=False)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    args = tiny_args(tiny_model_dir, verifier={
        "max_ongoing_requests": 8,
        "autoscaling_config": {"min_replicas": 1, "max_replicas": 2, "target_ongoing_requests": 1,
                               "upscale_delay_s": 1, "downscale_delay_s": 3, "look_back_period_s": 2},
        "ray_actor_options": {"num_cpus": 0.5}})
    serve.run(build_app(args), name="rayspec", route_prefix="/")
    yield f"http://127.0.0.1:{port}"
    serve.shutdown()
    ray.shutdown()


def _running_verifiers() -> int:
    status = serve.status().applications["rayspec"].deployments["Verifier"]
    return status.replica_states.get("RUNNING", 0)


@pytest.mark.slow
def test_verifier_scales_up_and_down(autoscaled):
    assert _running_verifiers() == 1
    stop = threading.Event()
    body = {"model": "tiny", "prompt": "load load load", "max_tokens": 900, "temperature": 0.9,
            "ignore_eos": True, "stream": True}

    def load():
        while not stop.is_set():
            try:
                with httpx.stream("POST", autoscaled + "/v1/completions", json=body, timeout=60) as r:
                    for _ in r.iter_lines():
                        if stop.is_set():
                            break
            except httpx.HTTPError:
                pass

    threads = [threading.Thread(target=load, daemon=True) for _ in range(4)]
    for t in threads:
        t.start()
    try:
        wait_for(lambda: _running_verifiers() == 2, timeout=90, interval=1)
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=30)
    wait_for(lambda: _running_verifiers() == 1 and serve.status().applications["rayspec"]
             .deployments["Verifier"].status == "HEALTHY", timeout=120, interval=1)
