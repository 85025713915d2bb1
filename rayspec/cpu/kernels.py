"""Which matmul kernel a model's projections use on this CPU, per row count, measured at load.

The CPU changes under us (an AMD EPYC one day, an Intel Xeon with AMX the next), and so does the
fastest way to multiply a few rows by a weight. On one AMD VM (session 8) MKL's few-row matmuls
ran far below memory bandwidth and oneDNN with a prepacked weight was 2-4x faster, 1-2 rows padded
up to 4; on the same kind of VM in session 16 MKL's one-row F.linear was the fastest and oneDNN
(padded) won from 4 rows; on an Intel Xeon the plain path ran the same code at half the speed
relative to HF. No constant fits them all, so `choose` times the candidates on one of the model's
own MLPs, interleaved and repeated, at the row counts the engine runs (decode of 1, 2 and 4
sequences, a verification of k+1 = 9, a slice of prefill), and keeps the fastest for each;
`Linear` then dispatches on its input's row count (`path_for`). `RAYSPEC_CPU_KERNELS` names one
kernel for every row count instead (`flinear`, `wxt`, `onednn`, `onednn_pad4`), e.g. for runs that
must compute the same bits on every load.

A measurement taken while other processes keep this process's cores busy picks wrongly: their
threads preempt a multi-threaded kernel's (a fork-join waits for the slowest), so a one-thread
kernel wins there that runs half as fast once the cores are free (two replicas loading at once on
2 cores: one chose F.linear for single rows, and decoded at 25 tok/s where oneDNN gave 47). So
`choose` also measures how busy the cores were (`busy`: other processes' share of the CPUs this
process may run on, from /proc/stat); past BUSY_SHARE the choice is provisional (`contended`) and
`CausalLM.remeasure_cpu_kernels` measures again, as a serving loop does once it is idle
(deployments.replicas.engine_loop).

One machine, one choice: a quiet measurement is kept in a file (RAYSPEC_CPU_KERNELS_CACHE, default
~/.cache/rayspec/cpu_kernels.json), keyed by the CPU model, torch's version, the MLP's shape and
dtype, and the threads and CPUs the process has; a later load of the same key within CACHE_TTL_S
takes it instead of measuring (`KernelCache`). Replicas measured apart disagreed between variants
whose microbenchmark medians differed by 5-10% run to run, and served side by side one decoded
15% slower than the other (the target alone at 34.3 tok/s, a draft-model replica with the same
target and W @ x^T for one row at 29.0, drafting nothing; with one choice 37.2 and 38.0); a
measurement made once also spares every later load its second and a half. The first quiet
measurement of a key is kept; one finishing later adopts it.

Batch-invariant projections (EngineConfig.batch_invariant, `choose_invariant`): a row's output must
not depend on how many rows are computed with it, so one kernel serves every row count, and it must
be one whose per-row reduction order does not change with the row count. Which is, depends on the
kernel library and the CPU (on one AMD EPYC with AVX-512 BF16, oneDNN 3.12: F.linear changed a row's
bits from 2 rows on in float32 and from 8 in bfloat16, oneDNN unpadded from 2 (float32) and 10
(bfloat16) on a 1536-wide input, oneDNN padded to 4 rows at no count from 1 to 256), so each load
checks the candidates on the model's own MLP (`rows_invariant`) and keeps the first that passes; if
none does, rows run in calls of exactly TILE_ROWS (every call the same shape, so the same kernel).
"""

from __future__ import annotations

import json
import logging
import os
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

# the candidates: F.linear (MKL's x @ W^T), W @ x^T (a single row doubled), oneDNN with a prepacked
# weight, and oneDNN with fewer than 4 rows padded to 4
VARIANTS = ("flinear", "wxt", "onednn", "onednn_pad4")
ONEDNN = {"onednn": 1, "onednn_pad4": 4}  # oneDNN variants -> rows padded up to at least this many
ROWS = (1, 2, 4, 9, 32)  # each stands for the row counts up to it (past 32: the 32 choice)
ENV = "RAYSPEC_CPU_KERNELS"
MEASURE_BUDGET_S = 1.5  # at most about this long per model load
BUSY_SHARE = 0.25  # other processes' share of our CPUs during a measurement past which it is provisional
# variants within this fraction of the fastest at a row count count as tied: the first in VARIANTS
# is taken (replicas of one machine measured onednn and wxt ~4% apart in either order, and served
# A/Bs between them then compared two kernels; F.linear and W @ x^T also keep no prepacked copy)
TIE = 0.05
CACHE_ENV = "RAYSPEC_CPU_KERNELS_CACHE"  # the file of this machine's choices; "off": measure every load
CACHE_TTL_S = 24 * 3600.0  # a kept choice older than this is measured again (the VM under us may change)
# batch-invariant projections: the candidates in order of preference (onednn_pad4: the fastest for
# 1-9 rows on the AMD EPYC measured, and row-count invariant there), the row counts each is checked at,
# and the fixed call size of the fallback
INVARIANT_VARIANTS = ("onednn_pad4", "flinear", "wxt", "onednn")
INVARIANT_ROWS = (1, 2, 3, 4, 5, 6, 8, 9, 16, 17, 32, 33, 64)
TILE_ROWS = 4


