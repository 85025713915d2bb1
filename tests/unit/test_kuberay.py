"""`rayspec kuberay` and the cluster files: the committed RayService manifest is what the generator
writes now; its serveConfigV2 is a valid Serve config whose app builds (on a tiny model); its
worker groups, read as KubeRay's autoscaler reads them, hold every deployment at its maximum
replicas with the GPUs and node types (target_node / draft_node) it asks for, and the head takes
none; its install step runs as KubeRay runs it; configs/cluster.yaml has the same node types and
the installed Ray. No Ray cluster is started."""

from __future__ import annotations

import math
import os
import re
import subprocess
import warnings
from pathlib import Path

import pytest
import yaml

import ray
from ray.autoscaler._private.kuberay.autoscaling_config import _derive_autoscaling_config_from_ray_cr
from ray.serve.schema import ServeDeploySchema

from conftest import make_tiny_model_dir
from deployments.operations import kuberay
from deployments.config import AppArgs
from deployments.dialects import app_args_of
from rayspec_cli.main import main
from serve_utils import app_deployments

REPO = Path(__file__).resolve().parents[2]
CONFIGS = REPO / "configs"
CLUSTER_APP = CONFIGS / "cluster_eagle3.yaml"
MANIFEST = REPO / "deployments" / "kuberay" / "rayservice.yaml"
NODE_TYPES = {"Verifier": "target_node", "Proposer": "draft_node"}
SERVE_CONFIGS = sorted(p for p in CONFIGS.glob("*.yaml") if p.name != "cluster.yaml")


@pytest.fixture(scope="module")
def manifest() -> dict:
    return yaml.safe_load(MANIFEST.read_text())


def node_types(manifest: dict) -> dict[str, dict]:
    """The node types KubeRay's autoscaler derives from the manifest's RayCluster spec."""
    cr = {"metadata": {"name": manifest["metadata"]["name"], "namespace": "default"},
          "spec": manifest["spec"]["rayClusterConfig"]}
    return _derive_autoscaling_config_from_ray_cr(cr)["available_node_types"]


# ---- what a built Application asks for ---------------------------------------------------------

def replica_demand(opts: dict, bundles, strategy) -> tuple[dict[str, float], int]:
    """(resources one node must give, nodes' worth per replica) of a replica with ray_actor_options
    `opts` and its placement group bundles (packed: summed on one node; spread: one bundle a node)."""
    own = {"CPU": opts.get("num_cpus", 1), "GPU": opts.get("num_gpus", 0) or 0, **opts.get("resources", {})}
    if not bundles:
        return own, 1
    if strategy in (None, "PACK", "STRICT_PACK"):
        total = {}
        for b in bundles:
            for k, v in b.items():
                total[k] = total.get(k, 0) + v
        return {k: max(total.get(k, 0), own.get(k, 0)) for k in {*total, *own}}, 1
    keys = {k for b in bundles for k in b} | set(own)
    return {k: max([b.get(k, 0) for b in bundles] + [own.get(k, 0)]) for k in keys}, len(bundles)


def max_replicas(dep) -> int:
    auto = dep._deployment_config.autoscaling_config
    return auto.max_replicas if auto is not None else dep.num_replicas


def demands_of_app(app) -> list[tuple[str, dict[str, float]]]:
    out = []
    for name, dep in app_deployments(app).items():
        rc = dep._replica_config
        need, per_replica = replica_demand(dep.ray_actor_options, rc.placement_group_bundles,
                                           rc.placement_group_strategy)
        out += [(name, need)] * (max_replicas(dep) * per_replica)
    return out


def demands_of_args(cfg: AppArgs) -> list[tuple[str, dict[str, float]]]:
    parts = [(cfg.ingress_options(), cfg.ingress), (cfg.verifier_options(), cfg.verifier)]
    if cfg.topology == "disaggregated":
        parts.append((cfg.proposer_options(), cfg.proposer))
    out = []
    for opts, dargs in parts:
        need, per_replica = replica_demand(opts["ray_actor_options"], opts.get("placement_group_bundles"),
                                           opts.get("placement_group_strategy"))
        out += [(opts["name"], need)] * (dargs.max_replicas * per_replica)
    return out


