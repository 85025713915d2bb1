"""What each deployment of a serve app asks Ray to schedule: CPUs and GPUs per replica (a placement
group's bundles summed), counted from the same deployment options build_app gives Serve, summed
and set against a machine. A replica Ray cannot place is never started, and Serve only logs that
it waits to be scheduled; `rayspec plan` prints this (deployments.operations.plan). No model is read, no Ray
is started.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

from deployments.config import AppArgs


@dataclass(frozen=True)
class DeploymentResources:
    """One deployment's request to Ray's scheduler. num_cpus / num_gpus are scheduling shares: a
    replica's threads are engine.num_threads whatever its num_cpus, but Ray starts it only on a
    node with that much of its count left."""

    name: str
    replicas: int  # at start: num_replicas, or autoscaling's initial_replicas (else min_replicas)
    max_replicas: int
    cpus: float  # per replica; with a placement group, all its bundles together
    gpus: float
    bundles: int = 0  # placement group bundles per replica (0: none)


@dataclass(frozen=True)
class Machine:
    cpus: int
    gpus: int

    @classmethod
    def detected(cls) -> "Machine":
        """What Ray detects here when started without num_cpus / num_gpus: the CPU count and the CUDA devices."""
        import torch

        return cls(os.cpu_count() or 1, torch.cuda.device_count() if torch.cuda.is_available() else 0)


@dataclass(frozen=True)
class ResourcePlan:
    deployments: list[DeploymentResources]

    def cpus(self, at_max: bool = False) -> float:
        return sum((d.max_replicas if at_max else d.replicas) * d.cpus for d in self.deployments)

    def gpus(self, at_max: bool = False) -> float:
        return sum((d.max_replicas if at_max else d.replicas) * d.gpus for d in self.deployments)

    def fits(self, machine: Machine, at_max: bool = False) -> bool:
        return self.cpus(at_max) <= machine.cpus + 1e-9 and self.gpus(at_max) <= machine.gpus + 1e-9


def _replicas(opts: dict) -> tuple[int, int]:
    """(at start, at most) of a deployment's options, as Serve counts them."""
    auto = opts.get("autoscaling_config")
    if auto is None:
        return opts["num_replicas"], opts["num_replicas"]
    low = int(auto.get("min_replicas", 1))
    return int(auto.get("initial_replicas", low) or low), int(auto.get("max_replicas", low))


def resource_plan(cfg: AppArgs) -> ResourcePlan:
    """CPUs and GPUs per deployment, from the options build_app gives Serve (no model is read)."""
    options = [cfg.ingress_options(), cfg.verifier_options()]
    if cfg.topology == "disaggregated" and not cfg.paired:  # paired: the proposers are the verifier's bundles
        options.append(cfg.proposer_options())
    out = []
    for opts in options:
        start, most = _replicas(opts)
        bundles = opts.get("placement_group_bundles")
        if bundles:  # the replica runs in bundle 0; its ranks and paired proposer in the others
            cpus, gpus = sum(b.get("CPU", 0.0) for b in bundles), sum(b.get("GPU", 0.0) for b in bundles)
        else:
            actor = opts["ray_actor_options"]
            cpus, gpus = float(actor.get("num_cpus", 1)), float(actor.get("num_gpus", 0))
        out.append(DeploymentResources(opts["name"], start, most, cpus, gpus, len(bundles or ())))
    return ResourcePlan(out)


def _count(n: float, unit: str) -> str:
    return f"{n:g} {unit}{'' if n == 1 else 's'}"


def resource_lines(plan: ResourcePlan, machine: Machine) -> list[str]:
    """The Ray resources each deployment asks for, summed, against `machine`."""
    out = ["Ray resources (num_cpus / num_gpus are scheduling shares, not thread or memory limits; Serve's "
           "controller and proxy ask for none):"]
    for d in plan.deployments:
        replicas = f"{d.replicas}" + (f"-{d.max_replicas}" if d.max_replicas != d.replicas else "")
        group = f" (placement group of {d.bundles} bundles)" if d.bundles else ""
        out.append(f"  {d.name}: {replicas} replica{'' if replicas == '1' else 's'} x "
                   f"{_count(d.cpus, 'CPU')}, {_count(d.gpus, 'GPU')}{group}")
    need = f"{_count(plan.cpus(), 'CPU')}, {_count(plan.gpus(), 'GPU')}"
    here = f"this machine has {_count(machine.cpus, 'CPU')} and {_count(machine.gpus, 'GPU')}"
    if plan.fits(machine):
        out.append(f"  to start: {need}; {here}: fits")
    else:
        short = [f"{_count(need - have, unit)} short" for need, have, unit in
                 ((plan.cpus(), machine.cpus, "CPU"), (plan.gpus(), machine.gpus, "GPU")) if need > have + 1e-9]
        out.append(f"  to start: {need}; {here}: does not fit ({', '.join(short)}). On this machine alone Ray "
                   "never places some replicas (Serve logs that they wait to be scheduled, and /health stays "
                   "unready): lower ray_actor_options.num_cpus / num_gpus, or start Ray on more nodes")
    if plan.cpus(True) > plan.cpus() or plan.gpus(True) > plan.gpus():
        verdict = "fits" if plan.fits(machine, at_max=True) else \
            "does not fit: replicas past that wait for another node (a cluster autoscaler starts one)"
        out.append(f"  at max replicas: {_count(plan.cpus(True), 'CPU')}, {_count(plan.gpus(True), 'GPU')}; "
                   f"on this machine: {verdict}")
    return out


def resources_json(plan: ResourcePlan, machine: Machine) -> dict:
    return {"deployments": [dataclasses.asdict(d) for d in plan.deployments],
            "cpus": plan.cpus(), "gpus": plan.gpus(), "max_cpus": plan.cpus(True), "max_gpus": plan.gpus(True),
            "machine": dataclasses.asdict(machine), "fits_machine": plan.fits(machine)}
