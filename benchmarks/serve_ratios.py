"""Issue-3 ratios from one serving run bracketed by offline runs (see benchmarks/run_serve.sh).

usage: python benchmarks/serve_ratios.py SERVE_JSON OFFLINE_JSON [OFFLINE_JSON ...]

SERVE_JSON: `rayspec bench serve --output-json` with endpoints labelled eagle3, base, disagg.
OFFLINE_JSON: `rayspec bench offline --method eagle3 --output-json` (eagle3 and its baseline, same
prompts and max tokens). Offline runs are grouped by their torch thread count; each group's mean
is an offline reference (the served config's own thread count, and the offline engine's best).
"""

import json
import statistics
import sys
from collections import defaultdict
from pathlib import Path


def main(serve_path: str, offline_paths: list[str]) -> None:
    serve = json.loads(Path(serve_path).read_text())
    groups: dict[int, list[dict]] = defaultdict(list)
    for p in offline_paths:
        o = json.loads(Path(p).read_text())
        groups[o.get("environment", o).get("torch_threads")].append(o)  # flat in JSONs before "environment"
    tput = {(r["label"], r["concurrency"]): r["output_throughput"] for r in serve["results"]}
    levels = sorted({c for _, c in tput})
    labels = serve["config"]["labels"]
    refs = {}
    for threads, runs in sorted(groups.items()):
        spec = statistics.mean(o["output_throughput"] for o in runs)
        base = statistics.mean(o["baseline_output_throughput"] for o in runs)
        refs[threads] = (spec, base)
        print(f"offline, {threads} torch thread(s), mean of {len(runs)} run(s): eagle3 {spec:.1f} tok/s "
              f"({', '.join(format(o['output_throughput'], '.1f') for o in runs)}), baseline {base:.1f} "
              f"({', '.join(format(o['baseline_output_throughput'], '.1f') for o in runs)})")
    print()
    print("| endpoint | " + " | ".join(f"c{c} tok/s" for c in levels) + " |")
    print("|---|" + "---|" * len(levels))
    for label in labels:
        print(f"| {label} | " + " | ".join(f"{tput.get((label, c), float('nan')):.1f}" for c in levels) + " |")
    print()
    lo, hi = levels[0], levels[-1]
    checks = []
    for threads, (off_spec, off_base) in sorted(refs.items()):
        ref = f"offline ({threads} thread{'s' if threads != 1 else ''})"
        if ("eagle3", lo) in tput:
            checks.append((f"eagle3 colocated c{lo} / {ref} eagle3", tput["eagle3", lo] / off_spec, 0.85))
        if ("disagg", lo) in tput:
            checks.append((f"eagle3 disaggregated c{lo} / {ref} eagle3", tput["disagg", lo] / off_spec, 0.7))
        if ("base", lo) in tput:
            checks.append((f"baseline c{lo} / {ref} baseline", tput["base", lo] / off_base, None))
    for label in labels:
        if (label, lo) in tput and (label, hi) in tput:
            checks.append((f"{label} c{hi} / c{lo}", tput[label, hi] / tput[label, lo],
                           2.5 if label == "eagle3" else None))
    if "base" in labels:
        for label in labels:
            if label == "base":
                continue
            for c in levels:
                if (label, c) in tput and ("base", c) in tput:
                    checks.append((f"{label} / base at c{c}", tput[label, c] / tput["base", c],
                                   1.0 if label == "eagle3" else None))
    print("| ratio | value | goal |")
    print("|---|---|---|")
    for name, value, goal in checks:
        mark = "" if goal is None else (f">= {goal} " + ("met" if value >= goal else "**not met**"))
        print(f"| {name} | {value:.2f} | {mark} |")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
