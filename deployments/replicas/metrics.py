"""Prometheus metrics of a verifier replica: vLLM's (V1) set, named `rayspec_*` after vLLM's `vllm:*`.

Exported through Ray's metrics agent, which writes every name as `ray_<name>` and a counter's as
`ray_<name>_total`: `rayspec_generation_tokens` is scraped as `ray_rayspec_generation_tokens_total`
(vLLM: `vllm:generation_tokens_total`; vLLM inside Ray Serve LLM: `ray_vllm_generation_tokens_total`).
Not `rayspec:`: Ray 2.60 warns that ':' in a name "is no longer allowed" and its exporter drops
such a metric (checked by a scrape). Every metric carries `model_name` plus the replica tags Serve
adds (`deployment`, `replica`, `application`). METRICS is the one list: the docs table
(deployments/README.md "Metrics"), the Grafana dashboard and the tests are checked against it.
"""

from __future__ import annotations

from rayspec.engine.metrics import IterationStats

PREFIX = "rayspec_"
RAY_PREFIX = "ray_"  # what Ray's exporter puts before every name

_LATENCY_S = [0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0]
_REQUEST_S = [0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 15.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0]
_TOKENS = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000, 200000]

# name (without PREFIX) -> (kind, tag keys besides model_name, histogram boundaries, meaning)
METRICS: dict[str, tuple[str, tuple[str, ...], list | None, str]] = {
    "num_requests_running": ("gauge", (), None, "Requests holding KV cache (prefilling or decoding)."),
    "num_requests_waiting": ("gauge", (), None, "Requests waiting for KV cache."),
    "kv_cache_usage_perc": ("gauge", (), None, "Fraction of the KV cache in use, 0..1."),
    "prefix_cache_queries": ("counter", (), None, "Prompt tokens looked up in the prefix cache."),
    "prefix_cache_hits": ("counter", (), None, "Prompt tokens whose KV came from the prefix cache."),
    "prompt_tokens": ("counter", (), None, "Prompt tokens prefilled."),
    "generation_tokens": ("counter", (), None, "Output tokens generated."),
    "request_success": ("counter", ("finished_reason",), None,
                        "Finished requests, by finish reason (stop, length, abort, error)."),
    "time_to_first_token_seconds": ("histogram", (), _LATENCY_S, "Arrival to the first output token."),
    "inter_token_latency_seconds": ("histogram", (), _LATENCY_S,
                                    "Between a request's successive outputs (one per step that gave it "
                                    "tokens: with speculation a step gives several)."),
    "request_time_per_output_token_seconds": ("histogram", (), _LATENCY_S,
                                              "A finished request's mean time per output token after the first."),
    "e2e_request_latency_seconds": ("histogram", (), _REQUEST_S, "Arrival to the last output."),
    "request_queue_time_seconds": ("histogram", (), _REQUEST_S, "Arrival to first scheduled (admitted to the KV cache)."),
    "request_prompt_tokens": ("histogram", (), _TOKENS, "A finished request's prompt tokens."),
    "request_generation_tokens": ("histogram", (), _TOKENS, "A finished request's output tokens."),
    "spec_decode_num_drafts": ("counter", (), None, "Verification steps that carried draft tokens."),
    "spec_decode_num_draft_tokens": ("counter", (), None, "Draft tokens proposed."),
    "spec_decode_num_accepted_tokens": ("counter", (), None, "Draft tokens accepted."),
    "spec_decode_num_accepted_tokens_per_pos": ("counter", ("position",), None,
                                                "Draft tokens accepted at each draft position (0 = first)."),
    "speculation_cache_hits": ("counter", (), None,
                               "Drafts the proposer had ready when the verdict came (pre-drafted during "
                               "verification; disaggregated, proposer_async_hypotheses > 0)."),
    "speculation_cache_misses": ("counter", (), None,
                                 "Drafts the asynchronous proposer drafted on the call (no pre-draft matched the verdict)."),
}