@dataclass(frozen=True)
class CpuKernels:
    per_rows: dict[int, str]  # a ROWS bucket -> the variant used for row counts up to it
    source: str  # "measured", "RAYSPEC_CPU_KERNELS", "no oneDNN", or "default"
    median_ms: dict[str, dict[int, float]] = field(default_factory=dict)  # variant -> rows -> ms (measured)
    busy: float | None = None  # other processes' share of our CPUs while measuring (None: not known)
    kept_at: float | None = None  # taken from KernelCache: when that measurement was made (time.time())
    # batch-invariant fallback: rows go through in calls of exactly this many (the last padded); None: one call
    tile: int | None = None

    @property
    def contended(self) -> bool:
        """Measured on cores other processes kept busy: a provisional choice (module docstring)."""
        return self.busy is not None and self.busy > BUSY_SHARE

    @classmethod
    def single(cls, variant: str, source: str) -> "CpuKernels":
        return cls({n: variant for n in ROWS}, source)

    def path_for(self, rows: int) -> str:
        for bucket in ROWS:
            if rows <= bucket:
                return self.per_rows[bucket]
        return self.per_rows[ROWS[-1]]

    @property
    def onednn(self) -> bool:
        """Whether any row count uses oneDNN (then every projection keeps a prepacked copy)."""
        return any(v in ONEDNN for v in self.per_rows.values())

    @property
    def variant(self) -> str:
        """One name for the choice: the variant, or 'mixed:' and the per-row-count table."""
        names = set(self.per_rows.values())
        if len(names) == 1:
            return names.pop()
        return "mixed:" + ",".join(f"{n}={v}" for n, v in self.per_rows.items())

    def describe(self) -> str:
        if not self.median_ms:
            return f"{self.variant} ({self.source})"
        table = {v: [round(ms[n], 3) for n in ROWS] for v, ms in self.median_ms.items()}
        busy = "" if self.busy is None else f"; other processes {self.busy:.0%} of the CPUs" + \
            (", provisional" if self.contended else "")
        kept = "" if self.kept_at is None else \
            f", kept from a load {max(0.0, time.time() - self.kept_at):.0f} s ago ({CACHE_ENV})"
        return f"{self.variant} ({self.source}{kept}{busy}; one MLP, medians in ms at rows {list(ROWS)}: {table})"

    def to_json(self) -> dict:
        return {"per_rows": {str(n): v for n, v in self.per_rows.items()}, "busy": self.busy,
                "median_ms": {v: {str(n): ms for n, ms in per.items()} for v, per in self.median_ms.items()}}

    @classmethod
    def from_json(cls, data: dict, kept_at: float) -> "CpuKernels":
        per_rows = {int(n): v for n, v in data["per_rows"].items()}
        if set(per_rows) != set(ROWS) or not set(per_rows.values()) <= set(VARIANTS):
            raise ValueError(f"not a choice over rows {ROWS}: {data['per_rows']}")
        per_rows = {n: per_rows[n] for n in ROWS}
        medians = {v: {int(n): float(ms) for n, ms in per.items()} for v, per in data.get("median_ms", {}).items()}
        return cls(per_rows, "measured", medians, data.get("busy"), kept_at)


def machine_key(what: str) -> str:
    """A cache key: `what` (the MLP's shape and dtype) on this CPU model, torch version, thread count
    and CPU set."""
    model = "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), model)
    except OSError:
        pass
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    return f"{model} | torch {torch.__version__} | {what} | {torch.get_num_threads()} threads on {cpus} CPUs"


