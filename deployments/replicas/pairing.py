"""A verifier replica's own proposer (`proposer_placement: paired`): a Ray actor in the replica's
placement group.

AppArgs.verifier_options gives each verifier replica's placement group one bundle past its ranks'
(always the last), sized by the proposer's `ray_actor_options`; Serve places the group by
`verifier.placement_group_strategy`: STRICT_PACK keeps it on the replica's node (the proposer on
another GPU there), STRICT_SPREAD puts the proposer on another node. The replica starts a
PairedProposer in that bundle: the ProposerServer the Proposer deployment is (every method,
asynchronous pre-drafting, the direct channel), as a plain actor. RemoteProposer drives it as it
drives a pinned pool replica, through PairedHandle, which answers the calls it makes of a Serve
handle: `pin` gets the actor's channel address, the per-step calls go over the channel, and a call
the channel cannot carry goes to the actor through Ray.

Lifetime: the actor belongs to the replica (killed when the replica shuts down; Ray also ends it
with its owner and with the placement group). An actor that dies fails the call in flight:
RemoteProposer runs that step, and those of its back-off, without drafts (plain target steps,
outputs unchanged) and then pins again; that pin finds the actor dead, and PairedHandle starts a
new one in the same bundle. Pins fail at once (more steps without drafts) until the new actor has
loaded its model, so the engine never waits on a proposer that is starting.
"""

from __future__ import annotations

import contextlib
import logging

import ray
from ray.exceptions import RayActorError
from ray.util.placement_group import get_current_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from deployments.replicas.proposer import ProposerServer

logger = logging.getLogger("ray.serve")


class ProposerStarting(RuntimeError):
    """The paired proposer actor is (re)starting: no call reaches it yet."""


def placement() -> dict:
    """Where the calling Ray worker runs: its node and the GPU ids Ray assigned it."""
    ctx = ray.get_runtime_context()
    return {"node_id": ctx.get_node_id(), "gpu_ids": [str(g) for g in ctx.get_accelerator_ids().get("GPU", [])]}


def paired_proposer_name(owner_actor_id: str) -> str:
    """The name of the proposer actor of the verifier replica (actor) `owner_actor_id`."""
    return f"rayspec-proposer-of-{owner_actor_id}"


@ray.remote(max_restarts=0, max_task_retries=0)
class PairedProposer(ProposerServer):
    def placement(self) -> dict:
        return placement()


class _Response:
    """One actor call, answering as a Serve DeploymentResponse does (`result`, `cancel`)."""

    def __init__(self, owner: PairedHandle, actor, ref):
        self.owner, self.actor, self.ref = owner, actor, ref

    def result(self, timeout_s: float | None = None):
        try:
            return ray.get(self.ref, timeout=timeout_s)
        except RayActorError:  # max_restarts=0: the actor is gone for good
            self.owner.replace(self.actor)
            raise

    def cancel(self) -> None:
        with contextlib.suppress(Exception):  # already finished or failed
            ray.cancel(self.ref)


class _Method:
    def __init__(self, owner: PairedHandle, name: str, when_started: bool):
        self.owner, self.name, self.when_started = owner, name, when_started

    def remote(self, *args):
        actor = self.owner.actor
        if self.when_started and not self.owner.started():
            raise ProposerStarting("the paired proposer is still loading")
        return _Response(self.owner, actor, getattr(actor, self.name).remote(*args))


class PairedHandle:
    """The verifier replica's proposer actor behind the handle calls RemoteProposer makes: starts
    it in the replica's last placement group bundle, replaces it when it died, kills it at the end."""

    def __init__(self, args: dict, channel_secret=None):
        group = get_current_placement_group()
        if group is None:
            raise RuntimeError("proposer_placement 'paired': this verifier replica has no placement group "
                               "(AppArgs.verifier_options gives it one)")
        self._args, self._channel_secret = args, channel_secret
        self._group, self._bundle = group, len(group.bundle_specs) - 1
        self.name = paired_proposer_name(ray.get_runtime_context().get_actor_id())
        self.num_restarts = 0
        self.actor = self._ready = None
        self._start()
        # what RemoteProposer calls: feature_layers waits for the first start; a pin does not wait
        # for a replacement (the steps go on without drafts meanwhile)
        self.feature_layers = _Method(self, "feature_layers", when_started=False)
        self.pin = _Method(self, "pin", when_started=True)
        self.propose = _Method(self, "propose", when_started=True)

    def _start(self) -> None:
        spec = dict(self._group.bundle_specs[self._bundle])
        strategy = PlacementGroupSchedulingStrategy(self._group, placement_group_bundle_index=self._bundle,
                                                    placement_group_capture_child_tasks=False)
        self.actor = PairedProposer.options(
            name=self.name, num_cpus=spec.pop("CPU", 0), num_gpus=spec.pop("GPU", 0), memory=spec.pop("memory", None),
            resources=spec, scheduling_strategy=strategy).remote(self._args, self._channel_secret)
        self._ready = self.actor.placement.remote()

    def started(self) -> bool:
        done, _ = ray.wait([self._ready], timeout=0)
        return bool(done)

    def options(self, **_) -> PairedHandle:
        """One actor: nothing to route (RemoteProposer sets its affinity tag here)."""
        return self

    def replace(self, dead) -> None:
        """A call found `dead` gone: start another in its bundle (once, if it is still the current one)."""
        if dead is not self.actor:
            return
        self.num_restarts += 1
        logger.warning("paired proposer %s died; starting another (restart %d)", self.name, self.num_restarts)
        self._start()

    def placement(self, timeout_s: float = 60.0) -> dict:
        """The proposer actor's name, node and GPU ids, and its restarts so far."""
        return {"name": self.name, "namespace": ray.get_runtime_context().namespace,
                "num_restarts": self.num_restarts, **ray.get(self._ready, timeout=timeout_s)}

    def kill(self) -> None:
        if self.actor is not None:
            ray.kill(self.actor, no_restart=True)
            self.actor = None
