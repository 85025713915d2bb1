"""Tensor-parallel ranks as Ray actors inside a placement group.

A verifier replica at tensor_parallel_size N is scheduled by Serve into bundle 0 of a placement group
of N bundles (`placement_group_bundles`, `STRICT_PACK` by default: one node, so NCCL runs over
NVLink / PCIe); it is rank 0 and runs the engine. RayRankLauncher starts ranks 1..N-1 as
`RankWorker` actors, one per remaining bundle, each taking that bundle's CPUs and GPU, and each
running rayspec.model.tp_ranks.run_rank: join the torch.distributed group, load its shard, follow rank 0's
commands. Outside a placement group (`rayspec bench offline --tensor-parallel-size N`) the launcher
makes one of N-1 bundles for the other ranks and removes it at shutdown.

A rank that dies breaks the group: rank 0's next collective raises rayspec.model.parallel.RankFailure,
which the verifier turns into the death of its replica (deployments.replicas.engine_loop), so Serve starts a
new one and requests in flight fail over (deployments.frontend.failover). The health check also asks
whether every rank's actor is still running.
"""

from __future__ import annotations

import logging
import os

import ray
from ray.util.placement_group import get_current_placement_group, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from rayspec.model.tp_ranks import RankLauncher, run_rank

logger = logging.getLogger("ray.serve")

STRATEGIES = ("STRICT_PACK", "PACK", "SPREAD", "STRICT_SPREAD")
READY_TIMEOUT_S = 600.0  # a placement group that cannot be placed (no such GPUs) fails the start


@ray.remote(max_restarts=0, max_task_retries=0, max_concurrency=2)
class RankWorker:
    """One follower rank (its own process, its bundle's device). Two threads: `run` holds one for
    the rank's life, `node_id` answers on the other."""

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def run(self, rank: int, size: int, init_method: str, model_spec: str, device: str, dtype: str | None,
            draft=None, secret: bytes | None = None, quantized_weights: str = "keep") -> int:
        return run_rank(rank, size, init_method, model_spec, device, dtype, draft, secret=secret,
                        quantized_weights=quantized_weights)


def rank_actor_name(owner_actor_id: str, rank: int) -> str:
    """The name of rank `rank`'s actor, started by the replica (actor) `owner_actor_id`."""
    return f"rayspec-tp-rank{rank}-of-{owner_actor_id}"


def rank_bundles(size: int, num_cpus: float, num_gpus: float) -> list[dict]:
    """One bundle per rank: rank 0 (the replica itself) in the first, with the replica's resources."""
    bundle = {"CPU": float(num_cpus)}
    if num_gpus:
        bundle["GPU"] = float(num_gpus)
    return [dict(bundle) for _ in range(size)]


class _RayRanks:
    def __init__(self, workers: list, started: list, runs: list, own_group=None):
        self.workers, self.started, self.runs, self.own_group = workers, started, runs, own_group

    def wait_started(self, timeout_s: float = READY_TIMEOUT_S) -> None:
        """Every rank's actor is up (its process started in its bundle); raises otherwise."""
        ray.get(self.started, timeout=timeout_s)

    def alive(self) -> bool:
        """No rank's run has ended (a rank's run ends only at shutdown, or when its process died)."""
        done, _ = ray.wait(self.runs, num_returns=len(self.runs), timeout=0)
        return not done

    def node_ids(self) -> list[str]:
        return ray.get([w.node_id.remote() for w in self.workers])

    def shutdown(self, timeout_s: float = 10.0) -> None:
        ray.wait(self.runs, num_returns=len(self.runs), timeout=timeout_s)  # they return after OP_STOP
        for w in self.workers:
            ray.kill(w, no_restart=True)
        if self.own_group is not None:
            remove_placement_group(self.own_group)


class RayRankLauncher(RankLauncher):
    """Starts ranks 1..N-1 in the current placement group (bundles 1..N-1: a Serve replica's own),
    or, outside one, in a new group of N-1 bundles (`strategy`, resources per rank)."""

    def __init__(self, strategy: str = "STRICT_PACK", num_cpus: float = 1, num_gpus: float | None = None):
        if strategy not in STRATEGIES:
            raise ValueError(f"placement strategy {strategy!r}: use one of {STRATEGIES}")
        self.strategy, self.num_cpus, self.num_gpus = strategy, num_cpus, num_gpus

    def address(self) -> str:
        return ray.util.get_node_ip_address()

    def launch(self, size, init_method, model_spec, device, dtype, draft=None, secret=None, quantized_weights="keep"):
        group, first, own = get_current_placement_group(), 1, None
        if group is None:
            gpus = self.num_gpus if self.num_gpus is not None else (1 if device == "cuda" else 0)
            group = own = placement_group(rank_bundles(size - 1, self.num_cpus, gpus), strategy=self.strategy)
            first = 0
            ray.get(own.ready(), timeout=READY_TIMEOUT_S)
        specs = group.bundle_specs
        if len(specs) < first + size - 1:
            raise ValueError(f"tensor_parallel_size {size} needs {first + size - 1} placement group bundles; "
                             f"this replica's group has {len(specs)} (placement_group_bundles)")
        owner = ray.get_runtime_context().get_actor_id() or f"driver-{os.getpid()}"
        workers = []
        for rank in range(1, size):
            spec = specs[first + rank - 1]
            strategy = PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=first + rank - 1,
                                                        placement_group_capture_child_tasks=False)
            workers.append(RankWorker.options(name=rank_actor_name(owner, rank), num_cpus=spec.get("CPU", 0),
                                              num_gpus=spec.get("GPU", 0), scheduling_strategy=strategy).remote())
        started = [w.node_id.remote() for w in workers]
        runs = [w.run.remote(rank, size, init_method, model_spec, device, dtype, draft, secret, quantized_weights)
                for rank, w in enumerate(workers, 1)]
        logger.info("started %d tensor-parallel ranks (%s)", size - 1, "own placement group" if own else
                    "the replica's placement group")
        return _RayRanks(workers, started, runs, own)
