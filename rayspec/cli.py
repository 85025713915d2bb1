"""The `rayspec` command: fetch-model, generate, serve, plan, kuberay, train, bench offline, bench sweep,
bench serve."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="smollm2-135m-instruct", help="hub id, directory, .gguf or the default")
    p.add_argument("--method", default="ngram", help="speculative method: none, ngram, draft_model")
    p.add_argument("--num-speculative-tokens", type=int, default=5)
    p.add_argument("--no-adaptive", action="store_true", help="always draft the full length")
    p.add_argument("--draft-model", default=None)
    p.add_argument("--draft-num-layers", type=int, default=None, help="keep only the first N draft layers")
    p.add_argument("--draft-quantization", default=None, choices=["int8"],
                   help="draft_model: weight-only int8 draft linears (vLLM: speculative_config quantization)")
    p.add_argument("--prompt-lookup-min", type=int, default=2)
    p.add_argument("--prompt-lookup-max", type=int, default=5)
    p.add_argument("--eagle-topk", type=int, default=1, help="eagle3/eagle: branching per tree node (1: a chain)")
    p.add_argument("--num-steps", type=int, default=None, help="eagle3/eagle: tree depth")
    p.add_argument("--eagle-stop-prob", type=float, default=0.0,
                   help="eagle3/eagle: stop drafting deeper when the frontier's path probability is below this")
    p.add_argument("--eagle-prompt-lookup", type=int, default=0,
                   help="eagle3/eagle: add an n-gram prompt-lookup branch of up to N tokens to greedy trees")
    p.add_argument("--disable-by-batch-size", type=int, default=None,
                   help="draft nothing in steps whose batch has at least this many sequences")


def cmd_fetch_model(args) -> int:
    from rayspec.weights.hub import convert_gguf, fetch_default_model

    path = convert_gguf(Path(args.gguf)) if args.gguf else fetch_default_model(force=args.force)
    print(path)
    return 0


def _structured(args):
    from rayspec.structured import StructuredOutput

    given = [x for x in (args.json_schema, args.regex, args.choice) if x]
    if len(given) > 1:
        raise SystemExit("give one of --json-schema, --regex, --choice")
    if args.json_schema:
        path = Path(args.json_schema)
        return StructuredOutput.json_schema(path.read_text() if path.is_file() else args.json_schema)
    if args.regex:
        return StructuredOutput("regex", args.regex)
    if args.choice:
        return StructuredOutput.choice(args.choice)
    return None


def cmd_generate(args) -> int:
    from rayspec.config import EngineConfig, SpeculativeConfig
    from rayspec.engine import LLMEngine
    from rayspec.sampling import SamplingParams

    spec = SpeculativeConfig(method=args.method, num_speculative_tokens=args.num_speculative_tokens,
                             adaptive=not args.no_adaptive, draft_model=args.draft_model,
                             draft_num_layers=args.draft_num_layers, draft_quantization=args.draft_quantization,
                             prompt_lookup_min=args.prompt_lookup_min,
                             prompt_lookup_max=args.prompt_lookup_max, eagle_topk=args.eagle_topk,
                             num_steps=args.num_steps, eagle_stop_prob=args.eagle_stop_prob,
                             eagle_prompt_lookup=args.eagle_prompt_lookup,
                             disable_by_batch_size=args.disable_by_batch_size)
    engine = LLMEngine(EngineConfig(model=args.model, speculative=spec))
    ids = engine.encode_chat([{"role": "user", "content": args.prompt}])
    engine.add_request(ids, SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed,
                                           structured=_structured(args)))
    start, n = time.perf_counter(), 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            sys.stdout.write(out.delta_text)
            sys.stdout.flush()
            n = len(out.token_ids)
    seconds = time.perf_counter() - start
    print(f"\n\n[{n} tokens in {seconds:.2f} s, {n / seconds:.1f} tok/s; {json.dumps(engine.stats.as_dict())}]",
          file=sys.stderr)
    return 0


def engine_flag_fields() -> list[tuple[str, type, object]]:
    """(name, type, default) of the engine settings `rayspec serve` takes as flags: every scalar field of
    rayspec.config.EngineConfig (the one list of them; the serve app's engine args mirror it)."""
    import dataclasses
    import typing

    from rayspec.config import EngineConfig

    hints = typing.get_type_hints(EngineConfig)
    fields = []
    for f in dataclasses.fields(EngineConfig):
        kinds = [t for t in typing.get_args(hints[f.name]) or (hints[f.name],) if t is not type(None)]
        if len(kinds) == 1 and kinds[0] in (int, float, str, bool) and f.name != "model":
            fields.append((f.name, kinds[0], f.default))
    return fields


def _add_engine_flags(parser, skip: tuple[str, ...] = ()) -> None:
    group = parser.add_argument_group("engine", "the config's engine settings (engine: in the app args)")
    for name, kind, default in engine_flag_fields():
        if name in skip:
            continue
        flag = "--" + name.replace("_", "-")
        if kind is bool:
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=None,
                               help=f"engine.{name} (default: {default})")
        else:
            group.add_argument(flag, type=kind, default=None, help=f"engine.{name} (default: {default})")


