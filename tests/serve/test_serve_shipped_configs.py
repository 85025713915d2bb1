"""Every shipped config that needs no GPU and no cluster of several nodes starts as `serve run` starts
it and answers a chat completion (issue #53, item 6).

Which configs: every YAML in configs/ with Serve `applications` (configs/cluster.yaml is a cluster
launcher's file, not a serve config), minus those whose replicas ask for what a one-node CPU
cluster lacks: a GPU (`num_gpus` > 0 or a GPU in a placement-group bundle, in any deployment's
options as deployments.config computes them), an accelerator type, a custom resource (a node type
such as configs/cluster.yaml's `target_node`) or a STRICT_SPREAD placement group (another node).
A new CPU config is picked up by that rule, not by a list kept here.

How: as `serve run FILE` does (ray.serve.scripts.run): the file parsed into Serve's own
ServeDeploySchema and its applications deployed by the controller (`deploy_apps`, which builds
each from its import_path and args on the cluster), here on this test worker's shared cluster and
Serve instance. Overridden: the Serve instance's host and port (the shared one's, as `serve run
--address` to a running instance) and, so that the configs' apps can follow one another without
waiting for the previous to drain, each application's name and route prefix (all are "rayspec" at
"/"). Args, deployments and their options are the file's. Configs are deployed WAVE at a time (the
next config applied replaces the previous wave's applications, as a new declarative config does):
each SmolLM2 verifier holds its weights and a 1 GB KV pool.

Each wave's applications hold the Ray CPUs `rayspec plan` counts for them. configs/default.yaml's
answer is checked further (check_default, once its own test; the app deployed here is the same, so
SmolLM2 is loaded for it once): over HTTP with the openai client, its greedy answer is the target's
own (an in-process engine without speculation) and the app's counters hold exactly that request's drafts.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import yaml

from deployments.config import AppArgs
from deployments.dialects import app_args_of
from deployments.operations.resources import resource_plan

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
WAVE = 2  # configs deployed at once (a verifier holds ~2.5 GB: weights, a 1 GB KV pool, torch; an ingress 0.4)
START_TIMEOUT_S = 600  # replicas importing torch, loading the model and warming up, on a loaded 2-core machine


def serve_doc(path: Path) -> dict | None:
    doc = yaml.safe_load(path.read_text())
    return doc if isinstance(doc, dict) and doc.get("applications") else None


def needs_more_than_a_cpu_node(app: dict) -> list[str]:
    """Why this application cannot start on one CPU-only node (empty: it can)."""
    cfg = AppArgs.model_validate(app_args_of(app))
    reasons = []
    for name, opts in (("ingress", cfg.ingress_options()), ("verifier", cfg.verifier_options()),
                       ("proposer", cfg.proposer_options())):
        actor = opts.get("ray_actor_options", {})
        if actor.get("num_gpus", 0) > 0 or any(b.get("GPU", 0) > 0 for b in opts.get("placement_group_bundles", ())):
            reasons.append(f"{name}: GPU")
        if actor.get("accelerator_type"):
            reasons.append(f"{name}: accelerator_type")
        if actor.get("resources"):
            reasons.append(f"{name}: resources {actor['resources']}")
        if opts.get("placement_group_strategy") == "STRICT_SPREAD":
            reasons.append(f"{name}: STRICT_SPREAD")
    return reasons


def cpu_configs() -> list[Path]:
    return [p for p in sorted(CONFIGS.glob("*.yaml"))
            if (doc := serve_doc(p)) is not None and not any(needs_more_than_a_cpu_node(a) for a in doc["applications"])]


CPU_CONFIGS = cpu_configs()


def test_the_rule_picks_the_cpu_configs():
    """The rule keeps the configs written for CPU and drops every GPU or multi-node one."""
    names = {p.stem for p in CPU_CONFIGS}
    assert {"default", "baseline", "autoscaling", "draft_model", "draft_colocated", "draft_async", "eagle3",
            "eagle3_async", "eagle3_async_paired", "vllm_style", "ray_serve_llm_style"} <= names
    assert not names & {"disaggregated", "fractional_gpu", "eagle3_disaggregated", "cluster_eagle3", "llama3_eagle3",
                        "qwen3_eagle3", "gpt_oss_eagle3", "llama70b_draft8b_tp4", "cluster"}, names


def deployable(path: Path):
    """The file as Serve's schema reads it (what `serve run` validates), its applications renamed."""
    from ray.serve.schema import ServeDeploySchema

    schema = ServeDeploySchema.model_validate(serve_doc(path))
    apps = schema.applications
    for i, app in enumerate(apps):
        suffix = "" if len(apps) == 1 else f"-{i}"
        app.name, app.route_prefix = f"{path.stem}{suffix}", f"/{path.stem}{suffix}"
    return apps


