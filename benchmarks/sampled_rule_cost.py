"""What the rejection rule of a batch of sampled (unseeded) sequences costs (rayspec.sampling.rejection.SampledBatch:
built, read, finished), on rows of the real model's width (49,152), T = 1, one torch thread: drafts on the host,
and the same drafts still on the device (DeferredRow: the layout a CUDA engine verifies with one read). Optionally
against another version of rejection.py (--baseline FILE, e.g. `git show REV:rayspec/sampling/rejection.py`), host
drafts only, the versions alternating.

    python benchmarks/sampled_rule_cost.py --json benchmarks/results/sampled_rule_cost_<commit>.json \\
        [--baseline /tmp/rejection_old.py]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rayspec.bench.environment import cpu_model  # noqa: E402
from rayspec.proposers.base import Draft  # noqa: E402
from rayspec.proposers.deferred import DeferredRow, ancestry  # noqa: E402
from rayspec.sampling import rejection  # noqa: E402

VOCAB = 49152
TREE = [-1, -1, 0, 0, 1, 2, 2, 4]  # 8 nodes, 3 levels below the root (configs/default.yaml's size)
CELLS = [("tree", 1), ("tree", 8), ("chain", 8), ("chain", 32)]


def case(kind: str, batch: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    parents = TREE if kind == "tree" else list(range(-1, len(TREE) - 1))
    n = len(parents)
    drafts = [Draft(torch.randint(0, VOCAB, (n,), generator=gen).tolist(), parents=parents) for _ in range(batch)]
    logits = torch.randn(batch * (n + 1), VOCAB, generator=gen) * 3
    return logits, drafts


def deferred(drafts: list) -> list:
    out = []
    for d in drafts:
        n, parents = len(d.tokens), torch.tensor(d.parents)
        chain = d.parents == list(range(-1, n - 1))
        row = DeferredRow(None, 0, n, torch.tensor(d.tokens))
        if not chain:
            row.parents, row.live, row.sees = parents, torch.ones(n, dtype=torch.bool), ancestry(parents[None], n)[0]
        out.append(Draft([], deferred=row))
    return out


def time_rule(module, logits, drafts, make, repeats: int) -> float:
    """Median ms of one rule: built, its tensors read, finished."""
    settings = [(1.0, 0, 1.0)] * logits.shape[0]
    times = []
    for r in range(repeats):
        ds = make(drafts)
        gens = [torch.Generator().manual_seed(r * 100 + i) for i in range(len(ds))]
        started = time.perf_counter()
        batch = module.SampledBatch(logits, None, settings, ds, [None] * len(ds), gens)
        arrays = [t.numpy() for t in batch.tensors]
        for d, host in zip(ds, drafts):  # (what the engine's one read does to deferred drafts)
            if d.deferred is not None:
                d.tokens, d.parents, d.deferred = host.tokens, host.parents, None
        batch.finish(arrays)
        times.append(time.perf_counter() - started)
    return 1e3 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--baseline", help="another rejection.py to time beside this one (host drafts)")
    parser.add_argument("--json")
    parser.add_argument("--dry-run", action="store_true", help="2 repeats (CI)")
    a = parser.parse_args()
    torch.set_num_threads(1)
    repeats = 2 if a.dry_run else a.repeats
    base = None
    if a.baseline:
        spec = importlib.util.spec_from_file_location("rejection_baseline", a.baseline)
        base = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(base)
    rows = []
    for kind, batch in CELLS:
        logits, drafts = case(kind, batch)
        row = {"draft": kind, "batch": batch, "nodes": len(TREE)}
        for _ in range(2):  # alternating rounds: the VM's drift falls on all alike
            for name, module, make in [("host_ms", rejection, list), ("deferred_ms", rejection, deferred)] + (
                    [("baseline_host_ms", base, list)] if base is not None else []):
                row.setdefault(name, []).append(round(time_rule(module, logits, drafts, make, repeats), 3))
        rows.append(row)
        print(json.dumps(row), flush=True)
    out = {"what": "SampledBatch built + read + finished, T = 1, vocabulary 49,152, one thread (ms, median per round)",
           "cpu_model": cpu_model(), "torch": torch.__version__, "baseline": a.baseline, "repeats": repeats,
           "rows": rows}
    if a.json:
        Path(a.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
