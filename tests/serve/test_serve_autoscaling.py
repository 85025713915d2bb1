"""Verifier autoscaling 1 -> 2 -> 1 under streamed load (real local Ray, tiny model). Slow-ish (~1 min)."""

from __future__ import annotations

import threading

import httpx
import pytest

import ray.serve as serve

from ray_utils import serving
from serve_utils import is_error_event, tiny_args, wait_for  # noqa: E402

from deployments.app import build_app  # noqa: E402


@pytest.fixture(scope="module")
def autoscaled(tiny_model_dir, serve_url):
    args = tiny_args(tiny_model_dir, verifier={
        "max_ongoing_requests": 8,
        # Serve's replicas and handles push their autoscaling metrics every metrics_interval_s (default
        # 10 s; Ray marks the field deprecated in favour of environment variables this Ray does not read
        # for it), and the look-back must exceed it: at 0.5 s and 2 s this test took 15 s, not 32
        "autoscaling_config": {"min_replicas": 1, "max_replicas": 2, "target_ongoing_requests": 1,
                               "upscale_delay_s": 1, "downscale_delay_s": 3, "look_back_period_s": 2, "metrics_interval_s": 0.5},
        "ray_actor_options": {"num_cpus": 0.5}})
    with serving(("rayspec", build_app(args), "/")):
        yield serve_url


def _running_verifiers() -> int:
    status = serve.status().applications["rayspec"].deployments["Verifier"]
    return status.replica_states.get("RUNNING", 0)


@pytest.mark.slow
def test_verifier_scales_up_and_down(autoscaled):
    assert _running_verifiers() == 1
    stop = threading.Event()
    body = {"model": "tiny", "prompt": "load load load", "max_tokens": 900, "temperature": 0.9,
            "ignore_eos": True, "stream": True}
    outcomes: list[str] = []  # one per request of the load: "done" (ran to [DONE]) or "stopped" (closed by us)
    failures: list[str] = []  # anything else: a status other than 200, an error event, a transport error

    def one_request() -> None:
        try:
            with httpx.stream("POST", autoscaled + "/v1/completions", json=body, timeout=120) as r:
                if r.status_code != 200:
                    failures.append(f"HTTP {r.status_code}: {r.read()[:200]!r}")
                    return
                last = None
                for line in r.iter_lines():
                    if not line:
                        continue
                    if is_error_event(line):
                        failures.append(f"error event: {line[:200]}")
                        return
                    last = line
                    if stop.is_set():
                        outcomes.append("stopped")
                        return
                if last != "data: [DONE]":
                    failures.append(f"stream ended without [DONE]: {last!r}")
                    return
                outcomes.append("done")
        except httpx.HTTPError as err:
            failures.append(f"{type(err).__name__}: {err}")

    def load():
        while not stop.is_set():
            one_request()

    threads = [threading.Thread(target=load, daemon=True) for _ in range(4)]
    for t in threads:
        t.start()
    try:
        wait_for(lambda: _running_verifiers() == 2, timeout=90, interval=1)
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=60)
    assert not any(t.is_alive() for t in threads), "a load request hung"
    # every request of the load was served: a 200 stream that ran to [DONE] or that we closed at the end
    assert failures == [], failures
    # each thread sent at least one request; those in flight at the end were closed by us
    assert len(outcomes) >= len(threads) and 1 <= outcomes.count("stopped") <= len(threads), outcomes
    wait_for(lambda: _running_verifiers() == 1 and serve.status().applications["rayspec"]
             .deployments["Verifier"].status == "HEALTHY", timeout=120, interval=1)