def scraped_names(name: str) -> list[str]:
    """The series names a Prometheus scrape shows for METRICS[name]."""
    full = RAY_PREFIX + PREFIX + name
    kind = METRICS[name][0]
    if kind == "counter":
        return [full + "_total"]
    if kind == "histogram":
        return [full + "_bucket", full + "_sum", full + "_count"]
    return [full]


def exported_series() -> set[str]:
    return {series for name in METRICS for series in scraped_names(name)}


_SPEC_KEYS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")
_CACHE_KEYS = ("speculation_cache_hits", "speculation_cache_misses")  # disaggregated snapshots only


class VerifierMetrics:
    """The replica's metrics. The engine loop calls observe_iteration once per step that moved a
    request and update(snapshot) after every step: gauges are set from the snapshot, and the
    spec-decode counters follow the engine's SpecDecodeStats by deltas, so they equal its counts."""

    def __init__(self, model_name: str):
        from ray.serve import metrics  # Serve's classes add the replica tags

        makers = {"counter": metrics.Counter, "gauge": metrics.Gauge, "histogram": metrics.Histogram}
        self._metrics = {}
        for name, (kind, keys, boundaries, desc) in METRICS.items():
            extra = {"boundaries": boundaries} if kind == "histogram" else {}
            metric = makers[kind](PREFIX + name, description=desc, tag_keys=("model_name",) + keys, **extra)
            metric.set_default_tags({"model_name": model_name})
            self._metrics[name] = metric
        self._last = dict.fromkeys(_SPEC_KEYS + _CACHE_KEYS, 0)
        self._last_pos: list[int] = []

    def _inc(self, name: str, value: float, tags: dict | None = None) -> None:
        if value > 0:
            self._metrics[name].inc(value, tags=tags)

    def observe_iteration(self, stats: IterationStats) -> None:
        self._inc("prompt_tokens", stats.num_prompt_tokens)
        self._inc("generation_tokens", stats.num_generation_tokens)
        self._inc("prefix_cache_queries", stats.num_prefix_cache_queries)
        self._inc("prefix_cache_hits", stats.num_prefix_cache_hits)
        for name, values in (("time_to_first_token_seconds", stats.time_to_first_tokens),
                             ("inter_token_latency_seconds", stats.inter_token_latencies),
                             ("request_queue_time_seconds", stats.queue_times)):
            histogram = self._metrics[name]
            for value in values:
                histogram.observe(value)
        for req in stats.finished:
            self._metrics["request_success"].inc(1, tags={"finished_reason": req.finish_reason})
            self._metrics["e2e_request_latency_seconds"].observe(req.e2e_latency)
            self._metrics["request_prompt_tokens"].observe(req.num_prompt_tokens)
            self._metrics["request_generation_tokens"].observe(req.num_generation_tokens)
            if req.mean_time_per_output_token is not None:
                self._metrics["request_time_per_output_token_seconds"].observe(req.mean_time_per_output_token)

    def update(self, snap: dict) -> None:
        for key in _SPEC_KEYS:
            if snap[key] < self._last[key]:  # the engine's stats were reset
                self._last[key] = 0
            self._inc("spec_decode_" + key, snap[key] - self._last[key])
            self._last[key] = snap[key]
        for key in _CACHE_KEYS:
            value = snap.get(key, 0)
            self._inc(key, value - self._last[key])
            self._last[key] = value
        per_pos = snap["num_accepted_tokens_per_pos"]
        if sum(per_pos) < sum(self._last_pos):
            self._last_pos = []
        for pos, value in enumerate(per_pos):
            prev = self._last_pos[pos] if pos < len(self._last_pos) else 0
            self._inc("spec_decode_num_accepted_tokens_per_pos", value - prev, tags={"position": str(pos)})
        self._last_pos = list(per_pos)
        self._metrics["num_requests_running"].set(snap["num_running"])
        self._metrics["num_requests_waiting"].set(snap["num_waiting"])
        self._metrics["kv_cache_usage_perc"].set(snap["kv_cache_usage"])
