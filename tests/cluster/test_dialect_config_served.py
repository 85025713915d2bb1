"""Our users' dialects served (the translation unit tests: tests/unit/test_dialect_config.py):
`rayspec serve` in a process of its own, and configs/vllm_style.yaml and configs/ray_serve_llm_style.yaml
served on the tiny model beside the same app written our way (on the shared local Ray)."""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import yaml

import ray.serve  # noqa: F401 - a hard dependency: missing means an error, not a skip
from pydantic import ValidationError

from serve_utils import free_port, tiny_args  # noqa: E402

from deployments.app import build_app, build_llm_app  # noqa: E402
from deployments.config import AppArgs  # noqa: E402
from deployments.dialects import app_args_of, translate_llm_app_args  # noqa: E402
from rayspec_cli.main import build_parser  # noqa: E402
from rayspec_cli.serve import serve_config  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "configs"


def yaml_app(name: str) -> dict:
    doc = yaml.safe_load((CONFIGS / name).read_text())
    (app,) = doc["applications"]
    assert app["name"] == "rayspec" and app["route_prefix"] == "/"
    return app


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


# ---- served: both dialect YAMLs beside the native app -------------------------------------------

def tiny_dialect_apps(tiny_model_dir) -> dict[str, tuple]:
    """name -> (builder, args): the shipped dialect YAMLs pointed at the tiny model with tiny_args'
    engine and resources, and the native app they must equal."""
    native = tiny_args(tiny_model_dir, speculative={"num_speculative_tokens": 5, "prompt_lookup_min": 2,
                                                    "prompt_lookup_max": 5})
    small = {**native["engine"]}
    vllm = copy.deepcopy(yaml_app("vllm_style.yaml")["args"])
    vllm.update(model=native["model"], served_model_name="tiny", ingress=native["ingress"],
                verifier=native["verifier"], proposer=native["proposer"], **small)
    ours = {key: native["speculative"][key] for key in ("adaptive", "draft_costs")}  # our own keys, as the native app's
    vllm["speculative_config"].update(ours)  # (taken in speculative_config)
    llm = copy.deepcopy(yaml_app("ray_serve_llm_style.yaml")["args"])
    entry = llm["llm_configs"][0]
    entry["model_loading_config"] = {"model_id": "tiny", "model_source": native["model"]}
    entry["engine_kwargs"].update(small)
    entry["engine_kwargs"]["speculative_config"].update(ours)
    entry["deployment_config"] = native["verifier"]
    llm["ingress_deployment_config"] = native["ingress"]
    llm["proposer"] = native["proposer"]
    return {"native": (build_app, native), "vllm": (build_app, vllm), "llm": (build_llm_app, llm)}


@pytest.fixture(scope="module")
def served(tiny_model_dir, serve_url):
    from ray_utils import serving

    apps = tiny_dialect_apps(tiny_model_dir)
    with serving(*((name, builder(copy.deepcopy(args)), f"/{name}") for name, (builder, args) in apps.items())):
        yield serve_url, apps


def test_dialect_yamls_serve_what_the_native_app_serves(served):
    """configs/vllm_style.yaml and configs/ray_serve_llm_style.yaml (on the tiny model) are the native
    app's AppArgs, and served they answer a greedy completion with the native app's tokens."""
    url, apps = served
    native = AppArgs.model_validate(apps["native"][1])
    assert AppArgs.model_validate(apps["vllm"][1]) == native
    assert AppArgs.model_validate(translate_llm_app_args(copy.deepcopy(apps["llm"][1]))) == native
    body = {"model": "tiny", "prompt": "Say hello hello hello", "max_tokens": 24, "temperature": 0}
    answers = {}
    with httpx.Client(timeout=120) as client:
        for name in apps:
            assert [m["id"] for m in client.get(f"{url}/{name}/v1/models").json()["data"]] == ["tiny"]
            r = client.post(f"{url}/{name}/v1/completions", json=body)
            assert r.status_code == 200, r.text
            out = r.json()
            answers[name] = (out["choices"][0]["text"], out["usage"]["completion_tokens"],
                             json.dumps(out["usage"].get("completion_tokens_details"), sort_keys=True))
    assert answers["vllm"] == answers["native"] == answers["llm"]
    assert answers["native"][0].strip() and answers["native"][1] == 24
