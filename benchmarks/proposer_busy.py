"""How busy one verifier keeps its proposer (the ratio behind sizing the proposer pool,
deployments/README.md "Two pools, two signals"): configs/eagle3_disaggregated.yaml on this machine
(GPU fractions dropped), streamed chat requests at each concurrency, then the verifier's
proposer_call_seconds / step_seconds and the proposer's own drafting time over the run.

    python benchmarks/proposer_busy.py --concurrency 1 4 --num-prompts 4 --max-tokens 96 \
        --json benchmarks/results/proposer_busy.json
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from rayspec.bench.prompts import load_prompts  # noqa: E402


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        return next(line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name"))
    except Exception:  # noqa: BLE001
        return platform.processor()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", default=str(REPO / "configs" / "eagle3_disaggregated.yaml"))
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--num-prompts", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--prompts", default="mt_bench", help="a bundled set or a Spec-Bench JSONL")
    parser.add_argument("--json")
    opts = parser.parse_args()

    import ray
    from ray import serve

    from deployments.app import build_app

    args = yaml.safe_load(open(opts.config))["applications"][0]["args"]
    for role in ("verifier", "proposer"):
        args.get(role, {}).get("ray_actor_options", {}).pop("num_gpus", None)
    prompts = load_prompts(opts.prompts, opts.num_prompts)
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    serve.start(http_options={"host": "127.0.0.1", "port": 8123})
    serve.run(build_app(args), name="rayspec", route_prefix="/")
    url = "http://127.0.0.1:8123"
    model = args.get("served_model_name") or args["model"]

    def ask(prompt: str) -> None:
        body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": opts.max_tokens,
                "temperature": 0}
        r = httpx.post(url + "/v1/chat/completions", json=body, timeout=600)
        r.raise_for_status()

    ask("warm up")
    proposer = serve.get_deployment_handle("Proposer", "rayspec")
    rows = []
    for c in opts.concurrency:
        before = httpx.get(url + "/v1/stats").json()
        p_before = proposer.stats.remote().result()
        started = time.perf_counter()
        with ThreadPoolExecutor(c) as pool:
            list(pool.map(ask, [p for p in prompts for _ in range(max(1, c // len(prompts)))][: max(c, len(prompts))]))
        wall = time.perf_counter() - started
        after = httpx.get(url + "/v1/stats").json()
        p_after = proposer.stats.remote().result()
        v_before, v_after = before.get("verifier", before), after.get("verifier", after)
        step = v_after["step_seconds"] - v_before["step_seconds"]
        call = v_after["proposer_call_seconds"] - v_before["proposer_call_seconds"]
        drafting = p_after["propose_seconds"] - p_before["propose_seconds"]
        rows.append({"concurrency": c, "wall_s": round(wall, 2), "step_seconds": round(step, 3),
                     "proposer_call_seconds": round(call, 3), "propose_seconds_in_proposer": round(drafting, 3),
                     "b_call_over_step": round(call / step, 3) if step else None,
                     "drafting_over_wall": round(drafting / wall, 3)})
        print(rows[-1], flush=True)
    result = {"config": opts.config, "cpu_model": cpu_model(), "rows": rows}
    if opts.json:
        Path(opts.json).write_text(json.dumps(result, indent=2))
    serve.shutdown()
    ray.shutdown()


if __name__ == "__main__":
    main()