def pack(demands, types: dict[str, dict]) -> dict[str, list[str]]:
    """First-fit of every replica (largest first) onto nodes of the worker types, at most
    max_workers of each; fails when one cannot be placed. -> node type -> deployments placed."""
    def fits(need, free):
        return all(free.get(k, 0) + 1e-9 >= v for k, v in need.items() if v > 0)

    nodes: list[tuple[str, dict, list]] = []
    opened = {t: 0 for t in types}
    for name, need in sorted(demands, key=lambda d: (-d[1].get("GPU", 0), -d[1].get("CPU", 0))):
        node = next((n for n in nodes if fits(need, n[1])), None)
        if node is None:
            kind = next((t for t, spec in types.items()
                         if opened[t] < spec["max_workers"] and fits(need, spec["resources"])), None)
            assert kind is not None, f"no worker group has room for a {name} replica {need}: {types}"
            opened[kind] += 1
            node = (kind, dict(types[kind]["resources"]), [])
            nodes.append(node)
        for k, v in need.items():
            node[1][k] = node[1].get(k, 0) - v
        node[2].append(name)
    placed: dict[str, list[str]] = {}
    for kind, _, names in nodes:
        placed.setdefault(kind, []).extend(names)
    return placed


# ---- the committed manifest --------------------------------------------------------------------

def test_manifest_is_generated_from_cluster_config():
    """The committed file is exactly what the generator writes from configs/cluster_eagle3.yaml
    now (regenerate with the command in its first line), through the CLI as documented."""
    assert MANIFEST.read_text() == kuberay.render("configs/cluster_eagle3.yaml")
    assert MANIFEST.read_text().startswith("# Generated by `rayspec kuberay configs/cluster_eagle3.yaml`")


def test_cli_writes_the_manifest(tmp_path, capsys):
    out = tmp_path / "k" / "rayservice.yaml"
    assert main(["kuberay", str(CLUSTER_APP), "--output", str(out)]) == 0
    assert out.read_text() == MANIFEST.read_text()
    assert main(["kuberay", str(CLUSTER_APP), "--image", "registry.example/rayspec:1", "--name", "spec-b"]) == 0
    doc = yaml.safe_load(capsys.readouterr().out)
    cluster = doc["spec"]["rayClusterConfig"]
    images = {c["image"] for g in [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]
              for c in g["template"]["spec"]["containers"]}
    assert images == {"registry.example/rayspec:1"} and doc["metadata"]["name"] == "spec-b"
    assert main(["kuberay", str(CLUSTER_APP), "--name", "Not_A_Label"]) == 2
    assert main(["kuberay", str(CONFIGS / "cluster.yaml")]) == 2  # a cluster launcher file, no serve app
    assert "rayspec kuberay:" in capsys.readouterr().err


def test_manifest_shape(manifest):
    assert (manifest["apiVersion"], manifest["kind"]) == ("ray.io/v1", "RayService")
    cluster = manifest["spec"]["rayClusterConfig"]
    assert cluster["enableInTreeAutoscaling"] is True
    assert cluster["rayVersion"] == ray.__version__ == kuberay.ray_version()
    head = cluster["headGroupSpec"]
    assert head["rayStartParams"]["num-cpus"] == "0"
    (container,) = head["template"]["spec"]["containers"]
    assert container["image"] == f"rayproject/ray:{ray.__version__}-py311-gpu"
    assert "nvidia.com/gpu" not in container["resources"]["limits"]
    assert {"containerPort": 8000, "name": "serve"} in container["ports"]  # the config's http port
    for group in cluster["workerGroupSpecs"]:
        assert group["minReplicas"] == 0 <= group["replicas"] and group["maxReplicas"] >= 1
        (worker,) = group["template"]["spec"]["containers"]
        assert worker["image"] == container["image"]
        gpus = int(group["rayStartParams"]["num-gpus"])
        assert worker["resources"]["limits"].get("nvidia.com/gpu", "0") == str(gpus)
        assert worker["resources"]["limits"]["cpu"] == group["rayStartParams"]["num-cpus"]


