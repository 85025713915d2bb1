"""Peak memory of a long prefill, chunked (max_num_batched_tokens) or not.

Each configuration runs in a fresh process: the engine is built (the model's weights, and a KV
cache for one sequence of max_model_len, touched so it is resident), then one prompt of --tokens
tokens is prefilled while a thread samples the process's resident set every millisecond. Reported:
the peak above that baseline (what the prefill itself allocated), beside the planner's estimate of
one chunk's activations (rayspec.memory.activation_memory.forward_activations, the figure `rayspec plan` prints).

    python benchmarks/prefill_memory.py --tokens 8000 --budgets 512 2048 none --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import threading
import time

MIB = 2**20


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def measure(model: str, tokens: int, budget: int | None, num_layers: int | None, threads: int) -> dict:
    """In this process: build, touch the cache, prefill, return the figures."""
    import torch

    from rayspec.config import EngineConfig, SpeculativeConfig
    from rayspec.engine.llm_engine import LLMEngine
    from rayspec.memory.activation_memory import forward_activations
    from rayspec.model import loader
    from rayspec.sampling.sampler import SamplingParams

    torch.set_num_threads(threads)
    loaded = loader.load_model(model, num_layers=num_layers)
    max_model_len = min(loaded[0].args.max_position_embeddings, tokens + 64)
    config = EngineConfig(model=model, max_model_len=max_model_len, max_num_seqs=1, kv_cache_memory_gb=64.0,
                          max_num_batched_tokens=budget, speculative=SpeculativeConfig(method="none"))
    engine = LLMEngine(config, model=loaded[0], tokenizer=loaded[1])
    for pool in engine.runner.cache.tensors():  # resident now: the baseline holds the whole cache
        pool.fill_(0)
    prompt = [(i * 7919) % (loaded[0].args.vocab_size - 10) + 5 for i in range(tokens)]
    engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=1))
    baseline = peak = _rss()
    stop = threading.Event()

    def sample():
        nonlocal peak
        while not stop.is_set():
            peak = max(peak, _rss())
            time.sleep(0.001)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    started, steps = time.perf_counter(), 0
    while engine.has_unfinished_requests():
        engine.step()
        steps += 1
    seconds = time.perf_counter() - started
    stop.set()
    sampler.join()
    peak = max(peak, _rss())
    args = loaded[0].args
    chunk = budget if budget is not None else tokens
    estimate = forward_activations(args, engine.dtype, chunk, max_model_len + 1, 1)
    return {
        "tokens": tokens, "max_num_batched_tokens": budget, "num_layers": args.num_layers, "steps": steps,
        "prefill_seconds": round(seconds, 2), "baseline_mib": round(baseline / MIB, 1),
        "peak_above_baseline_mib": round((peak - baseline) / MIB, 1),
        "estimate_mib": round(estimate.total / MIB, 1),
        "estimate_fused_mib": round((estimate.total - estimate.scores) / MIB, 1),
        "dtype": str(engine.dtype).removeprefix("torch."),
    }


def run_isolated(model: str, tokens: int, budget: int | None, num_layers: int | None, threads: int) -> dict:
    """measure() in a fresh interpreter (peaks of earlier runs would hide this one's)."""
    cmd = [sys.executable, __file__, "--child", "--model", model, "--tokens", str(tokens), "--threads", str(threads),
           "--budgets", "none" if budget is None else str(budget)]
    if num_layers:
        cmd += ["--num-layers", str(num_layers)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                                       os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, env=env).stdout
    return json.loads(out.strip().splitlines()[-1])


def _cpu_model() -> str:
    try:
        for line in subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines():
            if line.startswith("Model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--tokens", type=int, default=8000)
    parser.add_argument("--budgets", nargs="+", default=["512", "2048", "none"])
    parser.add_argument("--num-layers", type=int, default=None, help="keep the first N layers (a quicker run)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", default=None, help="write the results here")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    budgets = [None if b == "none" else int(b) for b in args.budgets]
    if args.child:
        print(json.dumps(measure(args.model, args.tokens, budgets[0], args.num_layers, args.threads)))
        return
    import ray
    import torch
    import transformers
    results = {"cpu": _cpu_model(), "torch": torch.__version__, "transformers": transformers.__version__,
               "ray": ray.__version__, "command": " ".join([os.path.basename(sys.executable)] + sys.argv), "runs": []}
    for budget in budgets:
        row = run_isolated(args.model, args.tokens, budget, args.num_layers, args.threads)
        results["runs"].append(row)
        print(json.dumps(row), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
