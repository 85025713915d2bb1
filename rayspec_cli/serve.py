"""Subcommands over a serve config: serve (a local Ray, or a cluster), plan (memory and resources per
deployment), kuberay (a RayService manifest). Ray and the deployments are imported inside the
commands, so the other subcommands start without them."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from rayspec_cli.flags import engine_flag_fields


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
    if args.api_key and args.api_key_file:
        raise ValueError("give --api-key or --api-key-file, not both")
    if args.api_key_file:
        key = Path(args.api_key_file).expanduser().read_text().strip().splitlines()
        if not key or not key[0].strip():
            raise ValueError(f"{args.api_key_file} holds no key")
        app_args["api_key"] = key[0].strip()
    elif args.api_key:
        app_args["api_key"] = args.api_key
    if args.allow_unauthenticated:
        app_args["allow_unauthenticated"] = True
    cfg = AppArgs.model_validate(app_args)
    return cfg, args.host or host or "127.0.0.1", int(args.port or port or 8000)


# Serve's end-to-end deadline for one HTTP request (its proxy answers 408 past it): longer than any
# generation the shipped configs allow (max_model_len tokens at a few tokens per second on CPU)
REQUEST_TIMEOUT_S = 1800


SERVE_SHUTDOWN_S = 45  # how long Ctrl-C waits for Serve's own shutdown before the local Ray goes
RAY_SHUTDOWN_S = 30  # then for ray.shutdown() before the process leaves without it


def _finished_within(fn, seconds: float) -> bool:
    """fn() in a daemon thread; whether it returned within `seconds` (if not, it is left running)."""
    import threading

    thread = threading.Thread(target=fn, name=getattr(fn, "__name__", "stop"), daemon=True)
    thread.start()
    thread.join(seconds)
    return not thread.is_alive()


PROXY_CHECK_S = 60  # how long `rayspec serve` waits for Serve's proxy to answer on its port once the app runs


def _port_taken(host: str, port: int) -> str | None:
    """Why `host:port` cannot be served (None: it can), checked before Ray starts."""
    import socket

    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as Serve's proxy (uvicorn) binds
        try:
            s.bind((host, port))
        except OSError as err:
            return f"cannot listen on {host}:{port} ({err.strerror or err}): choose another --port"
    return None


def _proxy_problem(host: str, port: int, seconds: float) -> str | None:
    """None once Serve's proxy answers on host:port with this app's route ("/" in its /-/routes);
    otherwise what answered instead. (Serve starts its proxy even where the port was taken
    meanwhile, e.g. by one of Ray's own processes, and serve.run returns all the same.)"""
    import urllib.error
    import urllib.request

    where = "127.0.0.1" if host in ("0.0.0.0", "") else ("::1" if host == "::" else host)
    url = f"http://{where if ':' not in where else f'[{where}]'}:{port}/-/routes"
    deadline, problem = time.monotonic() + seconds, None
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # this machine's port, never via $http_proxy
    while True:
        try:
            with opener.open(url, timeout=10) as resp:
                routes = json.loads(resp.read() or b"{}")
            if isinstance(routes, dict) and "/" in routes:
                return None
            problem = f"{url} answered {routes!r}, not this app's route"
        except (urllib.error.URLError, OSError, ValueError) as err:  # (http.client's errors are OSErrors)
            problem = f"{url}: {err}"
        if time.monotonic() > deadline:
            return problem
        time.sleep(0.5)


def cmd_serve(args) -> int:
    import signal

    from pydantic import ValidationError

    try:
        cfg, host, port = serve_config(args)
    except (ValueError, OSError, ValidationError) as err:
        print(f"rayspec serve: {err}", file=sys.stderr)
        return 2
    from deployments.config import resolve_api_key
    from deployments.frontend.api_key import exposure_warning

    warning = exposure_warning(host, resolve_api_key(cfg.api_key) is not None)
    if warning and not cfg.allow_unauthenticated:  # fail closed, before anything starts
        print(f"rayspec serve: {warning}; or --allow-unauthenticated to serve them without one", file=sys.stderr)
        return 2
    if warning:
        print(f"rayspec serve: WARNING: {warning}", file=sys.stderr, flush=True)
    import ray
    from ray import serve

    from deployments.app import build_app

    local = not args.address
    taken = _port_taken(host, port) if local else None  # (joining a cluster: its Serve may hold the port already)
    if taken:
        print(f"rayspec serve: {taken}", file=sys.stderr)
        return 2
    from deployments.frontend.proxy_guard import install_env

    install_env()  # Serve's proxies bounded (deployments/frontend/proxy_guard.py): they inherit this environment
    init = {"address": args.address or "local", "include_dashboard": False}
    if local and args.num_cpus is not None:
        init["num_cpus"] = args.num_cpus
    ray.init(**init)

    def stop(signum, frame):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    # SIGINT too, explicitly: a process started from a shell's background job (`cmd &`, a CI
    # script) inherits SIGINT ignored, and Python then installs no KeyboardInterrupt handler
    signal.signal(signal.SIGINT, stop)
    try:
        serve.start(http_options={"host": host, "port": port, "request_timeout_s": REQUEST_TIMEOUT_S})
        serve.run(build_app(cfg), name=args.app_name, route_prefix="/")
        problem = _proxy_problem(host, port, PROXY_CHECK_S)
        if problem:
            print(f"rayspec serve: the app runs but Serve's HTTP proxy does not answer on {host}:{port}: {problem}",
                  file=sys.stderr, flush=True)
            return 1  # (after the finally below: Serve and the local Ray stopped)
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
            if _finished_within(serve.shutdown, SERVE_SHUTDOWN_S):
                print("rayspec serve: Serve shut down; stopping the local Ray", file=sys.stderr, flush=True)
            else:
                print(f"rayspec serve: Serve did not shut down in {SERVE_SHUTDOWN_S} s; stopping the local Ray",
                      file=sys.stderr, flush=True)
            # ray.shutdown() can block behind a serve.shutdown() still running in its thread: bounded
            # too. The local Ray's processes die with this one (Ray starts them with the parent-death
            # signal), so leaving at once loses nothing
            if not _finished_within(ray.shutdown, RAY_SHUTDOWN_S):
                print(f"rayspec serve: the local Ray did not stop in {RAY_SHUTDOWN_S} s; leaving without it",
                      file=sys.stderr, flush=True)
                os._exit(0)
        else:  # a cluster we joined: take our app away, leave the rest
            serve.delete(args.app_name)
    return 0


def cmd_plan(args) -> int:
    from deployments.operations.plan import app_json, format_app, parse_size, plan_config
    from rayspec.model.weights.files import ModelNotFoundError

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
    from deployments.operations.kuberay import render

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
