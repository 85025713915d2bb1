"""Markdown table from `rayspec bench offline --output-json` files."""

import json
import sys
from pathlib import Path


def fmt(value, digits=2):
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


cols = [("method", "method"), ("set", None), ("conc", "concurrency"), ("tok/s", "output_throughput"),
        ("baseline tok/s", "baseline_output_throughput"), ("speedup", "speedup"),
        ("HF tok/s", "hf_output_throughput"), ("HF assisted tok/s", "hf_assisted_output_throughput"),
        ("vs HF assisted", None), ("c8/c1", "baseline_concurrency_scaling"),
        ("accept len", "spec_decode_acceptance_length"), ("accept rate", "spec_decode_acceptance_rate"),
        ("greedy_match", "greedy_match")]
print("| " + " | ".join(c for c, _ in cols) + " |")
print("|" + "---|" * len(cols))
for path in sys.argv[1:]:
    r = json.loads(Path(path).read_text())
    row = []
    for name, key in cols:
        if name == "set":
            row.append(Path(r["prompts"]).stem)
        elif name == "vs HF assisted":
            hfa = r.get("hf_assisted_output_throughput")
            row.append(fmt(r["output_throughput"] / hfa) if hfa else "-")
        else:
            row.append(fmt(r.get(key)))
    print("| " + " | ".join(row) + " |")