def test_serve_config_is_the_cluster_config(manifest):
    """serveConfigV2 is configs/cluster_eagle3.yaml's content and a valid Serve deploy config."""
    served = yaml.safe_load(manifest["spec"]["serveConfigV2"])
    assert served == yaml.safe_load(CLUSTER_APP.read_text())
    schema = ServeDeploySchema.model_validate(served)
    (app,) = schema.applications
    assert app.import_path == "deployments.app:build_app" and app.route_prefix == "/"
    assert schema.http_options.host == "0.0.0.0"


def test_served_app_builds_on_a_tiny_model(manifest, tmp_path):
    """The app of serveConfigV2 binds (build_app, no cluster) with its target swapped for a tiny
    model, its verifier and proposer pinned to their node types with a GPU each, autoscaled, and
    without Serve's look-back warning; its deployments fit the worker groups."""
    from deployments.app import build_app

    args = yaml.safe_load(manifest["spec"]["serveConfigV2"])["applications"][0]["args"]
    args["model"] = str(make_tiny_model_dir(tmp_path / "tiny", with_tokenizer=False))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        app = build_app(args)
    assert not [w for w in caught if "look_back_period_s" in str(w.message)]
    deps = app_deployments(app)
    assert set(deps) == {"OpenAIIngress", "Verifier", "Proposer"}
    for name, resource in NODE_TYPES.items():
        opts = deps[name].ray_actor_options
        assert opts["num_gpus"] == 1 and opts["resources"] == {resource: 0.01}
        assert deps[name]._deployment_config.autoscaling_config.max_replicas >= 2
    assert "resources" not in deps["OpenAIIngress"].ray_actor_options
    types = node_types(manifest)
    workers = {k: v for k, v in types.items() if k != "headgroup"}
    placed = pack(demands_of_app(app), workers)  # node-type resources keep each on its own group
    assert placed["target"].count("Verifier") == max_replicas(deps["Verifier"]) == 4
    assert placed["draft"].count("Proposer") == max_replicas(deps["Proposer"]) == 2


def test_worker_groups_carry_what_deployments_ask(manifest):
    """Read as KubeRay's autoscaler reads them: the head offers no CPU and no GPU (nothing is
    scheduled there); `target` pods offer target_node and a GPU, `draft` pods draft_node and a GPU;
    together the groups, at maxReplicas, hold every deployment at its max replicas."""
    types = node_types(manifest)
    head = types.pop("headgroup")
    assert head["resources"]["CPU"] == 0 and head["resources"].get("GPU", 0) == 0
    assert types["target"]["resources"]["target_node"] == 1 and types["target"]["resources"]["GPU"] == 1
    assert types["draft"]["resources"]["draft_node"] == 1 and types["draft"]["resources"]["GPU"] == 1
    assert "draft_node" not in types["target"]["resources"] and "target_node" not in types["draft"]["resources"]
    assert not any(k.endswith("_node") for k in types["cpu"]["resources"]) and types["cpu"]["resources"]["GPU"] == 0
    cfg = AppArgs.model_validate(yaml.safe_load(CLUSTER_APP.read_text())["applications"][0]["args"])
    demands = demands_of_args(cfg)
    placed = pack(demands, types)
    gpu_asked = {name: sum(d.get("GPU", 0) for n, d in demands if n == name) for name in NODE_TYPES}
    assert types["target"]["max_workers"] * types["target"]["resources"]["GPU"] >= gpu_asked["Verifier"] == 4
    assert types["draft"]["max_workers"] * types["draft"]["resources"]["GPU"] >= gpu_asked["Proposer"] == 2
    assert placed["target"].count("Verifier") == 4 and placed["draft"].count("Proposer") == 2


