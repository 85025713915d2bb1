"""`rayspec serve MODEL --config FILE` in a process of its own, with a local Ray cluster of its own (tier
cluster). Our users' dialect configs served on the shared cluster: tests/serve/test_dialect_config_served.py."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import yaml

from serve_utils import free_port, tiny_args

REPO = Path(__file__).resolve().parents[2]


def test_rayspec_serve_runs(tiny_model_dir, tmp_path, own_cluster):
    """`rayspec serve MODEL --config FILE` in a process of its own: a local Ray, the app, /v1/models;
    SIGINT stops it, even started with SIGINT ignored (as a shell's background job starts it: a CI
    script run with `&`; Python then installs no KeyboardInterrupt handler of its own)."""
    config = tmp_path / "app.yaml"
    args = tiny_args(tiny_model_dir)
    args.pop("model")
    config.write_text(yaml.safe_dump({"applications": [{"name": "rayspec", "route_prefix": "/",
                                                         "import_path": "deployments.app:build_app", "args": args}]}))
    port = free_port()
    env = {**os.environ, "PYTHONPATH": str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.Popen([sys.executable, "-m", "rayspec_cli", "serve", str(tiny_model_dir), "--config", str(config),
                             "--served-model-name", "tiny-cli", "--host", "127.0.0.1", "--port", str(port),
                             "--num-cpus", "2"], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 300  # 30-90 s here; over 120 s beside the two-lane suite
        while not any("rayspec serve: tiny-cli" in line for line in lines):  # serve.run returned: app running
            assert proc.poll() is None and time.monotonic() < deadline, "".join(lines)[-5000:]
            time.sleep(0.5)
        r = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=30)
        assert r.status_code == 200 and [m["id"] for m in r.json()["data"]] == ["tiny-cli"]
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=150)  # Ray's shutdown; past 60 s on a loaded 2-core CI machine
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        reader.join(timeout=10)
    # (the replicas' health-check lines every 2 s would fill the message: what the CLI said instead)
    said = [line for line in lines if "CALL health" not in line]
    assert proc.returncode == 0, "".join(said)[-5000:]
