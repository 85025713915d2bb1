"""Which matmul path a model's projections take on this CPU, measured when the model loads.

The CPU changes under us (an AMD EPYC one day, an Intel Xeon with AMX the next), and so does the
fastest way to multiply a few rows by a weight: on the AMD, MKL's few-row matmuls ran far below
memory bandwidth and oneDNN with a prepacked weight was 2-4x faster, with 1-2 rows padded up to 4;
on the Intel, the plain path was the faster one for the same code. No constant fits both, so
`choose` times the candidates on one of the model's own MLPs, interleaved and repeated, for the
row counts the engine runs (decode, small batches, verification, a slice of prefill), and keeps
the fastest in total. `RAYSPEC_CPU_KERNELS` names one instead (`plain`, `onednn`,
`onednn_pad4`), e.g. for runs that must compute the same bits on every load.
"""

from __future__ import annotations

import logging
import os
import statistics
import time
from dataclasses import dataclass, field

import torch

logger = logging.getLogger(__name__)

# name -> (prepacked oneDNN weights, rows padded up to at least this many)
VARIANTS: dict[str, tuple[bool, int]] = {"plain": (False, 1), "onednn": (True, 1), "onednn_pad4": (True, 4)}
ROWS = (1, 2, 4, 9, 32)  # decode of 1-4 sequences, a verification of k+1 = 9, a chunk's slice
ENV = "RAYSPEC_CPU_KERNELS"
MEASURE_BUDGET_S = 1.0  # at most about this long per model load


@dataclass(frozen=True)
class CpuKernels:
    variant: str
    source: str  # "measured", "RAYSPEC_CPU_KERNELS", or "no oneDNN"
    median_ms: dict[str, dict[int, float]] = field(default_factory=dict)  # variant -> rows -> ms (measured)

    @property
    def onednn(self) -> bool:
        return VARIANTS[self.variant][0]

    @property
    def min_rows(self) -> int:
        return VARIANTS[self.variant][1]

    def describe(self) -> str:
        if not self.median_ms:
            return f"{self.variant} ({self.source})"
        totals = {v: round(sum(ms.values()), 3) for v, ms in self.median_ms.items()}
        return f"{self.variant} ({self.source}; one MLP over rows {list(ROWS)}, summed medians in ms: {totals})"


def onednn_available() -> bool:
    return hasattr(torch.ops, "mkldnn") and hasattr(torch.ops.mkldnn, "_reorder_linear_weight") \
        and torch.backends.mkldnn.is_available()


def pick(scores: dict[str, dict[int, float]]) -> str:
    """The variant with the least summed time over the row counts (each counted once: a decode step
    of one sequence matters as much as a verification of nine rows)."""
    return min(scores, key=lambda v: (sum(scores[v].values()), v))


def choose(mlp_factory, hidden_size: int, dtype: torch.dtype, timer=time.perf_counter) -> CpuKernels:
    """mlp_factory(variant) -> a callable MLP set up for that variant (rayspec.model builds it from
    the model's first layer, sharing its weights). Returns the choice; see the module docstring."""
    forced = os.environ.get(ENV, "measure").strip()
    if forced != "measure":
        if forced not in VARIANTS:
            raise ValueError(f"{ENV}={forced!r}: use one of {sorted(VARIANTS)} or 'measure'")
        if VARIANTS[forced][0] and not onednn_available():
            return CpuKernels("plain", "no oneDNN")
        return CpuKernels(forced, ENV)
    if not onednn_available():
        return CpuKernels("plain", "no oneDNN")
    mlps = {v: mlp_factory(v) for v in VARIANTS}
    inputs = {n: torch.randn(n, hidden_size).to(dtype) for n in ROWS}
    with torch.inference_mode():
        for mlp in mlps.values():  # warm up (first calls allocate, pick kernels)
            for x in inputs.values():
                mlp(x)
        started = timer()
        for x in inputs.values():
            mlps["plain"](x)
        once = max(timer() - started, 1e-6)  # one pass of one variant
        rounds = max(3, min(9, int(MEASURE_BUDGET_S / (once * len(VARIANTS)))))
        samples: dict[str, dict[int, list[float]]] = {v: {n: [] for n in ROWS} for v in VARIANTS}
        for _ in range(rounds):  # interleaved: a slow moment of the machine hits every variant alike
            for n, x in inputs.items():
                for v, mlp in mlps.items():
                    t0 = timer()
                    mlp(x)
                    samples[v][n].append((timer() - t0) * 1e3)
    medians = {v: {n: statistics.median(s) for n, s in per.items()} for v, per in samples.items()}
    return CpuKernels(pick(medians), "measured", medians)
