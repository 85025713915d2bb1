"""Decode speed on CPU of a 4-bit checkpoint kept 4-bit against its dequantized twin (issue #52): the same
NVFP4 Llama loaded `quantized_weights: keep` (each projection dequantized into the shared scratch per
forward, rayspec.model.fp4_linear) and `dequantize` (float weights and the CPU kernels measured at load),
greedy decoding at batch 1 through the model runner, the two interleaved round by round so that the
machine's load falls on both alike; per round the ratio of their times, and the median over rounds.

Two models: the tests' tiny one (hidden 64, 3 layers, vocab 256: what tests/engine/test_fp4*.py decode, so
the ratio says whether those tests stay fast) and a larger one (hidden 512, 8 layers, vocab 4096) where
the weights, not the per-op overhead, dominate. Random codes and scales (tests/fp4_utils.random_nvfp4_llama).

    python benchmarks/fp4_cpu_decode.py --json benchmarks/results/fp4_cpu_decode.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from fp4_utils import random_nvfp4_llama  # noqa: E402

from rayspec.model import loader  # noqa: E402
from rayspec.model.fp4_linear import held_bytes  # noqa: E402
from rayspec.model.runner import make_runner  # noqa: E402

MODELS = {"tiny (tests' shapes)": dict(num_layers=3, hidden=64, vocab_size=256),
          "hidden 512 x 8 layers": dict(num_layers=8, hidden=512, vocab_size=4096)}


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        return next(line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name"))
    except (OSError, subprocess.CalledProcessError, StopIteration):
        return platform.processor() or "unknown"


def decode_seconds(model, prompt: list[int], tokens: int) -> float:
    """Seconds for `tokens` greedy decode steps at batch 1 after a prefill of `prompt`."""
    runner = make_runner(model, len(prompt) + tokens + 8, num_slots=1, slack=1)
    runner.kv.allocate("a")
    with torch.no_grad():
        logits = runner.forward(["a"], [prompt], last_only=True)
        token = int(logits[0, -1].argmax())
        start = time.perf_counter()
        for _ in range(tokens):
            logits = runner.forward(["a"], [[token]], last_only=True)
            token = int(logits[0, -1].argmax())
        return time.perf_counter() - start


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--dtype", default="float32", help="float32 (the CPU default) or bfloat16")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    dtype = loader.parse_dtype(args.dtype, torch.device("cpu"))
    report = {"what": "fp4 CPU decode: kept 4-bit vs dequantized at load", "cpu_model": cpu_model(),
              "cpu_count": torch.get_num_threads(), "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
              "dtype": str(dtype).removeprefix("torch."), "rounds": args.rounds, "tokens": args.tokens,
              "load_average_at_start": [round(v, 1) for v in os.getloadavg()], "models": []}
    prompt = list(range(1, 17))
    with tempfile.TemporaryDirectory() as tmp:
        for name, dims in MODELS.items():
            path = random_nvfp4_llama(Path(tmp) / name.split()[0], **dims)
            kept, _ = loader.load_model(str(path), device="cpu", dtype=dtype, tokenizer=False)
            twin, _ = loader.load_model(str(path), device="cpu", dtype=dtype, tokenizer=False,
                                        quantized_weights="dequantize")
            decode_seconds(kept, prompt, 4), decode_seconds(twin, prompt, 4)  # warm-up (and the scratch)
            rounds = []
            for _ in range(args.rounds):
                k, d = decode_seconds(kept, prompt, args.tokens), decode_seconds(twin, prompt, args.tokens)
                rounds.append({"kept_tok_s": round(args.tokens / k, 1), "dequantized_tok_s": round(args.tokens / d, 1),
                               "kept_time_over_dequantized": round(k / d, 3)})
            ratio = statistics.median(r["kept_time_over_dequantized"] for r in rounds)
            row = {"model": name, **dims, "held_bytes_kept": held_bytes(kept), "held_bytes_dequantized": held_bytes(twin),
                   "rounds": rounds, "median_kept_time_over_dequantized": ratio,
                   "median_kept_tok_s": statistics.median(r["kept_tok_s"] for r in rounds),
                   "median_dequantized_tok_s": statistics.median(r["dequantized_tok_s"] for r in rounds)}
            report["models"].append(row)
            print(f"{name}: kept {row['median_kept_tok_s']} tok/s, dequantized {row['median_dequantized_tok_s']} tok/s, "
                  f"kept/dequantized time {ratio:.2f}x (median of {args.rounds} interleaved rounds); held "
                  f"{row['held_bytes_kept'] / 1e6:.2f} MB vs {row['held_bytes_dequantized'] / 1e6:.2f} MB")
    report["load_average_at_end"] = [round(v, 1) for v in os.getloadavg()]
    text = json.dumps(report, indent=1)
    if args.json:
        Path(args.json).write_text(text + "\n")
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
