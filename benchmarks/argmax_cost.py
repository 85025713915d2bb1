"""A vocabulary row's argmax on CPU: torch's argmax against max's indices (the same index: the first
maximum; what rayspec.sampling.sampler.argmax returns), at vocabulary sizes, row counts and dtypes.

    python benchmarks/argmax_cost.py [--threads 1] [--output-json F]

Prints ms per call (median of 5 rounds) per (dtype, V, rows) and checks on each input that both give the
same indices (random rows with ties). Results: benchmarks/results/argmax_cost_*.json (with the CPU model).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[1]), str(Path(__file__).resolve().parent)]

from norm_cost import per_call_ms  # noqa: E402  (benchmarks/norm_cost.py: median of 5 rounds)
from rayspec.bench.environment import cpu_model  # noqa: E402


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--vocab", type=int, nargs="+", default=[8192, 32000, 49152, 128256])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 9, 72, 288])
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--dry-run", action="store_true", help="one small size, few calls")
    parser.add_argument("--output-json")
    a = parser.parse_args(argv)
    if a.dry_run:
        a.vocab, a.rows, a.dtypes = [512], [3], ["float32"]
    torch.set_num_threads(a.threads)
    out = []
    print("| dtype | V | rows | argmax ms | max ms | ratio |\n|---|---|---|---|---|---|")
    for dtype in a.dtypes:
        for vocab in a.vocab:
            for rows in a.rows:
                x = torch.randint(-50, 50, (rows, vocab)).to(getattr(torch, dtype))  # ties, as rounded logits have
                assert torch.equal(x.argmax(-1), x.max(-1).indices), "argmax and max's indices differ"
                calls = 2 if a.dry_run else max(3, 2_000_000 // (rows * vocab))
                am = per_call_ms(lambda: x.argmax(-1), calls)
                mx = per_call_ms(lambda: x.max(-1).indices, calls)
                out.append(dict(dtype=dtype, vocab=vocab, rows=rows, argmax_ms=round(am, 4), max_ms=round(mx, 4),
                                ratio=round(am / mx, 2)))
                print(f"| {dtype} | {vocab} | {rows} | {am:.4f} | {mx:.4f} | {am / mx:.2f} |")
    report = {"what": "argmax vs max(-1).indices over vocabulary rows, CPU", "cpu_model": cpu_model()[0],
              "torch": torch.__version__, "threads": a.threads,
              "command": "python benchmarks/argmax_cost.py " + " ".join(sys.argv[1:] if argv is None else argv),
              "rows": out}
    if a.output_json:
        Path(a.output_json).write_text(json.dumps(report, indent=2) + "\n")
    return report


if __name__ == "__main__":
    main()
