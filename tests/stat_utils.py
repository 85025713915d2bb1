"""Goodness-of-fit helpers for the sampled-losslessness tests (not a test module; no scipy needed).

- `chi2_sf` / `chi2_isf`: the chi-square survival function and its inverse, from the regularized
  upper incomplete gamma function Q(a, x) (series below a + 1, continued fraction above);
- `ncx2_sf`: the noncentral chi-square survival function (a Poisson mixture of central ones),
  which gives the power of Pearson's test against a given alternative;
- `Bins` / `chi_square_test` / `power`: Pearson's chi-square test of observed categorical counts
  against an exact distribution, categories with expected count < 5 pooled into one bin.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass
from typing import Hashable, Mapping


def gammaincc(a: float, x: float) -> float:
    """Q(a, x) = Gamma(a, x) / Gamma(a), the regularized upper incomplete gamma function (a > 0)."""
    if x <= 0:
        return 1.0
    log_prefactor = a * math.log(x) - x - math.lgamma(a)  # log(x^a e^-x / Gamma(a))
    if x < a + 1:
        # P(a, x) = x^a e^-x / Gamma(a + 1) * sum_n x^n / ((a + 1) ... (a + n))
        term = total = 1.0 / a
        n = 0
        while abs(term) > abs(total) * 1e-16:
            n += 1
            term *= x / (a + n)
            total += term
            if n > 10_000:
                raise ArithmeticError("gammaincc series did not converge")
        return max(0.0, 1.0 - math.exp(log_prefactor) * total)
    # Q(a, x) = x^a e^-x / Gamma(a) * 1 / (x + 1 - a - 1 (1 - a) / (x + 3 - a - 2 (2 - a) / (x + 5 - a - ...)))
    # evaluated with the modified Lentz method
    tiny = 1e-300
    b = x + 1 - a
    c = 1 / tiny
    d = 1 / b
    h = d
    for i in range(1, 10_000):
        an = -i * (i - a)
        b += 2
        d = an * d + b
        d = tiny if abs(d) < tiny else d
        c = b + an / c
        c = tiny if abs(c) < tiny else c
        d = 1 / d
        delta = d * c
        h *= delta
        if abs(delta - 1) < 1e-15:
            return math.exp(log_prefactor) * h
    raise ArithmeticError("gammaincc continued fraction did not converge")


def chi2_sf(x: float, df: float) -> float:
    """P(X > x) for X ~ chi-square with df degrees of freedom."""
    return gammaincc(df / 2, x / 2)


def chi2_isf(alpha: float, df: float) -> float:
    """The critical value c with P(X > c) = alpha (bisection on the monotone chi2_sf)."""
    lo, hi = 0.0, df + 10 * math.sqrt(2 * df) + 100
    while chi2_sf(hi, df) > alpha:
        hi *= 2
    for _ in range(200):
        mid = (lo + hi) / 2
        if chi2_sf(mid, df) > alpha:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def ncx2_sf(x: float, df: float, noncentrality: float) -> float:
    """P(X > x) for X ~ noncentral chi-square(df, noncentrality): a Poisson(noncentrality / 2)
    mixture of central chi-squares with df + 2j degrees of freedom."""
    half = noncentrality / 2
    if half == 0:
        return chi2_sf(x, df)
    last = int(half + 12 * math.sqrt(half) + 30)  # the Poisson weights beyond are < 1e-20
    total = 0.0
    for j in range(last + 1):
        weight = math.exp(-half + j * math.log(half) - math.lgamma(j + 1))
        total += weight * chi2_sf(x, df + 2 * j)
    return min(1.0, total)


@dataclass
class Bins:
    """Categories -> bins for a chi-square test at sample size n: every category with expected
    count n p >= min_expected keeps its own bin; the rest share one pooled bin (merged into the
    smallest kept bin when the pooled bin's own expected count is < min_expected). Categories
    outside `probs` (probability 0) are impossible and belong to no bin."""

    probs: Mapping[Hashable, float]
    n: int
    min_expected: float = 5.0

    def __post_init__(self):
        order = sorted(self.probs, key=lambda c: -self.probs[c])
        kept = [c for c in order if self.n * self.probs[c] >= self.min_expected]
        rare = [c for c in order if self.n * self.probs[c] < self.min_expected]
        self.bin_of = {c: i for i, c in enumerate(kept)}
        pooled = len(kept)
        if rare and kept and self.n * sum(self.probs[c] for c in rare) < self.min_expected:
            pooled = len(kept) - 1  # too little for a bin of its own
        for c in rare:
            self.bin_of[c] = pooled
        self.num_bins = max(self.bin_of.values()) + 1 if self.bin_of else 0
        self.expected_probs = [0.0] * self.num_bins
        for c, b in self.bin_of.items():
            self.expected_probs[b] += self.probs[c]

    def bin_probs(self, dist: Mapping[Hashable, float]) -> list[float]:
        """Another distribution over the same categories, binned the same way (its mass outside
        this support is left out)."""
        out = [0.0] * self.num_bins
        for c, w in dist.items():
            if c in self.bin_of:
                out[self.bin_of[c]] += w
        return out


@dataclass
class GofResult:
    statistic: float
    df: int
    p_value: float
    impossible: int  # samples in categories of probability 0
    num_bins: int

    def __str__(self) -> str:
        return (f"chi2 = {self.statistic:.1f} on {self.df} df, p = {self.p_value:.3g}, "
                f"{self.impossible} impossible samples")


def chi_square_test(samples: list[Hashable], probs: Mapping[Hashable, float]) -> GofResult:
    """Pearson's chi-square test of the samples against the exact distribution `probs`."""
    n = len(samples)
    bins = Bins(probs, n)
    observed = [0] * bins.num_bins
    impossible = 0
    for c, count in Counter(samples).items():
        if c in bins.bin_of:
            observed[bins.bin_of[c]] += count
        else:
            impossible += count
    statistic = sum((o - n * e) ** 2 / (n * e) for o, e in zip(observed, bins.expected_probs))
    df = bins.num_bins - 1
    assert df >= 1, "a chi-square test needs at least two bins"
    return GofResult(statistic, df, chi2_sf(statistic, df), impossible, bins.num_bins)


def noncentrality(null: Mapping[Hashable, float], alternative: Mapping[Hashable, float], n: int) -> float:
    """n * sum_bins (q_b - p_b)^2 / p_b: what Pearson's statistic on n samples from `alternative`
    is distributed around (minus the df), binned as the test bins `null` at that n."""
    bins = Bins(null, n)
    return n * sum((q - p) ** 2 / p for p, q in zip(bins.expected_probs, bins.bin_probs(alternative)))


def power(null: Mapping[Hashable, float], alternative: Mapping[Hashable, float], n: int, alpha: float) -> float:
    """P(the level-alpha test rejects `null`) with n samples from `alternative` (the noncentral
    chi-square approximation of Pearson's statistic under a fixed alternative)."""
    df = Bins(null, n).num_bins - 1
    return ncx2_sf(chi2_isf(alpha, df), df, noncentrality(null, alternative, n))


def tv(p: Mapping[Hashable, float], q: Mapping[Hashable, float]) -> float:
    return 0.5 * sum(abs(p.get(c, 0.0) - q.get(c, 0.0)) for c in set(p) | set(q))
