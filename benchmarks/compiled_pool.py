"""Does the compiled step's time grow with the KV pool? (It must not: a decode step writes a few rows.)

Builds the project's CausalLM with a few layers at a target's widths (default: Llama-3.1-8B's,
bfloat16, random weights, a small vocabulary: the LM head is not the question), and times the
compiled decode forward (`ModelRunner.forward_hidden(static=True)`, the engine's step) of one
sequence at a fixed context with a small pool and a large one, eager beside compiled, the runs
interleaved; prints and (with --json) writes the medians and their ratios.

    python benchmarks/compiled_pool.py [--pools-mb 16,512] [--layers 2] [--json out.json]
    python benchmarks/compiled_pool.py --dry-run        # tiny widths, seconds (CI)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rayspec.bench.environment import environment  # noqa: E402
from rayspec.model.families import ModelArgs  # noqa: E402
from rayspec.model.kv_cache import KVCache  # noqa: E402
from rayspec.model.native import CausalLM  # noqa: E402
from rayspec.model.runner import make_runner  # noqa: E402

WIDTHS = {  # name -> (hidden, intermediate, heads, kv heads, head_dim)
    "llama8b": (4096, 14336, 32, 8, 128),
    "smollm2": (576, 1536, 9, 3, 64),
    "tiny": (64, 128, 4, 2, 16),
}


def build(width: str, layers: int, dtype) -> CausalLM:
    hidden, inter, heads, kv_heads, head_dim = WIDTHS[width]
    args = ModelArgs(vocab_size=1024, hidden_size=hidden, intermediate_size=inter, num_layers=layers,
                     num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, rms_norm_eps=1e-5,
                     tie_word_embeddings=False)
    inv_freq = 1.0 / (500000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    torch.manual_seed(0)
    model = CausalLM(args, inv_freq).to(dtype)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0.0, 0.02)
    return model.eval()


def runner_for(model: CausalLM, pool_mb: float, context: int, compile: bool, block_size: int = 16):
    per_token = KVCache.bytes_per_token(model.args, model.compute_dtype)
    num_blocks = max(int(pool_mb * 2**20 / per_token) // block_size, context // block_size + 4)
    runner = make_runner(model, max_model_len=context + 64, num_slots=1, slack=0, num_blocks=num_blocks,
                         block_size=block_size, compile=compile)
    runner.kv.allocate("s")
    runner.forward_hidden(["s"], [[(7 * i) % 1000 + 3 for i in range(context)]])  # the context, eager
    return runner


def step(runner: ModelRunner, context: int) -> None:
    runner.kv.set_cached_len("s", context)  # every step decodes the token at `context` again
    runner.forward_hidden(["s"], [[5]], packed=True, static=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--width", default="llama8b", choices=sorted(WIDTHS))
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--pools-mb", default="16,512", help="KV pool sizes (K and V, all layers), MB")
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--json", default=None)
    parser.add_argument("--dry-run", action="store_true", help="tiny widths, few steps (a CI check that it runs)")
    a = parser.parse_args()
    if a.dry_run:
        a.width, a.dtype, a.pools_mb, a.context, a.steps, a.rounds = "tiny", "float32", "1,8", 32, 3, 1
        a.threads = a.threads or 1
        # the compiled step as traced (aot_eager: a copy of the pool would still be in the graph), without
        # inductor's C++ builds (half of the dry run's time in CI)
        from rayspec.model.compiled import CompiledForward
        CompiledForward.backend = "aot_eager"
    if a.threads:
        torch.set_num_threads(a.threads)
    dtype = getattr(torch, a.dtype)
    model = build(a.width, a.layers, dtype)
    pools = [float(p) for p in a.pools_mb.split(",")]
    runners = {(p, c): runner_for(model, p, a.context, c) for p in pools for c in (False, True)}
    times: dict[tuple, list[float]] = {key: [] for key in runners}
    with torch.inference_mode():
        for r in runners.values():  # compiles (first call per runner), untimed
            for _ in range(2):
                step(r, a.context)
        for _ in range(a.rounds):
            for key, r in runners.items():  # interleaved: each round times every case
                t = time.perf_counter()
                for _ in range(a.steps):
                    step(r, a.context)
                times[key].append((time.perf_counter() - t) / a.steps)
    rows = []
    for (pool, compiled), ts in times.items():
        cache = runners[(pool, compiled)].cache
        parts = cache.tensors() if hasattr(cache, "tensors") else (cache.k, cache.v)
        pool_bytes = sum(t.numel() * t.element_size() for t in parts)
        rows.append({"pool_mb": round(pool_bytes / 2**20, 1), "compiled": compiled,
                     "ms_per_step_median": round(statistics.median(ts) * 1e3, 3),
                     "ms_per_step_min": round(min(ts) * 1e3, 3)})
    small = {r["compiled"]: r["ms_per_step_median"] for r in rows if r["pool_mb"] == rows[0]["pool_mb"]}
    for r in rows:
        r["vs_smallest_pool"] = round(r["ms_per_step_median"] / small[r["compiled"]], 3)
    print(f"{a.width} widths, {a.layers} layers, {a.dtype}, batch 1, context {a.context}")
    print(f"{'pool MB':>9} {'compiled':>9} {'ms/step':>9} {'vs small':>9}")
    for r in rows:
        print(f"{r['pool_mb']:>9} {str(r['compiled']):>9} {r['ms_per_step_median']:>9} {r['vs_smallest_pool']:>9}")
    if a.json:
        Path(a.json).write_text(json.dumps({"args": vars(a), "environment": environment(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
