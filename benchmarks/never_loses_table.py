"""The table of benchmarks/run_never_loses.sh: each proposer's speedup over the target alone, by prompt
set, temperature and concurrency, from `rayspec bench sweep` JSON files; the floor the issue sets
(0.97x) is marked. "output = target's": greedy, or seeded at temperature > 0 (a seeded request's
draws are coupled to positions, so the speculative run emits the baseline's tokens); "-" for unseeded
sampling, where each run samples its own. Markdown on stdout.

    python benchmarks/never_loses_table.py benchmarks/results/never_loses_*.json
    python benchmarks/never_loses_table.py --served benchmarks/results/never_loses_served_*.json
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

FLOOR = 0.97
SETS = ("mt_bench", "humaneval", "gsm8k", "unguessable", "long_documents")


def rows(paths: list[str]) -> list[dict]:
    out = []
    for path in paths:
        result = json.loads(Path(path).read_text())
        cfg = result["config"]
        for r in result["results"]:
            out.append({"set": Path(cfg["prompts"]).stem, "temperature": cfg["temperature"], "method": r["method"],
                        "k": r["num_speculative_tokens"], "concurrency": r["concurrency"], "speedup": r["speedup"],
                        "acceptance_length": r["acceptance_length"],
                        # the same tokens as the baseline: greedy, or seeded at temperature > 0
                        "greedy_match": r["greedy_match"] if r["greedy_match"] is not None else r.get("seeded_match"),
                        "seeded": bool(cfg.get("seeded")) and cfg["temperature"] > 0,
                        "num_drafts": r["num_drafts"], "by_round": r.get("speedup_by_round") or [],
                        "cpu": result["environment"].get("cpu_model")})
    return out


def table(found: list[dict]) -> str:
    lines = ["| set | T | method (k) | conc | speedup | rounds (min-max) | drafts | acc. length | output = target's |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(found, key=lambda r: (r["set"], r["temperature"], r["seeded"], r["method"], r["concurrency"])):
        mark = "" if r["speedup"] is None or r["speedup"] >= FLOOR else " **below 0.97**"
        greedy = "-" if r["greedy_match"] is None else ("yes" if r["greedy_match"] else "**NO**")
        spread = "-" if len(r["by_round"]) < 2 else (f"{len(r['by_round'])}: {min(r['by_round']):.2f}-"
                                                       f"{max(r['by_round']):.2f}x")
        temp = f"{r['temperature']:g}" + (" seeded" if r["seeded"] else "")
        lines.append(f"| {r['set']} | {temp} | {r['method']} ({r['k']}) | {r['concurrency']} | "
                     f"{r['speedup']:.2f}x{mark} | {spread} | {r['num_drafts']} | {r['acceptance_length']:.2f} | {greedy} |")
    speedups = [r["speedup"] for r in found if r["speedup"] is not None]
    # runs that drafted nothing did the baseline's work: their spread is the measurement's noise
    same_work = [r["speedup"] for r in found if r["num_drafts"] == 0 and r["speedup"] is not None]
    if same_work:
        lines.append(f"\nnoise floor: {len(same_work)} runs drafted nothing (the baseline's work): "
                     f"{min(same_work):.2f}x-{max(same_work):.2f}x")
    if speedups:
        below = sum(s < FLOOR for s in speedups)
        lines.append(f"\n{len(speedups)} runs, lowest {min(speedups):.2f}x, {below} below {FLOOR}x; "
                     f"CPU: {', '.join(sorted({str(r['cpu']) for r in found}))}")
    return "\n".join(lines)


def served_rows(paths: list[str]) -> list[dict]:
    """benchmarks/run_never_loses_served.sh's files (`rayspec bench serve`, endpoints labelled by
    proposer and `base`): per proposer and concurrency, its output tok/s over base's."""
    out = []
    for path in paths:
        result = json.loads(Path(path).read_text())
        cfg = result["config"]
        by = {(r["label"], r["concurrency"]): r for r in result["results"]}
        for (label, conc), r in sorted(by.items()):
            base = by.get(("base", conc))
            if label == "base" or base is None or not base["output_throughput"]:
                continue
            rounds = [a / b for a, b in zip(r.get("round_output_throughput") or [], base.get("round_output_throughput") or [])
                      if a and b]
            name = Path(path).stem  # never_loses_served_[<proposers>_]<set>_t<T>[_seeded]
            found_set = next((x for x in SETS if f"_{x}_t" in name), cfg.get("prompts"))
            out.append({"set": found_set, "temperature": cfg.get("temperature"),
                        "seeded": "seed" in json.dumps(cfg.get("extra_body") or {}), "method": label,
                        "concurrency": conc, "speedup": r["output_throughput"] / base["output_throughput"],
                        "by_round": rounds, "tpot_ms": r.get("mean_tpot_ms"), "base_tpot_ms": base.get("mean_tpot_ms"),
                        "failed": r.get("failed", 0) + base.get("failed", 0),
                        "drafted": (r.get("server_stats") or {}).get("num_draft_tokens"),
                        "accepted": (r.get("server_stats") or {}).get("num_accepted_tokens"),
                        "cpu": (result.get("environment") or {}).get("cpu_model"), "file": Path(path).name})
    return out


def served_table(found: list[dict]) -> str:
    lines = ["| set | T | method | conc | speedup (tok/s over base) | rounds | drafted / accepted | TPOT ms (base) | failed |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(found, key=lambda r: (r["set"], r["temperature"], r["seeded"], r["method"], r["concurrency"])):
        mark = "" if r["speedup"] >= FLOOR else " **below 0.97**"
        spread = ", ".join(f"{x:.2f}" for x in r["by_round"]) or "-"
        temp = f"{r['temperature']:g}" + (" seeded" if r["seeded"] else "")
        tpot = "-" if r["tpot_ms"] is None else f"{r['tpot_ms']:.1f} ({r['base_tpot_ms']:.1f})"
        drafts = "-" if r["drafted"] is None else f"{r['drafted']} / {r['accepted']}"
        lines.append(f"| {r['set']} | {temp} | {r['method']} | {r['concurrency']} | {r['speedup']:.2f}x{mark} | {spread} | "
                     f"{drafts} | {tpot} | {r['failed']} |")
    same_work = [r["speedup"] for r in found if r["drafted"] == 0]
    if same_work:
        lines.append(f"\nnoise floor: {len(same_work)} runs drafted nothing: {min(same_work):.2f}x-{max(same_work):.2f}x")
    if found:
        speedups = [r["speedup"] for r in found]
        lines.append(f"\n{len(found)} served runs, lowest {min(speedups):.2f}x, {sum(s < FLOOR for s in speedups)} below "
                     f"{FLOOR}x; CPU: {', '.join(sorted({str(r['cpu']) for r in found}))}")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__, file=sys.stderr)
        return 2
    if argv[0] == "--served":
        print(served_table(served_rows(argv[1:])))
        return 0
    print(table(rows(argv)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
