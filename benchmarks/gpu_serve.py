"""benchmarks/gpu.sh's server side: one serve config's app as EAGLE-3 and as its own baseline.

  python benchmarks/gpu_serve.py info  --config C        JSON: names and resolved model dirs
  python benchmarks/gpu_serve.py fetch --config C        download / find target and head, or say why not
  python benchmarks/gpu_serve.py serve --config C --apps eagle3,baseline --port P [--num-gpus G]

`serve` starts a Ray of its own (never joins a running one), deploys each named app at
/<name> on port P, prints "ready" once deployed and runs until SIGTERM or SIGINT, then shuts
Serve and its Ray down. The baseline is the config's app with speculation off (method none):
the same engine settings by construction, so no second config file can drift from the first.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from pathlib import Path

import yaml

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT))  # `deployments` is a top-level package of the repository

APPS = ("eagle3", "baseline")


def config_app_args(path: str) -> dict:
    """The app args of the serve config's first application (either builder)."""
    from deployments.dialects import app_args_of

    doc = yaml.safe_load(Path(path).read_text()) or {}
    apps = doc.get("applications") or []
    found = app_args_of(apps[0]) if apps else None
    if found is None:
        raise ValueError(f"{path}: its first application is not a rayspec app")
    return dict(found)


def app_args(config: str, app: str, num_gpus: float | None = None, kv_cache_memory_gb: float | None = None,
             num_cpus: float | None = None, full_drafts: bool = False) -> dict:
    """The args of one app: the config's (eagle3) or the config's with speculation off (baseline),
    with the verifier's GPU share, CPU share and KV budget overridden where given. full_drafts:
    cost-aware drafting off (every step drafts its whole budget), so a short CPU dry run goes
    through drafting and verification even where the planner would find drafting does not pay."""
    if app not in APPS:
        raise ValueError(f"unknown app {app!r}: one of {APPS}")
    args = config_app_args(config)
    if app == "baseline":
        args["speculative"] = {"method": "none"}
    elif (args.get("speculative") or {}).get("method") in (None, "none"):
        raise ValueError(f"{config}: its app has no speculative method to compare with the baseline")
    elif full_drafts:
        args["speculative"] = {**args["speculative"], "adaptive": False}
    verifier = dict(args.get("verifier") or {})
    options = dict(verifier.get("ray_actor_options") or {})
    if num_gpus is not None:
        options["num_gpus"] = num_gpus
    if num_cpus is not None:
        options["num_cpus"] = num_cpus
    verifier["ray_actor_options"] = options
    args["verifier"] = verifier
    if kv_cache_memory_gb is not None:
        args["engine"] = {**(args.get("engine") or {}), "kv_cache_memory_gb": kv_cache_memory_gb}
    return args


def info(config: str) -> dict:
    """What the shell script needs to name the endpoints and start a peer on the same weights."""
    from deployments.config import AppArgs

    cfg = AppArgs.model_validate(app_args(config, "eagle3"))
    spec = cfg.speculative
    return {"model": cfg.model, "served_model_name": cfg.model_name, "draft_model": spec.draft_model,
            "method": spec.method, "num_speculative_tokens": spec.num_speculative_tokens,
            "max_model_len": cfg.engine.max_model_len, "dtype": cfg.engine.dtype}


def fetch(config: str) -> dict:
    """Resolve (download where needed) the target and the head: local directories, or an error that
    says what is missing. Run before serving, so a slow download is not under the ready timeout."""
    from huggingface_hub import get_token

    from rayspec.model.weights.hub import resolve_model_dir

    names = info(config)
    dirs = {}
    for key in ("model", "draft_model"):
        if names[key]:
            dirs[key + "_dir"] = str(resolve_model_dir(names[key]).resolve())
    return {**names, **dirs, "hf_token_set": bool(get_token())}


def serve_apps(config: str, apps: list[str], port: int, num_gpus: float | None, kv_cache_memory_gb: float | None,
               num_cpus: float | None, ray_num_cpus: int | None, full_drafts: bool = False) -> int:
    import ray
    from ray import serve

    from deployments.app import build_app

    built = [(app, app_args(config, app, num_gpus, kv_cache_memory_gb, num_cpus, full_drafts)) for app in apps]

    def stop(signum, frame):
        raise KeyboardInterrupt

    init = {"address": "local", "include_dashboard": False, "log_to_driver": False}
    if ray_num_cpus:
        init["num_cpus"] = ray_num_cpus
    ray.init(**init)
    signal.signal(signal.SIGTERM, stop)  # after ray.init, which installs a handler of its own
    signal.signal(signal.SIGINT, stop)  # (a background job inherits SIGINT ignored)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        for app, args in built:
            serve.run(build_app(args), name=app, route_prefix=f"/{app}")
        print(f"ready: {', '.join(f'http://127.0.0.1:{port}/{app}' for app in apps)}", flush=True)
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        serve.shutdown()
        ray.shutdown()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("info", "fetch"):
        sub.add_parser(name).add_argument("--config", required=True, help="a serve config whose first app speculates")
    p = sub.add_parser("serve")
    p.add_argument("--config", required=True, help="a serve config whose first app speculates")
    p.add_argument("--apps", default=",".join(APPS), help="comma-separated, of: " + ", ".join(APPS))
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--num-gpus", type=float, default=None, help="each verifier's GPU share (default: the config's)")
    p.add_argument("--num-cpus", type=float, default=None, help="each verifier's CPU share (default: the config's)")
    p.add_argument("--kv-cache-memory-gb", type=float, default=None, help="default: the config's")
    p.add_argument("--ray-num-cpus", type=int, default=None, help="logical CPUs of the Ray started here")
    p.add_argument("--full-drafts", action="store_true",
                   help="cost-aware drafting off: every step drafts its whole budget (gpu.sh --dry-run)")
    args = parser.parse_args(argv)
    if args.command == "serve":
        return serve_apps(args.config, [a for a in args.apps.split(",") if a], args.port, args.num_gpus,
                          args.kv_cache_memory_gb, args.num_cpus, args.ray_num_cpus, args.full_drafts)
    from rayspec.model.weights.files import ModelNotFoundError

    try:
        print(json.dumps(info(args.config) if args.command == "info" else fetch(args.config)))
    except (ValueError, OSError, ModelNotFoundError) as err:
        print(f"gpu_serve.py {args.command}: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
