"""Our users' dialects served (the translation unit tests: tests/unit/test_dialect_config.py):
configs/vllm_style.yaml and configs/ray_serve_llm_style.yaml served on the tiny model beside the same app
written our way, on the shared local Ray. (`rayspec serve` in a process of its own:
tests/cluster/test_rayspec_serve_cli.py.)"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import httpx
import pytest
import yaml

import ray.serve  # noqa: F401 - a hard dependency: missing means an error, not a skip

from serve_utils import tiny_args  # noqa: E402

from deployments.app import build_app, build_llm_app  # noqa: E402
from deployments.config import AppArgs  # noqa: E402
from deployments.dialects import translate_llm_app_args  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "configs"


def yaml_app(name: str) -> dict:
    doc = yaml.safe_load((CONFIGS / name).read_text())
    (app,) = doc["applications"]
    assert app["name"] == "rayspec" and app["route_prefix"] == "/"
    return app


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
