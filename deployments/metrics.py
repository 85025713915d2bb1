"""Ray Serve metrics of the verifier (exported with Ray's metrics, `ray_` prefixed in Prometheus)."""

from __future__ import annotations

from ray.serve import metrics

_LATENCY_BOUNDARIES = [0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0]


class VerifierMetrics:
    """Counters follow the engine's SpecDecodeStats (incremented by deltas), like vLLM's names."""

    def __init__(self, model_name: str):
        tags = {"model_name": model_name}
        keys = ("model_name",)

        def counter(name, desc, extra=()):
            c = metrics.Counter(name, description=desc, tag_keys=keys + extra)
            c.set_default_tags(dict(tags))
            return c

        self.num_drafts = counter("spec_decode_num_drafts", "Verification steps that carried draft tokens.")
        self.num_draft_tokens = counter("spec_decode_num_draft_tokens", "Draft tokens proposed.")
        self.num_accepted_tokens = counter("spec_decode_num_accepted_tokens", "Draft tokens accepted.")
        self.accepted_per_pos = counter("spec_decode_num_accepted_tokens_per_pos",
                                        "Draft tokens accepted at each draft position.", ("position",))
        self.ttft = metrics.Histogram("time_to_first_token_seconds", description="Time to first token.",
                                      boundaries=_LATENCY_BOUNDARIES, tag_keys=keys)
        self.ttft.set_default_tags(dict(tags))
        self.tpot = metrics.Histogram("time_per_output_token_seconds", description="Time per output token "
                                      "after the first.", boundaries=_LATENCY_BOUNDARIES, tag_keys=keys)
        self.tpot.set_default_tags(dict(tags))
        self.running = metrics.Gauge("num_requests_running", description="Sequences holding KV slots.",
                                     tag_keys=keys)
        self.running.set_default_tags(dict(tags))
        self.waiting = metrics.Gauge("num_requests_waiting", description="Requests waiting for a KV slot.",
                                     tag_keys=keys)
        self.waiting.set_default_tags(dict(tags))
        self._last = {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0}
        self._last_pos: list[int] = []

    def observe_ttft(self, seconds: float) -> None:
        self.ttft.observe(seconds)

    def observe_tpot(self, seconds: float) -> None:
        self.tpot.observe(seconds)

    def update(self, snap: dict) -> None:
        for key, counter in (("num_drafts", self.num_drafts), ("num_draft_tokens", self.num_draft_tokens),
                             ("num_accepted_tokens", self.num_accepted_tokens)):
            if snap[key] < self._last[key]:  # the engine's stats were reset
                self._last[key] = 0
            delta = snap[key] - self._last[key]
            if delta > 0:
                counter.inc(delta)
                self._last[key] = snap[key]
        per_pos = snap["num_accepted_tokens_per_pos"]
        if sum(per_pos) < sum(self._last_pos):
            self._last_pos = []
        for pos, value in enumerate(per_pos):
            prev = self._last_pos[pos] if pos < len(self._last_pos) else 0
            if value > prev:
                self.accepted_per_pos.inc(value - prev, tags={"position": str(pos)})
        self._last_pos = list(per_pos)
        self.running.set(snap["num_running"])
        self.waiting.set(snap["num_waiting"])