@pytest.mark.parametrize("path", SERVE_CONFIGS, ids=lambda p: p.name)
def test_every_config_gets_groups_that_hold_it(path):
    """Whatever the config (CPU only, fractional GPUs, a 4-GPU tensor-parallel verifier), the
    groups the generator derives hold all its deployments at their maximum."""
    manifest = kuberay.build_manifest(path)
    types = node_types(manifest)
    assert types.pop("headgroup")["resources"]["CPU"] == 0
    doc = yaml.safe_load(path.read_text())
    demands = [d for app in doc["applications"] for d in demands_of_args(AppArgs.model_validate(app_args_of(app)))]
    pack(demands, types)


def test_install_step_as_kuberay_runs_it(tmp_path, monkeypatch):
    """KubeRay runs `/bin/bash -lc -- "<our args> && ulimit -n 65536; ray start ..."`: with rayspec
    in the image it goes straight on (fetching the default model on workers); without, it clones
    RAYSPEC_SOURCE at RAYSPEC_REF and installs the checkout editable; with neither it stops."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "calls"
    for tool, status in (("python", "$PY_STATUS"), ("pip", "0"), ("rayspec", "0")):
        (bin_dir / tool).write_text(f'#!/bin/sh\necho "{tool} $*" >> {log}\nexit {status}\n')
        (bin_dir / tool).chmod(0o755)
    src = tmp_path / "src"
    src.mkdir()
    git = ["git", "-C", str(src), "-c", "user.name=t", "-c", "user.email=t@t", "-c", "init.defaultBranch=main"]
    subprocess.run(git[:3] + ["init", "-q"], check=True)
    (src / "marker").write_text("v1")
    subprocess.run(git + ["add", "marker"], check=True)
    subprocess.run(git + ["commit", "-qm", "v1"], check=True)
    first = subprocess.run(["git", "-C", str(src), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    (src / "marker").write_text("v2")
    subprocess.run(git + ["commit", "-qam", "v2"], check=True)
    checkout = tmp_path / "checkout"
    monkeypatch.setattr(kuberay, "CHECKOUT", str(checkout))

    def run(fetch: bool, **env) -> subprocess.CompletedProcess:
        log.write_text("")
        script = " " + kuberay.install_script(fetch) + " " + " && echo STARTED"
        full_env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", **env}
        return subprocess.run(["/bin/bash", "-c", "--", script], env=full_env, capture_output=True, text=True)

    r = run(True, PY_STATUS="0")  # rayspec in the image: no install; the default model is fetched
    assert r.returncode == 0 and r.stdout.strip() == "STARTED"
    assert "rayspec fetch-model" in log.read_text() and "pip" not in log.read_text()
    r = run(False, PY_STATUS="1", RAYSPEC_SOURCE="", RAYSPEC_REF="")
    assert r.returncode == 1 and "STARTED" not in r.stdout and "RAYSPEC_SOURCE is empty" in r.stderr
    r = run(True, PY_STATUS="1", RAYSPEC_SOURCE=str(src), RAYSPEC_REF=first)
    assert r.returncode == 0 and r.stdout.strip() == "STARTED", r.stderr
    assert (checkout / "marker").read_text() == "v1"  # the ref, not the branch head
    calls = log.read_text().splitlines()
    assert f"pip install --no-cache-dir -e {checkout}[serve]" in calls and calls[-1] == "rayspec fetch-model"
    r = run(False, PY_STATUS="1", RAYSPEC_SOURCE=str(tmp_path / "nowhere"), RAYSPEC_REF="")
    assert r.returncode != 0 and "STARTED" not in r.stdout


def test_manifest_runs_the_install_step(manifest):
    cluster = manifest["spec"]["rayClusterConfig"]
    groups = [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]
    for group in groups:
        (container,) = group["template"]["spec"]["containers"]
        assert "command" not in container  # KubeRay puts our args ahead of its `ray start`
        (script,) = container["args"]
        assert "ray start" not in script and not script.endswith("\n")
        assert script == kuberay.install_script(fetch_model=group is not groups[0])
        env = {e["name"]: e for e in container["env"]}
        assert env["RAYSPEC_SOURCE"]["value"] == "" and env["HF_TOKEN"]["valueFrom"]["secretKeyRef"]["optional"]
        # fail closed: no key secret, no pod (the ingress serves outside clients only with a key)
        assert env["RAYSPEC_API_KEY"]["valueFrom"]["secretKeyRef"]["optional"] is False


# ---- configs/cluster.yaml (ray up) ---------------------------------------------------------------

def test_cluster_launcher_config_matches():
    """configs/cluster.yaml: worker node types carry target_node / draft_node with a GPU, enough of
    them for configs/cluster_eagle3.yaml at its maximum, the head runs no GPU work, and its image
    is the installed Ray, which meets pyproject's pin."""
    from packaging.specifiers import SpecifierSet

    doc = yaml.safe_load((CONFIGS / "cluster.yaml").read_text())
    types = dict(doc["available_node_types"])
    head = types.pop(doc["head_node_type"])
    assert head["resources"].get("GPU", 0) == 0 and not any(k.endswith("_node") for k in head["resources"])
    carried = {k for t in types.values() for k in t["resources"] if k.endswith("_node")}
    assert carried == {"target_node", "draft_node"}
    for t in types.values():
        if any(k.endswith("_node") for k in t["resources"]):
            assert t["resources"]["GPU"] >= 1 and sum(k.endswith("_node") for k in t["resources"]) == 1
    cfg = AppArgs.model_validate(yaml.safe_load(CLUSTER_APP.read_text())["applications"][0]["args"])
    as_autoscaler = {name: {"resources": t["resources"], "max_workers": t["max_workers"]} for name, t in types.items()}
    as_autoscaler[doc["head_node_type"]] = {"resources": head["resources"], "max_workers": 1}  # the head takes CPU work
    placed = pack(demands_of_args(cfg), as_autoscaler)
    for name, resource in NODE_TYPES.items():
        assert {t for t, names in placed.items() if name in names} == \
            {t for t, spec in types.items() if resource in spec["resources"]}
    version = re.fullmatch(r"rayproject/ray:([0-9.]+)-py\d+-gpu", doc["docker"]["image"]).group(1)
    assert version == ray.__version__ == kuberay.ray_version()
    pin = re.search(r'"ray\[serve\]([^"]*)"', (REPO / "pyproject.toml").read_text()).group(1)
    assert version in SpecifierSet(pin)
    assert "configs/cluster_eagle3.yaml" in (CONFIGS / "cluster.yaml").read_text()


def test_autoscaling_configs_look_back_past_metrics_interval():
    """Every autoscaling_config in configs/ looks back further than Serve's metrics interval (Serve
    warns, and will refuse, otherwise)."""
    from ray.serve.config import AutoscalingConfig

    for path in SERVE_CONFIGS:
        for app in yaml.safe_load(path.read_text())["applications"]:
            cfg = AppArgs.model_validate(app_args_of(app))
            for opts in (cfg.ingress_options(), cfg.verifier_options(), cfg.proposer_options()):
                if "autoscaling_config" in opts:  # as the app hands it to Serve
                    parsed = AutoscalingConfig(**opts["autoscaling_config"])
                    assert parsed.look_back_period_s > parsed.metrics_interval_s, (path.name, opts["name"])
    assert math.isclose(AutoscalingConfig().metrics_interval_s, 10.0)  # what tests/serve/test_serve_autoscaling.py assumes
