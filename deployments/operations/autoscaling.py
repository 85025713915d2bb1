"""The proposer pool's own autoscaling signal: how busy its replicas are drafting.

Serve's default policy scales on ongoing requests, which fits the verifier (each request is a call
in flight there). It does not fit the proposer: a verifier replica has at most one propose call in
flight whatever its load, and with the direct channel (deployments.transport.direct_channel) the per-step
calls do not pass through Serve at all. So each proposer replica measures the fraction of wall time
it spent drafting over the last `window_s` (`BusyMeter`), reports it as a custom autoscaling metric
(`Proposer.record_autoscaling_stats`), and `ProposerBusyPolicy` asks for as many replicas as keep
that fraction near `target_busy`:

    desired = sum over running replicas of busy / target_busy

A replica drafting 90% of the time against a target of 0.6 asks for 1.5 -> 2 replicas; two at 20%
each ask for 0.67 -> 1. Serve applies min/max_replicas, upscale/downscale delays and scaling
factors around it as for its own policy. Verifiers spread over the new replicas when they re-pin
(`proposer_repin_interval_s`, deployments.transport.remote_proposer).

The verifier's pool keeps Serve's request-based policy. So each pool grows on its own bottleneck:
a slow draft (a large draft model, deep EAGLE trees) grows the proposers and not the verifiers;
many requests with a cheap draft (n-gram) grow the verifiers and leave the proposers idle.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from typing import Any

BUSY_METRIC = "rayspec_proposer_busy"
DEFAULT_TARGET_BUSY = 0.6
POLICY_PATH = "deployments.operations.autoscaling:ProposerBusyPolicy"


class BusyMeter:
    """Fraction of the last `window_s` seconds spent inside `with meter:` blocks (one thread at a
    time inside; the proposer's lock serializes drafting anyway). A meter younger than its window
    divides by its age, so a replica that starts saturated reports it at once."""

    def __init__(self, window_s: float = 10.0, clock=time.monotonic):
        self.window_s = window_s
        self._clock = clock
        self._born = clock()
        self._spans: deque[tuple[float, float]] = deque()  # finished (start, end), oldest first
        self._open: float | None = None  # start of the span in progress
        self._lock = threading.Lock()

    def __enter__(self):
        with self._lock:
            self._open = self._clock()
        return self

    def __exit__(self, *exc) -> None:
        with self._lock:
            now = self._clock()
            self._spans.append((self._open, now))
            self._open = None
            self._trim(now)

    def _trim(self, now: float) -> None:
        while self._spans and self._spans[0][1] <= now - self.window_s:
            self._spans.popleft()

    def fraction(self) -> float:
        with self._lock:
            now = self._clock()
            self._trim(now)
            since = max(now - self.window_s, self._born)
            if now <= since:
                return 0.0
            spans = list(self._spans) + ([(self._open, now)] if self._open is not None else [])
            busy = sum(max(0.0, end - max(start, since)) for start, end in spans)
            return min(1.0, busy / (now - since))


class ProposerBusyPolicy:
    """Serve custom autoscaling policy (`autoscaling_config.policy.policy_function`) over the
    proposer replicas' BUSY_METRIC. Returns a fractional replica count; Serve rounds it and applies
    the config's bounds and delays."""

    def __init__(self, target_busy: float = DEFAULT_TARGET_BUSY):
        if not 0 < target_busy <= 1:
            raise ValueError(f"target_busy must be in (0, 1], got {target_busy}")
        self.target_busy = target_busy

    def __call__(self, ctx) -> tuple[float, dict[str, Any]]:
        if ctx.current_num_replicas == 0:
            return ctx.target_num_replicas, {}
        per_replica = (ctx.aggregated_metrics or {}).get(BUSY_METRIC) or {}
        running = set(ctx.running_replicas)
        values = [v for replica, v in per_replica.items() if replica in running] or list(per_replica.values())
        if not values:  # no report yet (replicas just started): hold
            return ctx.target_num_replicas, {}
        # replicas that have not reported yet count as idle
        return sum(values) / self.target_busy, {}


def proposer_autoscaling_config(config: dict[str, Any]) -> dict[str, Any]:
    """A proposer deployment's `autoscaling_config` as Serve takes it: ours may say `target_busy`
    (default DEFAULT_TARGET_BUSY) and leaves `policy` to ProposerBusyPolicy unless it names one."""
    out = dict(config)
    target = out.pop("target_busy", None)
    if "policy" not in out:
        out["policy"] = {"policy_function": POLICY_PATH,
                         "policy_kwargs": {"target_busy": DEFAULT_TARGET_BUSY if target is None else float(target)}}
    elif target is not None:
        raise ValueError("autoscaling_config: target_busy applies to rayspec's proposer policy; "
                         "it cannot be combined with a policy of your own")
    return out