def wait_running(names: list[str]) -> None:
    import time

    from ray import serve

    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        status = serve.status().applications
        states = {n: (status[n].status if n in status else "NOT_STARTED") for n in names}
        failed = {n: status[n].message for n, s in states.items() if s in ("DEPLOY_FAILED", "UNHEALTHY")}
        assert not failed, failed
        if all(s == "RUNNING" for s in states.values()):
            return
        assert time.monotonic() < deadline, states
        time.sleep(1)


@pytest.fixture(scope="module")
def idle_cpus(serve_url) -> float:
    """The shared cluster's logical CPUs held before the first wave (Serve's own actors ask for none)."""
    from ray_utils import cpus_in_use

    return cpus_in_use()


@pytest.fixture(scope="module", autouse=True)
def delete_the_last_wave(serve_url):
    """The last wave's applications go with the module (the next module on this worker's shared Serve
    instance gets its memory back): a declarative deploy deletes only the previous declarative apps."""
    yield
    from ray import serve

    deployed = {a.name for path in CPU_CONFIGS for a in deployable(path)}
    for name in sorted(deployed & set(serve.status().applications)):
        serve.delete(name)


def check_default(app, serve_url: str) -> None:
    """configs/default.yaml as served (real SmolLM2-135M on CPU), over HTTP with the openai client: the
    served greedy answer is the target's own (an in-process engine without speculation), and the app's
    counters hold exactly that request's drafts (a fresh app: its counters are this one request's)."""
    import openai
    from ray import serve

    from rayspec.config import SpeculativeConfig
    from rayspec.engine.llm_engine import LLMEngine
    from rayspec.sampling.sampler import SamplingParams

    args = app.args
    messages = [{"role": "user", "content": "List the numbers from 1 to 10, separated by commas."}]
    max_tokens = 24
    config = AppArgs.model_validate(args).engine_config()
    config.speculative = SpeculativeConfig(method="none")
    config.max_num_seqs, config.kv_cache_memory_gb, config.device = 1, 0.25, "cpu"  # as served: no GPU here
    target = LLMEngine(config)
    ref = target.generate([target.encode_chat(messages)], SamplingParams(temperature=0, max_tokens=max_tokens))[0]
    del target
    client = openai.OpenAI(base_url=f"{serve_url}{app.route_prefix}/v1", api_key="x", max_retries=0, timeout=120)
    resp = client.chat.completions.create(model=args["served_model_name"], temperature=0, max_tokens=max_tokens,
                                          messages=messages)
    assert resp.choices[0].message.content == ref.text and ref.text.strip()
    assert resp.usage.completion_tokens == ref.num_output_tokens
    assert resp.choices[0].finish_reason == ref.finish_reason
    details = resp.usage.completion_tokens_details
    assert details.accepted_prediction_tokens > 0  # the shipped EAGLE-3 head's drafts are accepted
    stats = serve.get_app_handle(app.name).stats.remote().result(timeout_s=60)
    assert stats["method"] == args["speculative"]["method"]
    assert stats["num_accepted_tokens"] == details.accepted_prediction_tokens
    assert stats["num_draft_tokens"] == details.accepted_prediction_tokens + details.rejected_prediction_tokens


@pytest.mark.parametrize("wave", range(0, len(CPU_CONFIGS), WAVE), ids=lambda i: "+".join(
    p.stem for p in CPU_CONFIGS[i:i + WAVE]))
def test_cpu_configs_start_and_answer(smollm2, serve_url, idle_cpus, wave):
    """Each config of this wave deployed as `serve run` deploys it; its applications hold the CPUs
    `rayspec plan` counts (configs/default.yaml's at most 2: it would start with Ray's detected
    resources on this 2-core machine, where the shared cluster counts more for other modules); every
    application answers one chat completion (200, non-empty text), default.yaml's as check_default
    checks it."""
    from ray.serve.context import _get_global_client
    from ray.serve.schema import ServeDeploySchema
    from ray_utils import cpus_in_use

    apps = [app for path in CPU_CONFIGS[wave:wave + WAVE] for app in deployable(path)]
    _get_global_client().deploy_apps(ServeDeploySchema(applications=apps))
    wait_running([a.name for a in apps])
    planned = {a.name: resource_plan(AppArgs.model_validate(app_args_of(a.model_dump()))).cpus() for a in apps}
    assert planned.get("default", 0) <= 2
    # (the previous wave's replicas may still be stopping: polled until they are gone)
    want = idle_cpus + sum(planned.values())
    assert cpus_in_use(settle_s=60, expect=want) == pytest.approx(want), planned
    with httpx.Client(timeout=300) as client:
        for app in apps:
            if app.name == "default":  # its first request: its counters are that request's
                check_default(app, serve_url)
                continue
            model = app.args.get("served_model_name") or \
                app.args["llm_configs"][0]["model_loading_config"]["model_id"]
            r = client.post(f"{serve_url}{app.route_prefix}/v1/chat/completions",
                            json={"model": model, "max_tokens": 8, "temperature": 0,
                                  "messages": [{"role": "user", "content": "Say hello."}]})
            assert r.status_code == 200, (app.name, r.text)
            assert r.json()["choices"][0]["message"]["content"].strip(), (app.name, r.json())
