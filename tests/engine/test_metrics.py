"""Request metrics without a cluster: the engine loop's per-step stats against what it delivered,
the Grafana dashboard and the docs against the exported names (the served scrape:
tests/serve/test_serve_openai.py::test_prometheus_metrics)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from deployments.replicas.metrics import METRICS, PREFIX, RAY_PREFIX, exported_series, scraped_names
from engine_utils import make_engine, submit_all
from serve_utils import wait_for
from rayspec.engine.metrics import IterationStats
from rayspec.sampling.sampler import SamplingParams

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deployments" / "grafana" / "rayspec_dashboard.json"


def test_names_follow_vllm_under_our_prefix():
    assert PREFIX == "rayspec_" and ":" not in PREFIX  # Ray 2.60 drops ':' names
    assert scraped_names("generation_tokens") == ["ray_rayspec_generation_tokens_total"]
    assert scraped_names("kv_cache_usage_perc") == ["ray_rayspec_kv_cache_usage_perc"]
    assert scraped_names("inter_token_latency_seconds") == [
        "ray_rayspec_inter_token_latency_seconds_bucket", "ray_rayspec_inter_token_latency_seconds_sum",
        "ray_rayspec_inter_token_latency_seconds_count"]
    vllm_v1 = {"num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "prefix_cache_queries",
               "prefix_cache_hits", "prompt_tokens", "generation_tokens", "request_success",
               "time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds",
               "request_queue_time_seconds", "request_prompt_tokens", "request_generation_tokens",
               "spec_decode_num_drafts", "spec_decode_num_draft_tokens", "spec_decode_num_accepted_tokens",
               "spec_decode_num_accepted_tokens_per_pos"}
    assert vllm_v1 <= set(METRICS)
    assert "time_per_output_token_seconds" not in METRICS  # vLLM's deprecated name
    assert METRICS["request_success"][1] == ("finished_reason",)
    assert METRICS["spec_decode_num_accepted_tokens_per_pos"][1] == ("position",)


def _queried_names(obj) -> set[str]:
    found: set[str] = set()
    if isinstance(obj, dict):
        for value in obj.values():
            found |= _queried_names(value)
    elif isinstance(obj, list):
        for value in obj:
            found |= _queried_names(value)
    elif isinstance(obj, str):
        found |= set(re.findall(r"\b" + RAY_PREFIX + PREFIX + r"[a-z0-9_]+", obj))
    return found


def test_dashboard_queries_only_exported_names():
    dashboard = json.loads(DASHBOARD.read_text())
    queried = _queried_names(dashboard)
    assert queried and queried <= exported_series(), sorted(queried - exported_series())
    # the panels the dashboard promises, each from our histograms / counters
    titles = " | ".join(p["title"] for p in dashboard["panels"])
    for word in ("Request rate", "running / waiting", "KV cache", "Time to first token", "Inter-token",
                 "End-to-end", "Token throughput", "acceptance", "per draft position", "Prefix cache"):
        assert word in titles, word
    for base in ("time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds"):
        for q in ("0.5", "0.99"):
            assert any(f"histogram_quantile({q}, sum by (le) (rate({RAY_PREFIX}{PREFIX}{base}_bucket" in t["expr"]
                       for p in dashboard["panels"] for t in p["targets"]), (base, q)
    # a Prometheus datasource variable, used by every panel
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    assert all(p["datasource"] == {"type": "prometheus", "uid": "${datasource}"} for p in dashboard["panels"])
    assert len({p["id"] for p in dashboard["panels"]}) == len(dashboard["panels"])


def test_readme_documents_every_exported_name():
    text = (ROOT / "deployments" / "README.md").read_text()
    section = text.split("## Metrics", 1)[1].split("\n## ", 1)[0]
    for name in METRICS:
        shown = scraped_names(name)[0].removesuffix("_bucket")
        assert f"`{shown}`" in section, shown
    assert "deployments/grafana/rayspec_dashboard.json" in section


class Recorder:
    """A metrics sink that keeps what the loop hands it."""

    def __init__(self):
        self.steps: list[IterationStats] = []
        self.snapshot: dict = {}

    def observe_iteration(self, stats: IterationStats) -> None:
        self.steps.append(stats)

    def update(self, snapshot: dict) -> None:
        self.snapshot = dict(snapshot)

    def total(self, field: str):
        return sum(getattr(s, field) if isinstance(getattr(s, field), int) else len(getattr(s, field))
                   for s in self.steps)


@pytest.fixture(scope="module")
def loaded(tiny_model_dir):
    from rayspec.model import loader

    return loader.load_model(str(tiny_model_dir))


def test_engine_loop_stats_match_what_it_delivered(tiny_model_dir, loaded):
    """Three requests on two KV slots (one waits): prompt and output token counts equal the
    delivered outputs', one TTFT, queue time and e2e per request, one inter-token latency per
    later output that carried tokens; an abort counts as finished_reason "abort"; the snapshot's
    KV usage is a fraction."""
    from deployments.replicas.engine_loop import EngineLoop

    recorder = Recorder()
    loop = EngineLoop(lambda: make_engine(tiny_model_dir, "ngram", k=4, max_num_seqs=2, loaded=loaded),
                      metrics=recorder)
    loop.wait_ready(60)
    prompts = {"a": "The quick brown fox jumps over the lazy dog. The quick brown fox",
               "b": "one two three one two three one two", "c": "Hello there, how are"}
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    try:
        got = submit_all(loop, prompts, params, timeout=120)
        final = {rid: outs[-1] for rid, outs in got.items()}
        assert all(out.finish_reason == "length" and out.num_output_tokens == 12 for out in final.values())
        assert recorder.total("num_prompt_tokens") == sum(o.num_prompt_tokens for o in final.values())
        assert recorder.total("num_prefix_cache_queries") == recorder.total("num_prompt_tokens")
        assert recorder.total("num_prefix_cache_hits") == sum(getattr(o, "num_cached_tokens", 0) for o in final.values())
        assert recorder.total("num_generation_tokens") == 36
        assert recorder.total("time_to_first_tokens") == 3 and recorder.total("queue_times") == 3
        outputs_with_tokens = sum(1 for outs in got.values() for i, o in enumerate(outs)
                                  if o.num_output_tokens > (outs[i - 1].num_output_tokens if i else 0))
        assert recorder.total("inter_token_latencies") == outputs_with_tokens - 3
        done = [f for s in recorder.steps for f in s.finished]
        assert sorted(f.finish_reason for f in done) == ["length"] * 3
        assert sorted(f.num_generation_tokens for f in done) == [12] * 3
        assert sorted(f.num_prompt_tokens for f in done) == sorted(o.num_prompt_tokens for o in final.values())
        ttfts = sorted(t for s in recorder.steps for t in s.time_to_first_tokens)
        assert all(f.e2e_latency >= ttfts[0] and f.mean_time_per_output_token > 0 for f in done)
        # the third request waited for a slot: its queue time is the largest, and positive
        assert max(t for s in recorder.steps for t in s.queue_times) > 0
        snap = recorder.snapshot
        assert 0.0 <= snap["kv_cache_usage"] <= 1.0 and snap["num_running"] == 0
        assert snap["num_drafts"] > 0  # the spec-decode counters come from here (VerifierMetrics.update)

        # an abort (sent when its first tokens arrive, so handled before the next step): finished_reason
        # "abort", with the tokens it had
        recorder.steps.clear()
        first: list = []

        def deliver_d(item):
            if not first and not isinstance(item, Exception) and item.num_output_tokens:
                first.append(item.num_output_tokens)
                first.append(loop.engine.kv_cache_usage())  # on the loop thread, the request holding KV
                loop.abort("d")

        loop.submit("d", prompts["a"], SamplingParams(temperature=0, max_tokens=200, ignore_eos=True), deliver_d)
        wait_for(lambda: first, timeout=60)
        loop.call(lambda engine: None)  # after the abort, which was queued first
        done = [f for s in recorder.steps for f in s.finished]
        assert [f.finish_reason for f in done] == ["abort"] and done[0].num_generation_tokens == first[0]
        assert 0.0 < first[1] <= 1.0
    finally:
        loop.shutdown()


def test_engine_loop_turns_a_chat_prompt_into_the_templates_ids(tiny_model_dir, loaded):
    """A ChatPrompt (the verifier's typed chat request) is encoded by the engine's chat template on the
    loop thread: the same prompt tokens and greedy output as those template ids submitted directly."""
    from deployments.replicas.engine_loop import ChatPrompt, EngineLoop

    loop = EngineLoop(lambda: make_engine(tiny_model_dir, "ngram", k=4, loaded=loaded))
    loop.wait_ready(60)
    messages = [{"role": "user", "content": "one two three one two three"}]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    try:
        ids = loop.call(lambda engine: engine.encode_chat(messages))
        got = submit_all(loop, {"chat": ChatPrompt(messages), "ids": ids}, params, timeout=120)
        outputs = {rid: [t for out in outs for t in out.delta_token_ids] for rid, outs in got.items()}
        assert got["chat"][-1].num_prompt_tokens == got["ids"][-1].num_prompt_tokens == len(ids)
        assert outputs["chat"] == outputs["ids"] and len(outputs["chat"]) == 8
    finally:
        loop.shutdown()
