"""Paged KV cache and prefix caching on this machine (docs/benchmarks-history.md, "Paged KV and prefix caching").

  capacity:   N requests of exactly --prompt-tokens + --max-tokens tokens under one KV budget: how many
              run at once (the most, and how many still ran when the first finished, all near full
              length), and how many were preempted
  throughput: MT-bench prompts (chat template) at --concurrency, offline: output tokens per second
  prefix:     two requests sharing a --prefix-tokens prefix, one after the other: each one's time to
              first token and the second's decode speed, prefix caching on and off
  decode:     single-request decode speed after a --prefix-tokens prefix, prefix caching on (the prefix
              found cached) against off, one engine each, interleaved --rounds times: the ratio per round

It runs against whichever `rayspec` is first on the path, so the code before paging runs it too
(PYTHONPATH=<a worktree of the older commit>): there the engine has slots, not blocks.

  .venv/bin/python benchmarks/paged_kv.py capacity --kv-cache-memory-gb 0.5
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import platform
import time
from pathlib import Path

import torch

from rayspec.config import EngineConfig, SpeculativeConfig
from rayspec.engine.llm_engine import LLMEngine
from rayspec.sampling.sampler import SamplingParams

try:  # the bundled set; the code before paging has no rayspec.bench.prompts.prompts_path
    from rayspec.bench.prompts import prompts_path
    PROMPTS = prompts_path(os.environ.get("RAYSPEC_PROMPTS", "mt_bench"))
except ImportError:
    PROMPTS = Path(os.environ["RAYSPEC_PROMPTS"])


def build(args, **extra) -> LLMEngine:
    fields = inspect.signature(EngineConfig).parameters  # the older engine has no block_size / prefix caching
    extra = {k: v for k, v in extra.items() if k in fields}
    config = EngineConfig(model=args.model, max_model_len=args.max_model_len, max_num_seqs=args.max_num_seqs,
                          kv_cache_memory_gb=args.kv_cache_memory_gb, num_threads=args.num_threads,
                          speculative=SpeculativeConfig(method=args.method, num_speculative_tokens=args.k), **extra)
    return LLMEngine(config)


def mt_bench(engine: LLMEngine, n: int) -> list[list[int]]:
    turns = [json.loads(line)["turns"][0] for line in PROMPTS.read_text().splitlines() if line.strip()]
    return [engine.encode_chat([{"role": "user", "content": t}]) for t in turns[:n]]


def layout(engine: LLMEngine) -> dict:
    runner = engine.runner
    if hasattr(runner, "num_blocks"):
        return {"cache": "paged", "num_blocks": runner.kv.num_blocks, "block_size": runner.kv.block_size,
                "max_num_seqs": runner.kv.num_slots}
    return {"cache": "slots", "num_slots": runner.cache.num_slots, "capacity": runner.cache.capacity}


def capacity(args) -> dict:
    engine = build(args, enable_prefix_caching=False)
    base = mt_bench(engine, args.num_requests)
    prompts = [(p * (args.prompt_tokens // len(p) + 1))[: args.prompt_tokens] for p in base]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    for p in prompts:
        engine.add_request(p, params)
    most, at_first_finish, start, tokens = 0, None, time.perf_counter(), 0
    while engine.has_unfinished_requests():
        running = engine.num_running
        outs = engine.step()
        most = max(most, running)
        finished = [o for o in outs if o.finished]
        if finished and at_first_finish is None:
            at_first_finish = running
        tokens += sum(o.num_output_tokens for o in finished)
    return {**layout(engine), "sequence_tokens": args.prompt_tokens + args.max_tokens, "requests": len(prompts),
            "most_running": most, "running_when_first_finished": at_first_finish,
            "preemptions": getattr(engine, "num_preemptions", 0), "seconds": time.perf_counter() - start,
            "output_tok_per_s": tokens / (time.perf_counter() - start)}


def throughput(args) -> dict:
    engine = build(args, enable_prefix_caching=True)
    prompts = mt_bench(engine, args.num_requests)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    engine.generate(prompts[:2], SamplingParams(temperature=0.0, max_tokens=4))  # warm up
    pending, start, tokens, most = list(prompts), time.perf_counter(), 0, 0
    while pending or engine.has_unfinished_requests():
        while pending and engine.num_running + engine.num_waiting < args.concurrency:
            engine.add_request(pending.pop(0), params)
        most = max(most, engine.num_running)
        tokens += sum(o.num_output_tokens for o in engine.step() if o.finished)
    seconds = time.perf_counter() - start
    return {**layout(engine), "requests": len(prompts), "concurrency": args.concurrency, "most_running": most,
            "output_tokens": tokens, "seconds": seconds, "output_tok_per_s": tokens / seconds,
            "preemptions": getattr(engine, "num_preemptions", 0)}


def prefix(args) -> dict:
    out = {}
    for caching in (False, True):
        engine = build(args, enable_prefix_caching=caching)
        base = mt_bench(engine, 80)
        shared = [t for p in base for t in p][: args.prefix_tokens]
        engine.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=2))  # warm up
        runs = []
        for tail in ([11, 12, 13], [21, 22]):
            engine.add_request(shared + tail, SamplingParams(temperature=0.0, max_tokens=args.max_tokens,
                                                             ignore_eos=True))
            start, first, cached = time.perf_counter(), None, 0
            while engine.has_unfinished_requests():
                for o in engine.step():
                    if first is None and o.token_ids:
                        first = time.perf_counter() - start
                    cached = getattr(o, "num_cached_tokens", 0)
            total = time.perf_counter() - start
            runs.append({"ttft_s": first, "decode_tok_per_s": (args.max_tokens - 1) / (total - first),
                         "cached_tokens": cached})
        out["on" if caching else "off"] = runs
    return {"prefix_tokens": args.prefix_tokens, **out}


def decode(args) -> dict:
    engines = {"off": build(args, enable_prefix_caching=False), "on": build(args, enable_prefix_caching=True)}
    base = mt_bench(engines["off"], 80)
    shared = [t for p in base for t in p][: args.prefix_tokens]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens, ignore_eos=True)
    for engine in engines.values():  # warm up; "on" now holds the prefix's blocks in its cache
        engine.generate([shared + [5]], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    rounds = []
    for r in range(args.rounds):
        speeds, cached = {}, {}
        for name in (("off", "on") if r % 2 == 0 else ("on", "off")):  # alternate who goes first
            engine = engines[name]
            engine.add_request(shared + [100 + r], params)
            start = first = None
            start = time.perf_counter()
            while engine.has_unfinished_requests():
                for o in engine.step():
                    if first is None and o.token_ids:
                        first = time.perf_counter()
                    cached[name] = getattr(o, "num_cached_tokens", 0)
            speeds[name] = (args.max_tokens - 1) / (time.perf_counter() - first)
        rounds.append({"off_tok_per_s": round(speeds["off"], 2), "on_tok_per_s": round(speeds["on"], 2),
                       "ratio": round(speeds["on"] / speeds["off"], 4), "on_cached_tokens": cached["on"]})
    ratios = sorted(x["ratio"] for x in rounds)
    return {"prefix_tokens": args.prefix_tokens, "max_tokens": args.max_tokens, "rounds": rounds,
            "median_ratio": ratios[len(ratios) // 2],
            "geomean_ratio": round(float(torch.tensor(ratios).log().mean().exp()), 4)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("mode", choices=["capacity", "throughput", "prefix", "decode"])
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--method", default="none")
    ap.add_argument("--k", type=int, default=0)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--kv-cache-memory-gb", type=float, default=2.0)
    ap.add_argument("--num-requests", type=int, default=48)
    ap.add_argument("--prompt-tokens", type=int, default=100)
    ap.add_argument("--max-tokens", type=int, default=200)
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--prefix-tokens", type=int, default=1500)
    ap.add_argument("--num-threads", type=int, default=None)
    args = ap.parse_args()
    result = {"capacity": capacity, "throughput": throughput, "prefix": prefix, "decode": decode}[args.mode](args)
    print(json.dumps({"mode": args.mode, "cpu": platform.processor() or platform.machine(),
                      "torch_threads": torch.get_num_threads(), **vars(args), **result}, indent=1))


if __name__ == "__main__":
    main()
