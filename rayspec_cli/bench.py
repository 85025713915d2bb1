"""bench offline, bench sweep, bench serve (rayspec.bench does the measuring; this parses and prints)."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

from rayspec_cli.flags import engine_flag_fields, speculative_args, speculative_config


def _ray_rank_launcher():
    """Tensor-parallel ranks as Ray actors (a local Ray instance unless RAY_ADDRESS names a cluster)."""
    import ray

    from deployments.replicas.tensor_parallel import RayRankLauncher

    if not ray.is_initialized():
        ray.init(include_dashboard=False, log_to_driver=False)
    return RayRankLauncher()


def cmd_bench_offline(args) -> int:
    from rayspec.bench.offline import format_result, run_offline_benchmark

    if args.num_threads:
        import torch

        torch.set_num_threads(args.num_threads)
    try:
        spec = speculative_config(args)
    except ValueError as err:
        print(f"rayspec bench offline: {err}", file=sys.stderr)
        return 2
    result = run_offline_benchmark(
        model=args.model, spec=spec, prompts_file=args.prompts, num_prompts=args.num_prompts,
        max_tokens=args.max_tokens, concurrency=args.concurrency, with_hf=not args.no_hf,
        tensor_parallel_size=args.tensor_parallel_size, dtype=args.dtype, device=args.device,
        rank_launcher=_ray_rank_launcher() if args.tensor_parallel_size > 1 else None,
        engine_overrides=bench_engine_overrides(args), temperature=args.temperature, seeded=not args.unseeded)
    print(format_result(result))
    if args.output_json:
        Path(args.output_json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output_json).write_text(json.dumps(result, indent=2) + "\n")
    return 0


def cmd_bench_sweep(args) -> int:
    from rayspec.bench.sweep import MethodOptions, format_table, parse_list, run_sweep, write_json, write_plot

    if args.num_threads:
        import torch

        torch.set_num_threads(args.num_threads)
    try:
        methods = parse_list(args.methods, str)
        ks = parse_list(args.num_speculative_tokens)
        concurrency = parse_list(args.concurrency)
    except ValueError as err:
        print(f"rayspec bench sweep: {err}", file=sys.stderr)
        return 2
    opts = MethodOptions(eagle_head=args.eagle_head, speculative=speculative_args(args, skip=SWEEP_OWN_FLAGS))
    try:
        result = run_sweep(args.model, methods, ks, args.prompts, args.num_prompts, args.max_tokens, concurrency,
                           opts, temperature=args.temperature, seeded=not args.unseeded, device=args.device,
                           dtype=args.dtype,
                           engine_overrides=bench_engine_overrides(args), planned_memory=planned_memory,
                           rounds=args.rounds)
    except ValueError as err:
        print(f"rayspec bench sweep: {err}", file=sys.stderr)
        return 2
    print(format_table(result))
    if args.output_json:
        write_json(result, args.output_json)
    if args.plot:
        write_plot(result, args.plot)
    return 0


# engine flags `bench offline` takes as its own options (their defaults differ from the engine's)
BENCH_OWN_FLAGS = ("device", "dtype", "tensor_parallel_size", "num_threads")
# speculative settings `bench sweep` takes as its own options: lists to sweep (--methods, --num-speculative-tokens)
SWEEP_OWN_FLAGS = ("method", "num_speculative_tokens")


def bench_engine_overrides(args) -> dict:
    """The engine flags given on `bench offline`'s (or `bench sweep`'s) command line (as `rayspec serve` takes them)."""
    return {name: getattr(args, name) for name, _, _ in engine_flag_fields()
            if name not in BENCH_OWN_FLAGS and getattr(args, name, None) is not None}


def cmd_bench_serve(args) -> int:
    from tqdm import tqdm

    from rayspec.bench.serve import (endpoint_models, format_result, parse_concurrency, run_serve_benchmark,
                                     write_plot)

    try:
        concurrency = parse_concurrency(args.concurrency)
        models = endpoint_models(args.model, len(args.endpoint))
        if not (args.request_rate > 0 and args.burstiness > 0):
            raise ValueError("--request-rate and --burstiness must be > 0 (--request-rate inf: closed loop)")
    except ValueError as err:
        print(f"rayspec bench serve: {err}", file=sys.stderr)
        return 2
    if args.label and len(args.label) != len(args.endpoint):
        print(f"rayspec bench serve: {len(args.label)} --label for {len(args.endpoint)} --endpoint", file=sys.stderr)
        return 2
    result = run_serve_benchmark(
        endpoints=args.endpoint, labels=args.label, model=models, prompts_file=args.prompts,
        num_prompts=args.num_prompts, max_tokens=args.max_tokens, concurrency=concurrency,
        temperature=args.temperature, ignore_eos=args.ignore_eos, warmup=args.warmup, timeout=args.timeout,
        log=lambda msg: tqdm.write(msg, file=sys.stderr), rounds=args.rounds, waves=args.waves,
        extra_body=json.loads(args.extra_body) if args.extra_body else None, api_key=args.api_key,
        request_rate=args.request_rate, burstiness=args.burstiness, seed=args.seed)
    print(format_result(result))
    if args.output_json:
        Path(args.output_json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output_json).write_text(json.dumps(result, indent=2) + "\n")
    if args.plot:
        write_plot(result, args.plot)
    failed = sum(r["failed"] for r in result["results"])
    return 1 if failed and not any(r["completed"] for r in result["results"]) else 0


def planned_memory(engine, k: int) -> dict:
    """The proposer's weights and KV cache (and the target's KV cache) as `rayspec plan` sizes them
    for this engine's config at draft length k; None where the planner cannot read the models."""
    try:
        from deployments.operations.plan import draft_shape, model_shape
        from rayspec.memory.plan import engine_plan

        config = engine.config
        config = dataclasses.replace(config, speculative=dataclasses.replace(config.speculative,
                                                                             num_speculative_tokens=k))
        target = model_shape(config.model, quantized_weights=config.quantized_weights)
        draft = draft_shape(config.speculative, config.model, target, config.quantized_weights)
        plan = engine_plan(config, target, engine.device.type, draft)
    except Exception as err:  # noqa: BLE001 - a figure missing, not a failed sweep
        return {"proposer_weights_bytes": None, "proposer_kv_bytes": None, "target_kv_bytes": None,
                "plan_error": f"{type(err).__name__}: {err}"}
    items = {item.name: item.bytes for item in plan.items}
    weights = sum(b for n, b in items.items() if n.endswith("weights") and not n.startswith("target"))
    kv = sum(b for n, b in items.items() if n.endswith("KV cache") and not n.startswith("target"))
    return {"proposer_weights_bytes": weights, "proposer_kv_bytes": kv, "target_kv_bytes": items.get("target KV cache")}
