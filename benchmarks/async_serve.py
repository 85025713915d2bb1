"""Issue 20: asynchronous drafting against its synchronous twins, served and interleaved.

Starts a Ray instance of its own (`address="local"`, stopped at the end: no `ray start` / `ray stop`,
which would reach other Ray instances on the machine), deploys every application of a Serve config
(benchmarks/async_eagle_bench.yaml: /sync, /async, /sync2), runs `rayspec bench serve` on each prompt
set with the endpoints taking turns, and writes each app's step-time breakdown beside the bench
JSONs ({out}/{tag}_stats.json):
  - every app: engine steps, step and drafting time per step (/v1/stats `step_seconds`, the engine's
    `propose_seconds`), so B = step / (step - draft) of a synchronous app, and the acceptance length;
  - an asynchronous app: the proposer replica's side of the same calls (its `stats()`: time inside
    a call, on calls answered from the cache alone, waiting for a forward in flight, hits by rank,
    accepted tokens after hits and after misses) against the verifier's view (`proposer_call_seconds`).

    python benchmarks/async_serve.py benchmarks/async_eagle_bench.yaml --apps sync async sync2 \
        --num-prompts 5 --concurrency 1 --tag served_eagle3_async_vs_sync_c1
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import time
from pathlib import Path

import httpx
import yaml

SETS = ("mt_bench", "humaneval", "gsm8k")
BASE = "http://127.0.0.1:8000"


def app_stats(app: str) -> dict:
    s = httpx.get(f"{BASE}/{app}/v1/stats", timeout=30).json()
    steps, step_s, draft_s = s.get("num_steps", 0), s.get("step_seconds", 0.0), s.get("propose_seconds", 0.0)
    out = {"num_steps": steps, "step_ms": 1e3 * step_s / max(1, steps), "draft_ms": 1e3 * draft_s / max(1, steps),
           "overlap_bound": step_s / max(1e-9, step_s - draft_s),
           "mean_acceptance_length": s.get("mean_acceptance_length"), "server": s}
    if "proposer_calls" in s:
        from ray import serve

        p = serve.get_deployment_handle("Proposer", app_name=app).stats.remote().result(timeout_s=30)
        out["proposer"] = p
        out["call_ms_verifier"] = 1e3 * s["proposer_call_seconds"] / max(1, s["proposer_calls"])
        out["hit_call_ms_verifier"] = 1e3 * s.get("proposer_hit_call_seconds", 0.0) / max(1, s.get("proposer_hit_calls", 0))
        out["call_ms_in_proposer"] = 1e3 * p.get("in_proposer_call_seconds", 0.0) / max(1, p.get("num_calls", 0))
        out["hit_call_ms_in_proposer"] = 1e3 * p.get("in_proposer_hit_call_seconds", 0.0) / max(1, p.get("hit_calls", 0))
        out["miss_draft_ms"] = 1e3 * p.get("miss_draft_seconds", 0.0) / max(1, p.get("speculation_cache_misses", 0))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("config")
    p.add_argument("--apps", nargs="+", default=["sync", "async"])
    p.add_argument("--num-prompts", type=int, default=5)
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--concurrency", default="1")
    p.add_argument("--waves", type=int, default=1)
    p.add_argument("--rounds", type=int, default=1,
                   help="rounds per set, the apps taking turns in a rotating order (sync, async; async, sync; ...)")
    p.add_argument("--sets", default=",".join(SETS))
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--tag", default="async")
    a = p.parse_args()

    import ray
    from ray import serve

    from deployments.app import build_app

    from deployments.config import load_app_args
    from deployments.operations.resources import resource_plan

    doc = yaml.safe_load(Path(a.config).read_text())
    specs = [spec for spec in doc["applications"] if spec["name"] in a.apps]
    # the apps are deployed side by side but take turns: Ray's logical CPUs are what `rayspec plan`
    # counts for all of them together, each app's own count fitting this machine (no more than that)
    cpus = math.ceil(sum(resource_plan(load_app_args(spec["args"])).cpus() for spec in specs))
    print(f"Ray logical CPUs: {cpus:g} (the apps' num_cpus summed)", flush=True)
    ray.init(address="local", num_cpus=cpus, num_gpus=0, include_dashboard=False, log_to_driver=False)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": 8000})
        for spec in specs:
            serve.run(build_app(spec["args"]), name=spec["name"], route_prefix=spec["route_prefix"])
        for app in a.apps:
            while httpx.get(f"{BASE}/{app}/v1/models", timeout=30).status_code != 200:
                time.sleep(2)
        Path(a.out).mkdir(parents=True, exist_ok=True)
        endpoints = [x for app in a.apps for x in ("--endpoint", f"{BASE}/{app}", "--label", app)]
        for name in a.sets.split(","):
            subprocess.run(["rayspec", "bench", "serve", *endpoints, "--prompts", name, "--num-prompts",
                            str(a.num_prompts), "--max-tokens", str(a.max_tokens), "--concurrency", a.concurrency,
                            "--rounds", str(a.rounds), "--waves", str(a.waves), "--output-json",
                            f"{a.out}/{a.tag}_{name}.json"], check=True)
        stats = {app: app_stats(app) for app in a.apps}
        Path(f"{a.out}/{a.tag}_stats.json").write_text(json.dumps(stats, indent=1))
        for app, s in stats.items():
            print(app, {k: round(v, 3) if isinstance(v, float) else v for k, v in s.items()
                        if k not in ("server", "proposer")})
    finally:
        serve.shutdown()
        ray.shutdown()


if __name__ == "__main__":
    main()
