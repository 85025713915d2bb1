"""What one sampled row costs: rayspec.sampling.sampler (top-k / top-p by torch.topk of the tokens that can stay,
sample() by the inverse cumulative mass) against a full sort of the vocabulary and torch.multinomial,
on rows of the real model's width (49,152) from sharp to flat, one torch thread.

    python benchmarks/sampling_cost.py [--json results/sampling_cost.json] [--repeats 30]

Every sampled request pays this per drafted token (draft model, EAGLE chains) and per verified row.
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from pathlib import Path

import torch

from rayspec.sampling.sampler import logits_to_probs, sample

VOCAB = 49152
# (name, logit scale): how sharp the row is; the kept token count is reported
ROWS = [("sharp", 20.0), ("peaked", 8.0), ("medium", 3.0), ("flat", 1.0)]
SETTINGS = [("top_p 0.95", 0, 0.95), ("top_k 50 top_p 0.9", 50, 0.9), ("plain (top_p 1)", 0, 1.0)]


def full_sort(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """What logits_to_probs did before: sort the whole row, cut, scatter back."""
    logits = logits / temperature
    if not 0 < top_k < logits.shape[-1] and top_p >= 1.0:
        return logits.softmax(-1)
    values, index = logits.sort(dim=-1, descending=True)
    remove = torch.zeros_like(values, dtype=torch.bool)
    if 0 < top_k < logits.shape[-1]:
        remove[:, top_k:] = True
    if top_p < 1.0:
        probs = values.masked_fill(remove, float("-inf")).softmax(-1)
        remove |= probs.cumsum(-1) - probs >= top_p
        remove[:, 0] = False
    return torch.empty_like(logits).scatter_(-1, index, values.masked_fill(remove, float("-inf"))).softmax(-1)


def timed(fn, repeats: int) -> float:
    fn()
    started = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - started) / repeats * 1e3


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", default=None)
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    results = []
    print(f"{'row':8} {'setting':20} {'kept':>6} {'probs ms':>9} {'sort ms':>8} {'sample ms':>10} {'multinomial ms':>15}")
    for row, scale in ROWS:
        logits = torch.randn(1, VOCAB, generator=gen) * scale
        for name, top_k, top_p in SETTINGS:
            probs = logits_to_probs(logits, 0.9, top_k, top_p)
            entry = {"row": row, "setting": name, "kept": int((probs > 0).sum()),
                     "logits_to_probs_ms": timed(lambda: logits_to_probs(logits, 0.9, top_k, top_p), args.repeats),
                     "full_sort_ms": timed(lambda: full_sort(logits, 0.9, top_k, top_p), args.repeats),
                     "sample_ms": timed(lambda: sample(probs[0], gen), args.repeats),
                     "multinomial_ms": timed(lambda: torch.multinomial(probs[0], 1, generator=gen), args.repeats)}
            results.append(entry)
            print(f"{row:8} {name:20} {entry['kept']:6d} {entry['logits_to_probs_ms']:9.2f} {entry['full_sort_ms']:8.2f} "
                  f"{entry['sample_ms']:10.3f} {entry['multinomial_ms']:15.3f}")
    if args.json:
        cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                    if line.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() else ""
        Path(args.json).write_text(json.dumps({"cpu": cpu, "torch": torch.__version__, "threads": 1,
                                               "vocab": VOCAB, "temperature": 0.9, "rows": results}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
