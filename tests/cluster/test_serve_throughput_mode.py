"""The disaggregated graph under Ray Serve's throughput-optimized mode (RAY_SERVE_THROUGHPUT_OPTIMIZED=1).

That mode runs a handle's router in the caller's event loop, so a sync `.result()` from the
verifier's engine thread (which has no loop) failed and the Verifier never deployed. The
RemoteProposer now gives its handle a router on its own loop; this serves a disaggregated app on
a cluster started with that setting and checks the greedy output and that drafts were used.
"""

from __future__ import annotations

import httpx
import pytest

import ray
import ray.serve as serve

from serve_utils import free_port, tiny_args  # noqa: E402

from deployments.app import build_app  # noqa: E402
from rayspec.config import EngineConfig, SpeculativeConfig  # noqa: E402
from rayspec.engine.llm_engine import LLMEngine  # noqa: E402
from rayspec.sampling.sampler import SamplingParams  # noqa: E402

PROMPT = "one two three four five six seven one two three four five six seven one two"


def test_disaggregated_graph_in_throughput_optimized_mode(tiny_model_dir, tiny_draft_dir, monkeypatch, own_cluster):
    # the raylet and every worker (controller, proxy, replicas) inherit this from the driver
    monkeypatch.setenv("RAY_SERVE_THROUGHPUT_OPTIMIZED", "1")
    # that mode serves HTTP from the ingress replica itself (direct ingress), and Serve then holds a
    # stopping ingress replica open RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S (30 s by default)
    # for an external load balancer to deregister it: none here, so the app's delete need not wait
    monkeypatch.setenv("RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S", "0")
    spec = {"method": "draft_model", "draft_model": str(tiny_draft_dir), "num_speculative_tokens": 3}
    ray.init(address="local", num_cpus=4, num_gpus=0, include_dashboard=False, log_to_driver=False)
    try:
        port = free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        serve.run(build_app(tiny_args(tiny_model_dir, topology="disaggregated", speculative=spec)),
                  name="rayspec", route_prefix="/")
        url = f"http://127.0.0.1:{port}"
        replica_env = ray.get(ray.remote(lambda: __import__("os").environ.get("RAY_SERVE_THROUGHPUT_OPTIMIZED"))
                              .remote())
        assert replica_env == "1"  # the workers really run in that mode
        assert httpx.get(url + "/health", timeout=60).status_code == 200
        body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 24, "temperature": 0, "ignore_eos": True}
        got = httpx.post(url + "/v1/completions", json=body, timeout=120)
        assert got.status_code == 200, got.text
        engine = LLMEngine(EngineConfig(model=str(tiny_model_dir), max_model_len=1024, max_num_seqs=4,
                                        kv_cache_memory_gb=0.25, speculative=SpeculativeConfig(**spec)))
        ref = engine.generate([PROMPT], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))[0]
        assert got.json()["choices"][0]["text"] == ref.text
        details = got.json()["usage"]["completion_tokens_details"]
        assert details["accepted_prediction_tokens"] + details["rejected_prediction_tokens"] > 0  # drafts came
    finally:
        serve.shutdown()
        ray.shutdown()
