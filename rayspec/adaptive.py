"""Adaptive draft length: pick the k that maximises expected tokens per second of step time.

For a sequence whose drafts are accepted with probability a per token, a step with k drafts
emits on average (1 - a^(k+1)) / (1 - a) tokens. The cost of a step with k drafts is
measured (exponential moving average of wall time, per batch-size bucket), so a CPU where
verifying 6 tokens costs much more than 1, or a slow draft model, pushes k down to 0.
Untried lengths are assumed only slightly dearer than measured ones, so they get tried.
"""

from __future__ import annotations

import math


def expected_tokens(acceptance: float, k: int) -> float:
    if acceptance >= 0.999:
        return k + 1.0
    return (1 - acceptance ** (k + 1)) / (1 - acceptance)


class AdaptiveDraftLength:
    def __init__(self, max_k: int, enabled: bool = True, smoothing: float = 0.2,
                 prior_acceptance: float = 0.7, probe_every: int = 16):
        self.max_k = max_k
        self.enabled = enabled
        self.smoothing = smoothing
        self.prior_acceptance = prior_acceptance
        self.probe_every = probe_every
        self._cost: dict[tuple[int, int], float] = {}  # (batch bucket, k) -> seconds per step
        self._steps_without_drafts = 0

    @staticmethod
    def _bucket(batch_size: int) -> int:
        return 1 << max(0, math.ceil(math.log2(batch_size)))

    def _estimated_cost(self, bucket: int, k: int) -> float | None:
        if (bucket, k) in self._cost:
            return self._cost[(bucket, k)]
        known = [(kk, c) for (b, kk), c in self._cost.items() if b == bucket]
        if not known:
            return None
        kk, c = min(known, key=lambda item: abs(item[0] - k))
        return c * (1 + 0.03 * (k - kk))  # optimistic guess, so it gets measured

    def acceptance(self, seq_acceptance: float | None) -> float:
        return self.prior_acceptance if seq_acceptance is None else seq_acceptance

    def choose(self, acceptances: list[float | None]) -> int:
        """acceptances: per running sequence, its smoothed acceptance rate (None: unknown)."""
        if not self.enabled or self.max_k == 0:
            return self.max_k
        bucket = self._bucket(len(acceptances))
        best_k, best_rate = self.max_k, -1.0
        for k in range(self.max_k + 1):
            cost = self._estimated_cost(bucket, k)
            if cost is None:
                return self.max_k
            rate = sum(expected_tokens(self.acceptance(a), k) for a in acceptances) / cost
            if rate > best_rate:
                best_k, best_rate = k, rate
        if best_k == 0:
            self._steps_without_drafts += 1
            if self._steps_without_drafts >= self.probe_every:  # re-check acceptance now and then
                self._steps_without_drafts = 0
                return 1
        return best_k

    def observe_step(self, batch_size: int, num_drafted: int, seconds: float) -> None:
        """num_drafted: the longest draft actually verified in this step."""
        key = (self._bucket(batch_size), num_drafted)
        old = self._cost.get(key)
        self._cost[key] = seconds if old is None else old + self.smoothing * (seconds - old)

    def update_acceptance(self, old: float | None, proposed: int, accepted: int) -> float | None:
        if proposed == 0:
            return old
        rate = accepted / proposed
        base = self.prior_acceptance if old is None else old
        return base + 0.3 * (rate - base)
