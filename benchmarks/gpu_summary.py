"""benchmarks/gpu.sh's last step: merge the runs of each prompt set, plot them, print the table.

  python benchmarks/gpu_summary.py RESULTS_DIR --sets mt_bench,humaneval,gsm8k --baseline rayspec-baseline
      [--expect rayspec-eagle3,rayspec-baseline --concurrency 1,4,16,64]

Reads RESULTS_DIR/runs/<set>_*.json (`rayspec bench serve` outputs: one per server phase, or one
per concurrency level for a peer such as vLLM) and, for a peer, the Prometheus snapshots taken
around each of its levels, runs/<set>_<label>_c<N>_{before,after}.prom. Writes per set
RESULTS_DIR/<set>.json (every system's rows, `rayspec bench serve`'s layout, so its plot and
tools read it) and <set>.png, then summary.json and summary.md: per set and concurrency each
system's output tok/s, mean TTFT and TPOT, draft acceptance and its speedup over the baseline.
Exits 1 when an expected row is missing or completed no request.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))

from rayspec.bench.serve import acceptance_rate, write_plot  # noqa: E402

# vLLM's speculative decoding counters (Prometheus adds _total to a counter's name)
VLLM_COUNTERS = {"num_drafts": "vllm:spec_decode_num_drafts_total",
                 "num_draft_tokens": "vllm:spec_decode_num_draft_tokens_total",
                 "num_accepted_tokens": "vllm:spec_decode_num_accepted_tokens_total"}
RUN_NAME = re.compile(r"^(?P<set>.+?)_(?P<label>[A-Za-z0-9.-]+)(?:_c(?P<conc>\d+))?$")


def read_counters(path: Path) -> dict[str, float]:
    """Prometheus text -> {our counter name: value}, summed over label sets (engines, models)."""
    totals = dict.fromkeys(VLLM_COUNTERS, 0.0)
    names = {v: k for k, v in VLLM_COUNTERS.items()}
    for line in path.read_text().splitlines():
        if line.startswith("#") or not line.strip():
            continue
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in names:
            totals[names[name]] += float(line.rsplit(" ", 1)[-1])
    return totals


def peer_stats(runs: Path, stem: str) -> dict | None:
    """The counter deltas over one peer level, in the layout of our /v1/stats deltas."""
    before, after = runs / f"{stem}_before.prom", runs / f"{stem}_after.prom"
    if not (before.exists() and after.exists()):
        return None
    b, a = read_counters(before), read_counters(after)
    d = {k: int(a[k] - b[k]) for k in VLLM_COUNTERS}
    return {**d, "method": "vLLM /metrics",
            "acceptance_rate": d["num_accepted_tokens"] / d["num_draft_tokens"] if d["num_draft_tokens"] else None,
            "mean_acceptance_length": 1 + d["num_accepted_tokens"] / d["num_drafts"] if d["num_drafts"] else None}


def merge_set(runs: Path, set_name: str) -> dict | None:
    """All runs of one prompt set as one `rayspec bench serve` result (labels in run order)."""
    merged: dict | None = None
    for path in sorted(runs.glob(f"{set_name}_*.json")):
        match = RUN_NAME.match(path.stem)
        if not match or match["set"] != set_name:
            continue
        run = json.loads(path.read_text())
        for row in run["results"]:
            if row.get("server_stats") is None and match["conc"]:
                row["server_stats"] = peer_stats(runs, path.stem)
        if merged is None:
            merged = {"config": dict(run["config"]), "results": []}
            merged["config"]["labels"] = []
            merged["config"]["concurrency"] = []
        cfg = merged["config"]
        cfg["labels"] += [x for x in run["config"]["labels"] if x not in cfg["labels"]]
        cfg["concurrency"] = sorted(set(cfg["concurrency"]) | set(run["config"]["concurrency"]))
        merged["results"] += run["results"]
    if merged is not None:
        merged["config"]["endpoints"] = sorted({r["endpoint"] for r in merged["results"]})
        models = ", ".join(dict.fromkeys(r["model_id"] for r in merged["results"]))
        merged["config"]["model"] = f"{models} ({set_name})"  # the plot's title names the set
        merged["config"]["prompt_set"] = set_name
    return merged


def summary_rows(set_name: str, result: dict, baseline: str) -> list[dict]:
    base = {r["concurrency"]: r["output_throughput"] for r in result["results"] if r["label"] == baseline}
    rows = []
    for r in sorted(result["results"], key=lambda r: (r["concurrency"], result["config"]["labels"].index(r["label"]))):
        stats = r.get("server_stats") or {}
        rows.append({"set": set_name, "concurrency": r["concurrency"], "system": r["label"],
                     "completed": r["completed"], "failed": r["failed"],
                     "output_throughput": r["output_throughput"], "mean_ttft_ms": r["mean_ttft_ms"],
                     "mean_tpot_ms": r["mean_tpot_ms"], "acceptance_rate": acceptance_rate(r),
                     "mean_acceptance_length": stats.get("mean_acceptance_length"),
                     "speedup_vs_baseline": r["output_throughput"] / base[r["concurrency"]]
                     if base.get(r["concurrency"]) else None})
    return rows


def _f(v, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def format_table(rows: list[dict], baseline: str) -> str:
    lines = [f"| set | conc | system | tok/s | TTFT ms | TPOT ms | acceptance | accept len | speedup vs {baseline} | ok/failed |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['set']} | {r['concurrency']} | {r['system']} | {_f(r['output_throughput'], '.1f')} | "
                     f"{_f(r['mean_ttft_ms'], '.1f')} | {_f(r['mean_tpot_ms'], '.2f')} | "
                     f"{_f(r['acceptance_rate'], '.3f')} | {_f(r['mean_acceptance_length'], '.2f')} | "
                     f"{_f(r['speedup_vs_baseline'], '.2f') + ('x' if r['speedup_vs_baseline'] else '')} | "
                     f"{r['completed']}/{r['failed']} |")
    return "\n".join(lines)


def missing_rows(rows: list[dict], sets: list[str], expect: list[str], concurrency: list[int]) -> list[str]:
    have = {(r["set"], r["system"], r["concurrency"]) for r in rows if r["completed"] > 0}
    return [f"{s} {label} c={c}" for s in sets for label in expect for c in concurrency if (s, label, c) not in have]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("results_dir")
    parser.add_argument("--sets", required=True, help="comma-separated prompt set names")
    parser.add_argument("--baseline", default="rayspec-baseline", help="the label speedups are relative to")
    parser.add_argument("--expect", default="", help="labels that must have every set and level (comma-separated)")
    parser.add_argument("--concurrency", default="", help="the levels --expect checks (comma-separated)")
    args = parser.parse_args(argv)
    out = Path(args.results_dir)
    sets = [s for s in args.sets.split(",") if s]
    rows: list[dict] = []
    for set_name in sets:
        result = merge_set(out / "runs", set_name)
        if result is None:
            print(f"gpu_summary.py: no runs of {set_name} in {out / 'runs'}", file=sys.stderr)
            continue
        (out / f"{set_name}.json").write_text(json.dumps(result, indent=2) + "\n")
        write_plot(result, out / f"{set_name}.png")
        rows += summary_rows(set_name, result, args.baseline)
    table = format_table(rows, args.baseline)
    expect = [x for x in args.expect.split(",") if x]
    missing = missing_rows(rows, sets, expect, [int(c) for c in args.concurrency.split(",") if c])
    (out / "summary.json").write_text(json.dumps({"baseline": args.baseline, "rows": rows, "missing": missing},
                                                 indent=2) + "\n")
    (out / "summary.md").write_text(table + "\n")
    print(table)
    if missing:
        print(f"missing or with no completed request: {', '.join(missing)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