class KernelCache:
    """This machine's quiet choices, one JSON file (see the module docstring): `get` a fresh one,
    `keep` a new one unless another process kept one first (then that one is returned, to adopt).
    Read-modify-write under an exclusive lock (fcntl); an unreadable file counts as empty."""

    def __init__(self, path: str | os.PathLike | None = None, ttl_s: float = CACHE_TTL_S, clock=time.time):
        if path is None:
            path = os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "rayspec" / "cpu_kernels.json"
        self.path, self.ttl_s, self.clock = Path(path), ttl_s, clock

    @classmethod
    def from_env(cls) -> "KernelCache | None":
        """The machine's cache, or None where RAYSPEC_CPU_KERNELS_CACHE is "off"."""
        return None if os.environ.get(CACHE_ENV, "").strip().lower() in ("off", "0", "none") else cls()

    def _read(self) -> dict:
        try:
            data = json.loads(self.path.read_text())
        except (OSError, ValueError):
            return {}
        return data if isinstance(data, dict) else {}

    def _fresh(self, entry) -> CpuKernels | None:
        try:
            kept_at = float(entry["kept_at"])
            if not 0 <= self.clock() - kept_at <= self.ttl_s:
                return None
            return CpuKernels.from_json(entry, kept_at)
        except (KeyError, TypeError, ValueError):
            return None

    def get(self, key: str) -> CpuKernels | None:
        return self._fresh(self._read().get(key))

    def keep(self, key: str, kernels: CpuKernels) -> CpuKernels:
        """Keep `kernels` (a quiet measurement) for `key`; returns what `key` holds afterwards: a fresh
        choice another process kept first, else `kernels`."""
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.path.with_suffix(".lock"), "a") as lock:
                _lock(lock)
                data = self._read()
                first = self._fresh(data.get(key))
                if first is not None:
                    return first
                data[key] = {**kernels.to_json(), "kept_at": self.clock()}
                data = {k: e for k, e in data.items() if self._fresh(e) is not None}  # drop stale keys
                tmp = self.path.with_suffix(f".{os.getpid()}.tmp")
                tmp.write_text(json.dumps(data, indent=1, sort_keys=True))
                os.replace(tmp, self.path)
        except OSError as e:  # a read-only home: every load measures
            logger.info("CPU kernel choice not kept in %s: %s", self.path, e)
        return kernels


def _lock(f) -> None:
    try:
        import fcntl
    except ImportError:  # not POSIX: unlocked (a race keeps the last writer's choice)
        return
    fcntl.flock(f.fileno(), fcntl.LOCK_EX)


class BusyMeter:
    """Other processes' share of the CPUs this process may run on, between start() and share():
    their busy time (from /proc/stat, those CPUs' lines) less this process's own CPU time, over
    wall time x CPUs. None where /proc/stat is not there (not Linux)."""

    def __init__(self):
        try:
            self.cpus = sorted(os.sched_getaffinity(0))
        except (AttributeError, OSError):
            self.cpus = list(range(os.cpu_count() or 1))
        self.hz = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
        self._start = None

    def _busy_s(self) -> float | None:
        try:
            with open("/proc/stat") as f:
                lines = f.read().splitlines()
        except OSError:
            return None
        wanted, total = {f"cpu{i}" for i in self.cpus}, 0
        for line in lines:
            parts = line.split()
            if parts and parts[0] in wanted:  # user nice system idle iowait irq softirq steal ...
                values = [int(v) for v in parts[1:9]]
                total += sum(values) - values[3] - values[4]
        return total / self.hz

    def start(self) -> None:
        self._start = (self._busy_s(), time.process_time(), time.perf_counter())

    def share(self) -> float | None:
        busy, own, wall = self._busy_s(), time.process_time(), time.perf_counter()
        if busy is None or self._start is None or self._start[0] is None:
            return None
        others = (busy - self._start[0]) - (own - self._start[1])
        return max(0.0, min(1.0, others / max((wall - self._start[2]) * len(self.cpus), 1e-9)))


def onednn_available() -> bool:
    return hasattr(torch.ops, "mkldnn") and hasattr(torch.ops.mkldnn, "_reorder_linear_weight") \
        and torch.backends.mkldnn.is_available()


def pick(medians: dict[str, dict[int, float]], tie: float = TIE) -> dict[int, str]:
    """The fastest variant at each row count; of those within `tie` (a fraction) of the fastest,
    the first in VARIANTS (near-equal kernels: the same choice whichever won this measurement)."""
    chosen = {}
    for n in ROWS:
        fastest = min(ms[n] for ms in medians.values())
        chosen[n] = min((v for v, ms in medians.items() if ms[n] <= fastest * (1 + tie)), key=VARIANTS.index)
    return chosen


