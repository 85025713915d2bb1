#!/usr/bin/env python
"""Start every CPU-only serve config in configs/ as a user would, `serve run configs/NAME.yaml`
(an embedded local Ray cluster with Ray's detected resources: nothing inflated), and check that it
answers: GET /health 200, then one chat completion (4 tokens, greedy) 200 with text. One config at
a time; each server is stopped with SIGINT (Ctrl-C) and must exit.

    python scripts/check_configs.py                      # all CPU-only configs, results to stdout
    python scripts/check_configs.py default baseline     # some of them
    python scripts/check_configs.py --out benchmarks/results/config_health.json
    python scripts/check_configs.py --dry-run            # which configs, and does each fit this machine

A config is CPU-only when none of its deployments asks Ray for a GPU, even at its autoscaling
maximum (deployments.operations.plan.cpu_only_configs). --dry-run starts nothing: it lists them
with what they ask Ray for against this machine (`rayspec plan`'s count) and fails if one does not fit.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from deployments.config import load_app_args  # noqa: E402
from deployments.operations.plan import cpu_only_configs, read_serve_config  # noqa: E402
from deployments.operations.resources import Machine, resource_plan  # noqa: E402
from rayspec.bench.environment import environment  # noqa: E402

PORT = 8000  # Serve's default, which the shipped configs keep


def port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def http(method: str, url: str, body: dict | None = None, timeout: float = 10.0) -> tuple[int, str]:
    import httpx

    try:
        r = httpx.request(method, url, json=body, timeout=timeout)
    except httpx.HTTPError as err:
        return 0, f"{type(err).__name__}: {err}"
    return r.status_code, r.text


def model_name(args: dict) -> str:
    return load_app_args(args).model_name


def check(path: Path, timeout_s: float) -> dict:
    """Serve one config, wait for /health 200 and one completion, stop it: a result row."""
    (_, args), *_ = read_serve_config(path)
    row: dict = {"config": path.name, "cpus_asked": resource_plan(load_app_args(args)).cpus()}
    if not port_free(PORT):
        return {**row, "ok": False, "error": f"port {PORT} is taken before the start"}
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS",)}
    serve_bin = Path(sys.executable).with_name("serve")
    start = time.monotonic()
    log = open(Path(os.environ.get("TMPDIR", "/tmp")) / f"check_configs_{path.stem}.log", "w")
    # SIGINT back to its default in the server: started from a background job (`cmd &`, CI), this
    # script inherits it ignored, and Python then installs no KeyboardInterrupt for Ctrl-C
    proc = subprocess.Popen([str(serve_bin), "run", str(path)], cwd=REPO, env=env, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    row["log"] = log.name
    try:
        base = f"http://127.0.0.1:{PORT}"
        status = 0
        while time.monotonic() - start < timeout_s and proc.poll() is None:
            status, _ = http("GET", f"{base}/health", timeout=5)
            if status == 200:
                break
            time.sleep(1.0)
        row["health_status"] = status
        if status != 200:
            row["error"] = ("exited " + str(proc.returncode)) if proc.poll() is not None else f"no /health 200 in {timeout_s:.0f} s"
            return {**row, "ok": False}
        row["health_s"] = round(time.monotonic() - start, 1)
        t = time.monotonic()
        status, text = http("POST", f"{base}/v1/chat/completions", {
            "model": model_name(args), "max_tokens": 4, "temperature": 0,
            "messages": [{"role": "user", "content": "Say hello."}]}, timeout=180)
        row["completion_status"], row["completion_s"] = status, round(time.monotonic() - t, 1)
        content = json.loads(text)["choices"][0]["message"]["content"] if status == 200 else ""
        row["ok"] = status == 200 and bool(content.strip())
        if not row["ok"]:
            row["error"] = text[:500]
        return row
    finally:
        t = time.monotonic()
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGINT)
            try:
                proc.wait(timeout=90)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                row["ok"], row["error"] = False, "did not exit within 90 s of SIGINT"
        row["stop_s"] = round(time.monotonic() - t, 1)
        log.close()
        subprocess.run([str(Path(sys.executable).with_name("ray")), "stop", "--force"], capture_output=True, timeout=120)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("configs", nargs="*", help="names in configs/ (default: every CPU-only one)")
    ap.add_argument("--timeout", type=float, default=420.0, help="seconds to /health 200 per config")
    ap.add_argument("--out", help="write the results as JSON here")
    ap.add_argument("--dry-run", action="store_true", help="list the configs and their fit; start nothing")
    opts = ap.parse_args(argv)
    paths = cpu_only_configs(REPO / "configs")
    if opts.configs:
        wanted = {c if c.endswith(".yaml") else f"{c}.yaml" for c in opts.configs}
        unknown = wanted - {p.name for p in paths}
        if unknown:
            ap.error(f"not CPU-only configs in configs/: {sorted(unknown)} (they are: {[p.name for p in paths]})")
        paths = [p for p in paths if p.name in wanted]
    machine = Machine.detected()
    if opts.dry_run:
        bad = 0
        for p in paths:
            plans = [resource_plan(load_app_args(a)) for _, a in read_serve_config(p)]
            cpus, fits = sum(plan.cpus() for plan in plans), all(plan.fits(machine) for plan in plans)
            bad += not fits
            print(f"{p.name}: asks {cpus:g} CPUs; this machine has {machine.cpus:g}: {'fits' if fits else 'does not fit'}")
        return 1 if bad else 0
    rows = []
    for p in paths:
        row = check(p, opts.timeout)
        rows.append(row)
        print(json.dumps(row), flush=True)
    for row in rows:
        row.pop("log", None)  # a path on the machine that ran it
    result = {"command": "python scripts/check_configs.py " + " ".join(argv if argv is not None else sys.argv[1:]),
              "environment": environment(), "date": time.strftime("%Y-%m-%d"), "results": rows}
    if opts.out:
        Path(opts.out).write_text(json.dumps(result, indent=1) + "\n")
    failed = [r["config"] for r in rows if not r["ok"]]
    print(f"{len(rows) - len(failed)} of {len(rows)} configs answered" + (f"; failed: {failed}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