def serve_config(args) -> tuple:
    """`rayspec serve`'s arguments -> (AppArgs, host, port): the --config file's app args (a serve
    config's first application, either builder, or a flat mapping of args as vLLM's --config file),
    then MODEL and the flags over them. Ray and the deployments are imported here, not with the CLI."""
    import yaml

    from deployments.config import AppArgs
    from deployments.dialects import APP_IMPORT_PATHS, app_args_of
    from rayspec.assets import config_path

    host = port = None
    app_args: dict = {}
    if args.config:
        doc = yaml.safe_load(config_path(args.config).read_text()) or {}
        if not isinstance(doc, dict):
            raise ValueError(f"{args.config}: not a mapping")
        if "applications" in doc:
            apps = doc["applications"] or []
            found = app_args_of(apps[0]) if apps else None
            if found is None:
                raise ValueError(f"{args.config}: its first application is not a rayspec app "
                                 f"(import_path one of {list(APP_IMPORT_PATHS)})")
            app_args = dict(found)
            http = doc.get("http_options") or {}
            host, port = http.get("host"), http.get("port")
        else:  # the args themselves; vLLM's --config spells its flags' names with dashes too
            app_args = {k.replace("-", "_"): v for k, v in doc.items()}
            host, port = app_args.pop("host", None), app_args.pop("port", None)
    if args.model:
        if args.model != app_args.get("model"):
            app_args.pop("served_model_name", None)  # the config's name was its own model's
        app_args["model"] = args.model
    if args.served_model_name:
        app_args["served_model_name"] = args.served_model_name
    if args.speculative_config is not None:
        app_args.pop("speculative", None)
        app_args["speculative_config"] = args.speculative_config  # JSON text: AppArgs reads it
    for key, _, _ in engine_flag_fields():
        value = getattr(args, key)
        if value is not None:
            engine = dict(app_args.get("engine") or {})
            app_args.pop(key, None)  # given at the top level (vLLM's way) in the config: the flag wins
            engine[key] = value
            app_args["engine"] = engine
    if args.api_key:
        app_args["api_key"] = args.api_key
    cfg = AppArgs.model_validate(app_args)
    return cfg, args.host or host or "127.0.0.1", int(args.port or port or 8000)


SERVE_SHUTDOWN_S = 45  # how long Ctrl-C waits for Serve's own shutdown before the local Ray goes