def choose(mlp_factory, hidden_size: int, dtype: torch.dtype, timer=time.perf_counter,
           variants: tuple[str, ...] = VARIANTS, cache: KernelCache | None = None,
           cache_key: str | None = None) -> CpuKernels:
    """mlp_factory(variant) -> a callable MLP that uses that variant for every row count (rayspec.model.native
    builds it from the model's first layer, sharing its weights); `variants`: the candidates.
    `cache`, `cache_key`: this machine's kept choice for the key is taken if fresh and among
    `variants`; a quiet measurement is kept there (the first kept wins). See the module docstring."""
    forced = os.environ.get(ENV, "measure").strip()
    if forced != "measure":
        if forced not in VARIANTS:
            raise ValueError(f"{ENV}={forced!r}: use one of {list(VARIANTS)} or 'measure'")
        if forced in ONEDNN and not onednn_available():
            return CpuKernels.single("flinear", "no oneDNN")
        return CpuKernels.single(forced, ENV)
    candidates = [v for v in variants if v not in ONEDNN or onednn_available()]
    use_cache = cache is not None and cache_key is not None

    def usable(kept: CpuKernels | None) -> bool:  # a kept choice among this load's candidates
        return kept is not None and set(kept.per_rows.values()) <= set(candidates)

    if use_cache and usable(kept := cache.get(cache_key)):
        return kept
    mlps = {v: mlp_factory(v) for v in candidates}
    inputs = {n: torch.randn(n, hidden_size).to(dtype) for n in ROWS}
    meter = BusyMeter()
    with torch.inference_mode():
        for mlp in mlps.values():  # warm up (first calls allocate, pick kernels)
            for x in inputs.values():
                mlp(x)
        started = timer()
        for x in inputs.values():
            mlps[candidates[0]](x)
        once = max(timer() - started, 1e-6)  # one pass of one variant
        rounds = max(3, min(15, int(MEASURE_BUDGET_S / (once * len(candidates)))))
        samples: dict[str, dict[int, list[float]]] = {v: {n: [] for n in ROWS} for v in candidates}
        meter.start()
        for _ in range(rounds):  # interleaved: a slow moment of the machine hits every variant alike
            for n, x in inputs.items():
                for v, mlp in mlps.items():
                    t0 = timer()
                    mlp(x)
                    samples[v][n].append((timer() - t0) * 1e3)
        busy = meter.share()
    medians = {v: {n: statistics.median(s) for n, s in per.items()} for v, per in samples.items()}
    chosen = CpuKernels(pick(medians), "measured", medians, busy)
    if use_cache and not chosen.contended:
        kept = cache.keep(cache_key, chosen)
        if kept is not chosen and usable(kept):
            return kept  # another load of this machine kept its choice first: the same for both
    return chosen


# ---- batch-invariant projections ----------------------------------------------------------------

def rows_invariant(fn, in_features: int, dtype: torch.dtype, rows: tuple[int, ...] = INVARIANT_ROWS) -> bool:
    """Whether fn ([M, in_features] -> [M, out]) computes every row with the same bits at each of
    `rows` row counts as it does for that row alone."""
    x = torch.randn(max(rows), in_features, generator=torch.Generator().manual_seed(0)).to(dtype)
    with torch.inference_mode():
        alone = torch.cat([fn(x[i: i + 1]) for i in range(max(rows))])
        return all(torch.equal(fn(x[:m]), alone[:m]) for m in rows)


def choose_invariant(mlp_factory, hidden_size: int, dtype: torch.dtype,
                     variants: tuple[str, ...] = INVARIANT_VARIANTS) -> CpuKernels:
    """One kernel for every row count whose rows do not depend on the row count, checked on this CPU:
    mlp_factory(kernels) -> a callable MLP running every projection on `kernels` (a CpuKernels).
    The first of `variants` (those this torch has) that passes rows_invariant, else the first in
    calls of TILE_ROWS rows (checked too: if even that fails, it is used and a warning says so)."""
    candidates = [v for v in variants if v not in ONEDNN or onednn_available()] or ["flinear"]
    for variant in candidates:
        kernels = CpuKernels.single(variant, "batch-invariant")
        if rows_invariant(mlp_factory(kernels), hidden_size, dtype):
            return kernels
    tiled = CpuKernels({n: candidates[0] for n in ROWS}, f"batch-invariant, in calls of {TILE_ROWS} rows",
                       tile=TILE_ROWS)
    if not rows_invariant(mlp_factory(tiled), hidden_size, dtype):
        logger.warning("no CPU matmul kernel here computes a row alike at every row count, not even in calls of "
                       "%d rows: batch_invariant does not hold on this CPU", TILE_ROWS)
    return tiled
