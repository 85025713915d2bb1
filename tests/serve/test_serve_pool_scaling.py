"""The proposer pool and the verifier pool scale on their own signals (deployments.operations.autoscaling).

Two disaggregated apps on one local Ray cluster, the same streamed load on each:
- a slow draft (a draft model far heavier than the target): the proposers are the bottleneck, their
  busy fraction grows the proposer pool 1 -> 2 while the verifier pool, far under its ongoing-request
  target, stays at 1;
- a cheap draft (n-gram): the requests are the load, the verifier pool grows 1 -> 2 while the idle
  proposer pool stays at 1.
Replica counts are read from Serve's status.
"""

from __future__ import annotations

import threading
import time

import httpx
import pytest
import ray.serve as serve

from conftest import make_tiny_model_dir
from ray_utils import serving
from serve_utils import is_error_event, tiny_args, wait_for
from deployments.app import build_app
from deployments.operations.autoscaling import BUSY_METRIC, BusyMeter, ProposerBusyPolicy, proposer_autoscaling_config

# metrics pushed every 0.5 s rather than Serve's 10 (tests/serve/test_serve_autoscaling.py), the look-back past it
FAST = {"upscale_delay_s": 1, "downscale_delay_s": 600, "look_back_period_s": 3, "metrics_interval_s": 0.5}


# ---- the signal and the policy, without Ray ------------------------------------------------------

class _Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_busy_meter_measures_the_window():
    clock = _Clock()
    meter = BusyMeter(window_s=10.0, clock=clock)
    clock.now += 2
    assert meter.fraction() == 0.0
    with meter:
        clock.now += 2  # 2 s busy of 4 s of life
        assert meter.fraction() == pytest.approx(0.5)  # the span in progress counts
    assert meter.fraction() == pytest.approx(0.5)
    clock.now += 16  # the span left the 10 s window
    assert meter.fraction() == 0.0
    for _ in range(5):  # 1 s busy, 1 s idle
        with meter:
            clock.now += 1
        clock.now += 1
    assert meter.fraction() == pytest.approx(0.5)


class _Ctx:
    def __init__(self, busy: dict, running, target=1):
        self.aggregated_metrics = {BUSY_METRIC: busy}
        self.running_replicas = running
        self.current_num_replicas = len(running)
        self.target_num_replicas = target


def test_busy_policy_asks_for_what_keeps_replicas_at_target():
    policy = ProposerBusyPolicy(target_busy=0.6)
    assert policy(_Ctx({"a": 0.9}, ["a"]))[0] == pytest.approx(1.5)  # Serve rounds up: 2
    assert policy(_Ctx({"a": 0.2, "b": 0.2}, ["a", "b"], 2))[0] == pytest.approx(0.4 / 0.6)
    assert policy(_Ctx({"a": 0.9, "gone": 1.0}, ["a"]))[0] == pytest.approx(1.5)  # stopped replicas ignored
    assert policy(_Ctx({}, ["a"], target=1))[0] == 1  # no report yet: hold
    with pytest.raises(ValueError):
        ProposerBusyPolicy(target_busy=0)
    config = proposer_autoscaling_config({"min_replicas": 1, "max_replicas": 3, "target_busy": 0.5})
    assert config["policy"]["policy_kwargs"] == {"target_busy": 0.5} and "target_busy" not in config
    with pytest.raises(ValueError, match="target_busy"):
        proposer_autoscaling_config({"target_busy": 0.5, "policy": {"policy_function": "x:y"}})
    # verifiers re-pin (spreading over a grown pool) by default only where the pool autoscales
    from deployments.config import load_app_args

    base = {"topology": "disaggregated", "speculative": {"method": "ngram"}}
    assert load_app_args(base).repin_interval_s is None
    assert load_app_args({**base, "proposer": {"autoscaling_config": {"max_replicas": 2}}}).repin_interval_s == 60.0
    assert load_app_args({**base, "proposer_repin_interval_s": 5}).repin_interval_s == 5


# ---- two pools, two bottlenecks ------------------------------------------------------------------