def cmd_serve(args) -> int:
    import signal

    from pydantic import ValidationError

    try:
        cfg, host, port = serve_config(args)
    except (ValueError, OSError, ValidationError) as err:
        print(f"rayspec serve: {err}", file=sys.stderr)
        return 2
    import ray
    from ray import serve

    from deployments.app import build_app

    local = not args.address
    init = {"address": args.address or "local", "include_dashboard": False}
    if local and args.num_cpus is not None:
        init["num_cpus"] = args.num_cpus
    ray.init(**init)

    def stop(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    from deployments.api_key import exposure_warning
    from deployments.config import resolve_api_key

    warning = exposure_warning(host, resolve_api_key(cfg.api_key) is not None)
    if warning:
        print(f"rayspec serve: WARNING: {warning}", file=sys.stderr, flush=True)
    try:
        serve.start(http_options={"host": host, "port": port})
        serve.run(build_app(cfg), name=args.app_name, route_prefix="/")
        print(f"rayspec serve: {cfg.model_name} ({cfg.model}, {cfg.speculative.method}) on "
              f"http://{host}:{port}/v1; Ctrl-C stops", file=sys.stderr, flush=True)
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        if local:
            # bounded: Serve's graceful shutdown has taken minutes on a loaded 2-core machine; the
            # local Ray we started goes down with ray.shutdown() whatever Serve's state
            import threading

            ender = threading.Thread(target=serve.shutdown, name="serve-shutdown", daemon=True)
            ender.start()
            ender.join(SERVE_SHUTDOWN_S)
            if ender.is_alive():
                print(f"rayspec serve: Serve did not shut down in {SERVE_SHUTDOWN_S} s; stopping the local Ray",
                      file=sys.stderr, flush=True)
            ray.shutdown()
        else:  # a cluster we joined: take our app away, leave the rest
            serve.delete(args.app_name)
    return 0


def cmd_configs_dir(args) -> int:
    from rayspec.assets import configs_dir

    print(configs_dir())
    return 0


def cmd_plan(args) -> int:
    from deployments.plan import app_json, format_app, parse_size, plan_config
    from rayspec.weights.files import ModelNotFoundError

    try:
        gpu_memory = parse_size(args.gpu_memory) if args.gpu_memory else None
        apps = plan_config(args.config, args.app, fit=args.fit)
    except (ValueError, OSError, ModelNotFoundError) as err:  # a bad size, config or model: say which
        print(f"rayspec plan: {err}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps([app_json(app, gpu_memory) for app in apps], indent=2))
    else:
        print("\n\n".join(format_app(app, gpu_memory) for app in apps))
        print("\n(GB = 10^9 bytes, MB = 10^6; kv_cache_memory_gb is read as GiB = 2^30 bytes, as the engine does)")
    fits = [app.fits(gpu_memory) for app in apps if gpu_memory is not None and any(d.on_gpu for d in app.deployments)]
    return 0 if all(fits) else 1


def cmd_kuberay(args) -> int:
    from deployments.kuberay import render

    try:
        text = render(args.config, image=args.image, name=args.name, source=args.source, ref=args.ref)
    except (ValueError, OSError) as err:  # a bad config, or one that needs what no pod holds: say which
        print(f"rayspec kuberay: {err}", file=sys.stderr)
        return 2
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(text)
    else:
        sys.stdout.write(text)
    return 0


def cmd_train(args) -> int:
    from rayspec.eagle.pipeline import check_output, run
    from rayspec.eagle.train import TrainConfig

    cfg = TrainConfig(kind=args.kind, target=args.target, prompts=tuple(args.prompts), work_dir=args.work_dir,
                      output=args.output, overwrite=args.overwrite, max_prompts=args.max_prompts, max_new_tokens=args.max_new_tokens,
                      draft_vocab_size=args.draft_vocab_size, intermediate_size=args.intermediate_size,
                      ttt_steps=args.ttt_steps, epochs=args.epochs, lr=args.lr, batch_tokens=args.batch_tokens,
                      checkpoint_every=args.checkpoint_every, seed=args.seed, answers_only=args.answers_only,
                      init_head=args.init_head, warmup_steps=args.warmup_steps, grad_accum=args.grad_accum,
                      num_workers=args.num_workers, num_threads=args.num_threads, device=args.device,
                      target_dtype=args.target_dtype)
    try:
        cfg = check_output(cfg)
    except FileExistsError as err:
        print(f"rayspec train: {err}", file=sys.stderr)
        return 2
    print(f"rayspec train: the head goes to {cfg.output}", file=sys.stderr)
    print(run(cfg))
    return 0


def _ray_rank_launcher():
    """Tensor-parallel ranks as Ray actors (a local Ray instance unless RAY_ADDRESS names a cluster)."""
    import ray

    from deployments.tensor_parallel import RayRankLauncher

    if not ray.is_initialized():
        ray.init(include_dashboard=False, log_to_driver=False)
    return RayRankLauncher()


def cmd_bench_offline(args) -> int:
    from rayspec.bench.offline import format_result, run_offline_benchmark

    if args.num_threads:
        import torch

        torch.set_num_threads(args.num_threads)
    result = run_offline_benchmark(
        model=args.model, method=args.method, num_speculative_tokens=args.num_speculative_tokens,
        prompts_file=args.prompts, num_prompts=args.num_prompts, max_tokens=args.max_tokens,
        concurrency=args.concurrency, adaptive=not args.no_adaptive, draft_model=args.draft_model,
        draft_num_layers=args.draft_num_layers, draft_quantization=args.draft_quantization,
        prompt_lookup_min=args.prompt_lookup_min, prompt_lookup_max=args.prompt_lookup_max, with_hf=not args.no_hf,
        eagle_topk=args.eagle_topk, num_steps=args.num_steps, eagle_stop_prob=args.eagle_stop_prob,
        eagle_prompt_lookup=args.eagle_prompt_lookup, disable_by_batch_size=args.disable_by_batch_size,
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
    opts = MethodOptions(eagle_head=args.eagle_head, draft_model=args.draft_model,
                         draft_num_layers=args.draft_num_layers, draft_quantization=args.draft_quantization,
                         prompt_lookup_min=args.prompt_lookup_min, prompt_lookup_max=args.prompt_lookup_max,
                         eagle_topk=args.eagle_topk, num_steps=args.num_steps, eagle_stop_prob=args.eagle_stop_prob,
                         eagle_prompt_lookup=args.eagle_prompt_lookup, adaptive=not args.no_adaptive,
                         disable_by_batch_size=args.disable_by_batch_size)
    try:
        result = run_sweep(args.model, methods, ks, args.prompts, args.num_prompts, args.max_tokens, concurrency,
                           opts, temperature=args.temperature, seeded=not args.unseeded, device=args.device,
                           dtype=args.dtype,
                           engine_overrides=bench_engine_overrides(args))
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rayspec", description="lossless speculative decoding")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("fetch-model", help="put the default model (SmolLM2-135M-Instruct) in the local cache")
    p.add_argument("--gguf", default=None, help="convert this GGUF file instead")
    p.add_argument("--force", action="store_true")
    p.set_defaults(func=cmd_fetch_model)

    p = sub.add_parser("generate", help="generate from one chat prompt, streaming to stdout")
    _add_engine_args(p)
    p.add_argument("--prompt", required=True)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--json-schema", default=None, help="constrain the output to this JSON schema (a file or JSON text)")
    p.add_argument("--regex", default=None, help="constrain the output to this regex")
    p.add_argument("--choice", action="append", default=None, help="constrain the output to one of these (repeat)")
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("serve", help="serve a model behind OpenAI routes on a local Ray (as `vllm serve`)",
                       description="Build the Serve app (deployments.app:build_app) and run it on an embedded "
                                   "local Ray (or --address's cluster) until Ctrl-C. --config takes a serve config "
                                   "(its first application's args, either builder) or a flat mapping of app args; "
                                   "MODEL and the flags override it.")
    p.add_argument("model", nargs="?", default=None,
                   help="hub id, directory, .gguf or smollm2-135m-instruct (default: the config's, else that)")
    p.add_argument("--config", default=None,
                   help="a serve config YAML (configs/*.yaml; a shipped one by name too: `--config default`, "
                        "from any directory) or a YAML of app args")
    p.add_argument("--speculative-config", default=None,
                   help='vLLM\'s speculative_config as JSON, e.g. \'{"method": "ngram", "num_speculative_tokens": 5}\'')
    p.add_argument("--served-model-name", default=None, help="the name clients send (default: MODEL)")
    _add_engine_flags(p)
    p.add_argument("--api-key", default=None, help="require `Authorization: Bearer <key>` (or $RAYSPEC_API_KEY)")
    p.add_argument("--host", default=None,
                   help="default: the config's http_options, else 127.0.0.1 (0.0.0.0: every interface; set an API key)")
    p.add_argument("--port", type=int, default=None, help="default: the config's http_options, else 8000")
    p.add_argument("--address", default=None, help="a running Ray cluster to join instead of starting a local one")
    p.add_argument("--num-cpus", type=int, default=None, help="CPUs of the local Ray (default: all)")
    p.add_argument("--app-name", default="rayspec")
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("configs-dir", help="print the directory of the shipped serve configs (configs/*.yaml)",
                       description="The checkout's configs/, or the installed wheel's copy: "
                                   'serve run "$(rayspec configs-dir)/default.yaml" from any directory.')
    p.set_defaults(func=cmd_configs_dir)

    p = sub.add_parser("plan", help="memory per deployment and per GPU of a serve config, from config files alone",
                       description="Weights, KV cache, proposer weights and cache, peak forward activations (an "
                                   "upper bound) and the load peak of each deployment of a serve config, sized as "
                                   "the engine sizes itself, without loading weights (hub ids: config.json only). "
                                   "Exit status 1 when something does not fit --gpu-memory, 2 on errors.")
    p.add_argument("config", help="a serve config (configs/*.yaml)")
    p.add_argument("--gpu-memory", default=None,
                   help="GPU size to check against: 80GB (10^9 bytes), 80GiB (2^30 bytes), 24G (= 24GB)")
    p.add_argument("--app", default=None, help="only the application of this name")
    p.add_argument("--json", action="store_true", help="print JSON (bytes) instead of text")
    p.add_argument("--fit", action="store_true",
                   help="also plan the config at tensor_parallel_size 1, 2 and 4 against 80 GB and 141 GB GPUs "
                        "(always done for quantized checkpoints, whose stored and loaded sizes are shown)")
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser("kuberay", help="a KubeRay RayService manifest for a serve config",
                       description="Write a RayService (ray.io/v1): the serve config as serveConfigV2, an "
                                   "autoscaled Ray cluster with a CPU head that takes no work and worker groups "
                                   "for the resources the config's deployments ask for (target_node, draft_node, "
                                   "GPUs, CPUs). See deployments/kuberay/README.md.")
    p.add_argument("config", help="a serve config (configs/*.yaml), e.g. configs/cluster_eagle3.yaml")
    p.add_argument("--image", default=None,
                   help="container image (default: rayproject/ray:<ray version>-py311-gpu; rayspec is then "
                        "installed at pod start from --source)")
    p.add_argument("--source", default="", help="git URL of this repository, cloned and installed at pod start "
                                               "where the image lacks rayspec")
    p.add_argument("--ref", default="", help="branch, tag or commit of --source (default: its default branch)")
    p.add_argument("--name", default="rayspec", help="the RayService's name (Kubernetes DNS label)")
    p.add_argument("--output", default=None, help="write here instead of stdout")
    p.set_defaults(func=cmd_kuberay)

    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench", required=True)
    p = bench.add_parser("offline", help="in-process: rayspec baseline vs method vs HF transformers")
    _add_engine_args(p)
    p.add_argument("--prompts", required=True,
                   help="a bundled evaluation set (mt_bench, humaneval, gsm8k) or a Spec-Bench JSONL file")
    p.add_argument("--num-prompts", type=int, default=10)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--concurrency", type=int, default=1)
    p.add_argument("--no-hf", action="store_true", help="skip the HF transformers runs")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="0 (default): greedy; > 0: every system samples, prompt i from the same seed "
                        "(greedy_match is then null)")
    p.add_argument("--unseeded", action="store_true",
                   help="at temperature > 0, send requests without a seed, as most served ones come (cost-aware "
                        "drafting keeps a seeded request at the full draft budget: its stream must not depend on time)")
    p.add_argument("--num-threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--output-json", default=None)
    p.add_argument("--tensor-parallel-size", type=int, default=1,
                   help="split the target over N ranks (Ray actors; gloo on CPU, NCCL on GPUs); a TP=1 "
                        "target-only engine runs beside it for tp1_greedy_match and tp_vs_tp1")
    p.add_argument("--dtype", default=None, help="float32, bfloat16, float16 or auto (default: float32 on CPU)")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    _add_engine_flags(p, skip=BENCH_OWN_FLAGS)  # --compile, --kv-cache-memory-gb, --max-model-len, ...
    p.set_defaults(func=cmd_bench_offline)

    p = bench.add_parser(
        "sweep", help="in-process: speculative methods x num_speculative_tokens (x concurrency) vs the target alone",
        description="Offline (in-process engines sharing one target; served endpoints are not swept: use "
                    "`bench serve` per configuration). For each concurrency the baseline (target only) runs "
                    "every batch of prompts once, interleaved with every (method, k) on the same batch. Each "
                    "method's engine is built once with the largest k; a run at k caps its requests' drafts "
                    "at k (the per-request num_speculative_tokens); prefix caching is off unless --enable-prefix-caching "
                    "(later runs of the same prompts would find them cached). Prints a table of tok/s, speedup, "
                    "acceptance length, acceptance rate, acceptance by draft position, greedy match and the "
                    "proposer's memory (weights + KV cache as `rayspec plan` sizes them; the measured RSS "
                    "delta of building each method's engine is in the JSON); --output-json, --plot (PNG).")
    p.add_argument("--model", default="smollm2-135m-instruct", help="hub id, directory, .gguf or the default")
    p.add_argument("--methods", default="ngram,draft_model",
                   help="comma-separated: ngram, draft_model, eagle3, eagle (default: ngram,draft_model)")
    p.add_argument("--num-speculative-tokens", default="1,2,3,4,8", help="comma-separated draft lengths k")
    p.add_argument("--concurrency", default="1", help="comma-separated prompts in flight, e.g. 1,8")
    p.add_argument("--eagle-head", default=None,
                   help="eagle3/eagle: the head (default for SmolLM2: the shipped heads/smollm2-135m-eagle3)")
    p.add_argument("--draft-model", default=None, help="draft_model: the draft LM (default: the target, a self-draft)")
    p.add_argument("--draft-num-layers", type=int, default=None, help="draft_model: keep only the first N layers")
    p.add_argument("--draft-quantization", default=None, choices=["int8"],
                   help="draft_model: weight-only int8 draft linears")
    p.add_argument("--prompt-lookup-min", type=int, default=2)
    p.add_argument("--prompt-lookup-max", type=int, default=5)
    p.add_argument("--eagle-topk", type=int, default=1, help="eagle3/eagle: branching per tree node (1: a chain)")
    p.add_argument("--num-steps", type=int, default=None, help="eagle3/eagle: tree depth")
    p.add_argument("--eagle-stop-prob", type=float, default=0.0)
    p.add_argument("--eagle-prompt-lookup", type=int, default=0)
    p.add_argument("--no-adaptive", action="store_true", help="draft exactly k (default: the adaptive length, at most k)")
    p.add_argument("--disable-by-batch-size", type=int, default=None)
    p.add_argument("--prompts", required=True,
                   help="a bundled evaluation set (mt_bench, humaneval, gsm8k) or a Spec-Bench JSONL file")
    p.add_argument("--num-prompts", type=int, default=10)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0,
                   help="0 (default): greedy; > 0: sampled, prompt i seeded alike in every run (greedy_match null)")
    p.add_argument("--unseeded", action="store_true",
                   help="at temperature > 0, send requests without a seed, as most served ones come (cost-aware "
                        "drafting keeps a seeded request at the full draft budget: its stream must not depend on time)")
    p.add_argument("--num-threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--output-json", default=None)
    p.add_argument("--plot", default=None, help="PNG: tok/s, speedup and acceptance length vs k, acceptance by "
                                                 "draft position at the largest k")
    p.add_argument("--dtype", default=None, help="float32, bfloat16, float16 or auto (default: float32 on CPU)")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    _add_engine_flags(p, skip=BENCH_OWN_FLAGS)
    p.set_defaults(func=cmd_bench_sweep)

    p = sub.add_parser("train", help="train a draft head by self-distillation").add_subparsers(
        dest="kind", required=True)
    for kind in ("eagle3", "eagle"):
        t = p.add_parser(kind, help=f"train an {kind} head for a target model")
        t.add_argument("--target", default="smollm2-135m-instruct")
        t.add_argument("--prompts", nargs="+", required=True,
                       help="JSONL prompt files (Spec-Bench `turns` or GSM8K-style `question`); FILE:N takes N at random")
        t.add_argument("--work-dir", required=True, help="answers, features, checkpoints (resumable)")
        t.add_argument("--output", default=None,
                       help=f"where the head is written (default: a new runs/{kind}-YYYYmmdd-HHMMSS); "
                            "an existing non-empty directory is refused unless --overwrite")
        t.add_argument("--overwrite", action="store_true", help="write the head into a non-empty --output")
        t.add_argument("--max-prompts", type=int, default=None)
        t.add_argument("--max-new-tokens", type=int, default=192)
        t.add_argument("--draft-vocab-size", type=int, default=4096)
        t.add_argument("--intermediate-size", type=int, default=None)
        t.add_argument("--ttt-steps", type=int, default=3)
        t.add_argument("--epochs", type=int, default=2)
        t.add_argument("--lr", type=float, default=1e-3)
        t.add_argument("--batch-tokens", type=int, default=4096)
        t.add_argument("--checkpoint-every", type=int, default=100)
        t.add_argument("--warmup-steps", type=int, default=50)
        t.add_argument("--init-head", default=None,
                       help="train further from this head (its weights, shape and draft vocabulary; "
                            "--intermediate-size is then ignored, and a --draft-vocab-size larger than "
                            "the head's grows its draft vocabulary by the data's most frequent tokens)")
        t.add_argument("--grad-accum", type=int, default=1, help="batches per worker per optimizer step")
        t.add_argument("--num-workers", type=int, default=1,
                       help="> 1: train data-parallel on that many Ray Train workers, one GPU each where the "
                            "cluster has GPUs, else CPU (joins the running Ray cluster; the work dir must be on "
                            "storage they all see)")
        t.add_argument("--device", choices=("cpu", "cuda"), default=None,
                       help="where the target and the head run (default: CUDA where there is a GPU, else CPU)")
        t.add_argument("--target-dtype", default=None,
                       help="the target's dtype for answers and features (default: bfloat16 on CUDA, "
                            "float32 on CPU); the head always trains in float32")
        t.add_argument("--num-threads", type=int, default=None, help="torch CPU threads (per worker)")
        t.add_argument("--seed", type=int, default=0)
        t.add_argument("--answers-only", action="store_true",
                       help="loss only on positions whose next token the target wrote (not the user's)")
        t.set_defaults(func=cmd_train)

    p = bench.add_parser("serve", help="streaming chat requests against running OpenAI-compatible endpoints")
    p.add_argument("--endpoint", action="append", required=True,
                   help="base URL, e.g. http://localhost:8000 (repeat to compare endpoints side by side)")
    p.add_argument("--label", action="append", default=None, help="name for each --endpoint, in order (repeat)")
    p.add_argument("--model", action="append", default=None,
                   help="served model name (default smollm2-135m-instruct): once for every endpoint, or once "
                        "per --endpoint in order (a peer server serving the model under another name)")
    p.add_argument("--prompts", required=True,
                   help="a bundled evaluation set (mt_bench, humaneval, gsm8k) or a Spec-Bench JSONL file "
                        "(turns[0] is the user message)")
    p.add_argument("--num-prompts", type=int, default=10)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--concurrency", default="1,2,4,8",
                   help="comma-separated sweep of requests in flight (with --request-rate: the cap on them, "
                        "vLLM's --max-concurrency)")
    p.add_argument("--request-rate", type=float, default=float("inf"),
                   help="requests per second, arriving as a Poisson process (gamma with --burstiness), as vLLM's "
                        "bench serve; inf (default): closed loop, the next request as soon as one finishes")
    p.add_argument("--burstiness", type=float, default=1.0,
                   help="shape of the gamma-distributed gaps between arrivals (1: Poisson; lower: burstier)")
    p.add_argument("--seed", type=int, default=0, help="seed of the arrival times")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--ignore-eos", action="store_true", help="ask the server to always decode max-tokens")
    p.add_argument("--extra-body", default=None,
                   help='JSON merged into every request body, e.g. \'{"response_format": {"type": "json_object"}}\'')
    p.add_argument("--api-key", default=None,
                   help="sent as `Authorization: Bearer <key>` (default: $RAYSPEC_API_KEY, else $OPENAI_API_KEY)")
    p.add_argument("--warmup", type=int, default=1, help="warm-up requests per endpoint before the sweep")
    p.add_argument("--timeout", type=float, default=600.0, help="per-request timeout in seconds")
    p.add_argument("--rounds", type=int, default=1,
                   help="repeat each level this many times, endpoints taking turns in a rotating order "
                        "(sums tokens and time)")
    p.add_argument("--waves", type=int, default=0,
                   help="send at least this many x concurrency requests per level (prompts repeated), so a "
                        "level runs at its concurrency instead of draining (0: each prompt once)")
    p.add_argument("--output-json", default=None)
    p.add_argument("--plot", default=None, help="PNG: output tok/s, mean TTFT, mean TPOT and acceptance rate vs "
                                                 "concurrency")
    p.set_defaults(func=cmd_bench_serve)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