@pytest.fixture(scope="module")
def cluster(tiny_model_dir, tmp_path_factory, serve_url):
    # the shared cluster's replicas report their autoscaling metrics every 0.5 s instead of 10
    # (tests/ray_utils.py)
    from ray_utils import CLUSTER_ENV
    assert CLUSTER_ENV["RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S"] == "0.5"
    heavy_draft = make_tiny_model_dir(tmp_path_factory.mktemp("heavy-draft") / "model", seed=5, num_layers=6,
                                      hidden=256)
    one_to_two = {"min_replicas": 1, "max_replicas": 2, **FAST}
    slow_draft = tiny_args(
        tiny_model_dir, topology="disaggregated", proposer_repin_interval_s=2.0,
        speculative={"method": "draft_model", "draft_model": str(heavy_draft), "num_speculative_tokens": 4,
                     "adaptive": False},
        # two verifiers that do not grow (far under their request target): after the proposer pool
        # grows they re-pin (every 2 s here) and spread over it
        verifier={"autoscaling_config": {**one_to_two, "min_replicas": 2, "max_replicas": 3,
                                         "target_ongoing_requests": 64}},
        proposer={"autoscaling_config": {**one_to_two, "target_busy": 0.3}})
    cheap_draft = tiny_args(
        tiny_model_dir, topology="disaggregated",
        verifier={"max_ongoing_requests": 8, "autoscaling_config": {**one_to_two, "target_ongoing_requests": 1}},
        proposer={"autoscaling_config": {**one_to_two, "target_busy": 0.6}})
    with serving(("slow", build_app(slow_draft), "/slow"), ("cheap", build_app(cheap_draft), "/cheap")):
        yield serve_url


def _running(app: str, deployment: str) -> int:
    status = serve.status().applications[app].deployments[deployment]
    return status.replica_states.get("RUNNING", 0)


class _Load:
    """`streams` streaming completions kept going until stopped; any failure is recorded."""

    def __init__(self, url: str, streams: int):
        self.url, self.stop, self.failures, self.done = url, threading.Event(), [], 0
        self.threads = [threading.Thread(target=self._loop, daemon=True) for _ in range(streams)]

    def _loop(self) -> None:
        body = {"model": "tiny", "prompt": "load load load", "max_tokens": 400, "temperature": 0.8,
                "ignore_eos": True, "stream": True}
        while not self.stop.is_set():
            try:
                with httpx.stream("POST", self.url + "/v1/completions", json=body, timeout=120) as r:
                    if r.status_code != 200:
                        self.failures.append(f"HTTP {r.status_code}")
                        return
                    for line in r.iter_lines():
                        if self.stop.is_set():
                            break
                        if is_error_event(line):
                            self.failures.append(line[:200])
                            return
                self.done += 1
            except httpx.HTTPError as err:
                self.failures.append(repr(err))
                return

    def __enter__(self):
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(timeout=60)


def _proposer_calls(app: str) -> dict[str, int]:
    """num_calls per proposer replica (stats from enough handle calls to reach every replica)."""
    handle = serve.get_deployment_handle("Proposer", app)
    seen: dict[str, int] = {}
    for _ in range(24):
        stats = handle.stats.remote().result(timeout_s=30)
        seen[stats["replica"]] = stats["num_calls"]
    return seen


@pytest.mark.parametrize("app, grows, stays", [("slow", "Proposer", "Verifier"), ("cheap", "Verifier", "Proposer")])
def test_each_pool_grows_on_its_own_bottleneck(cluster, app, grows, stays):
    before = {"slow": 2, "cheap": 1}[app]
    assert _running(app, grows) == 1 and _running(app, stays) == before
    started = time.monotonic()
    with _Load(f"{cluster}/{app}", streams=4) as load:
        wait_for(lambda: _running(app, grows) == 2 or load.failures, timeout=150, interval=0.5)
        assert not load.failures, load.failures
        assert _running(app, grows) == 2, f"{grows} did not scale up"
        print(f"{app}: {grows} 1 -> 2 in {time.monotonic() - started:.1f} s under 4 streams")
        if app == "slow":  # the verifiers spread over the new proposer: both replicas draft
            def both_seen():
                calls = _proposer_calls(app)
                return calls if len(calls) == 2 else None

            first = wait_for(both_seen, timeout=60, interval=1.0)
            wait_for(lambda: all(n > first[r] for r, n in both_seen().items()) if both_seen() else False,
                     timeout=60, interval=1.0)
        else:
            time.sleep(3)  # a few more autoscaling periods under the same load
        assert _running(app, stays) == before, f"{stays} scaled without being the bottleneck"
    assert not load.failures, load.failures
