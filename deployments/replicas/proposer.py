"""The proposer deployment: any registered rayspec proposer (ngram, draft_model, eagle3, eagle) behind a handle.

State (a draft model's KV cache) is keyed by the verifier's seq ids, which are unique per
verifier replica, so several verifiers can share one proposer. A replica that never saw a
sequence (or lost it: restart, another replica) simply re-prefills from the token list the
request carries (the draft model proposer recomputes from the common prefix); n-gram is stateless.

EAGLE heads draft from the target's hidden states: the verifier asks once for `feature_layers`,
then its engine extracts those features and sends each sequence's new rows with every request
(CPU tensors; moved to this replica's device here). The head's cache is built from that stream,
so each verifier's calls carry its tag as Serve's multiplexed model id and stick to one proposer
replica; a replica that lacks a sequence's features (first call routed elsewhere, a replaced
replica) answers `resend_features_from` and the verifier's RemoteProposer sends them again.
Without the target in this process, the head loads the target's embedding (and, for EAGLE-1,
its LM head) itself.

Transport: `pin` answers with the address of this replica's direct channel
(deployments.transport.direct_channel), and the verifier sends its per-step calls there, skipping Serve's
routing; `propose` through the Serve handle stays for verifiers that cannot connect. The channel
admits only verifiers holding the application's channel secret (a constructor argument, given by
deployments.app to the verifier and proposer deployments alone) and checks every call against
this replica's shapes: the EAGLE feature width, max_num_seqs requests, max_model_len tokens.

ProposerServer is all of this but Serve's part (the multiplexed pin, the autoscaling signal): the
Proposer deployment is a pool of it, and `proposer_placement: paired` runs one per verifier replica
as a plain Ray actor in that replica's placement group (deployments.replicas.pairing).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time

import torch
from ray import serve

from deployments.operations.autoscaling import BUSY_METRIC, BusyMeter
from deployments.config import load_app_args, replica_device
from deployments.transport.direct_channel import ChannelServer
from deployments.transport.wire import CallLimits
from rayspec.config import ProposerContext, set_torch_threads
from rayspec.memory.malloc import keep_freed_memory
from rayspec.model.loader import parse_dtype
from rayspec.proposers import Draft, ProposeRequest, build_proposer
from rayspec.proposers.pre_draft import PreDrafter, PreDraftThread

logger = logging.getLogger("ray.serve")


def make_proposer(args):
    cfg = load_app_args(args)
    set_torch_threads(cfg.engine.num_threads)
    device = torch.device(replica_device(cfg.engine.device))
    if device.type == "cpu":
        keep_freed_memory()
    context = ProposerContext(cfg.model, cfg.engine.max_model_len, cfg.proposer_num_slots(), device,
                              parse_dtype(cfg.engine.dtype, device),
                              max_num_batched_tokens=cfg.engine.max_num_batched_tokens)
    return build_proposer(cfg.speculative, context), device


def feature_width(proposer) -> int | None:
    """F of the features [m, F] an EAGLE proposer takes (the head's fc input); None: it takes none."""
    if proposer.feature_layers is None:
        return None
    return proposer.head.config.feature_size


class ProposerServer:
    """One proposer and its direct channel, without Serve: the Proposer deployment below and the
    paired proposer actor (deployments.replicas.pairing) are both this."""

    def __init__(self, args: dict, channel_secret=None):
        self.cfg = load_app_args(args)
        self.proposer, self.device = make_proposer(self.cfg)
        self._channel_secret = channel_secret  # pydantic SecretStr from deployments.app: its repr hides it
        self._lock = threading.Lock()  # proposer state is not thread-safe
        self._channel: ChannelServer | None = None
        self._channel_lock = threading.Lock()
        self.num_calls = 0
        self.num_requests = 0
        self.num_tree_drafts = 0
        self.propose_seconds = 0.0  # drafting time inside this replica (the rest of a call is transport)
        self.busy = BusyMeter()  # the pool's autoscaling signal (deployments.operations.autoscaling)
        # asynchronous drafting: pre-drafts while the verifier verifies (rayspec.proposers.pre_draft)
        self.pre_drafter: PreDrafter | None = None
        self._pre_draft_thread: PreDraftThread | None = None
        if self.cfg.proposer_async_hypotheses:
            self.pre_drafter = PreDrafter(self.proposer, self.cfg.proposer_async_hypotheses,
                                          self.cfg.engine.max_model_len,
                                          budget=self.cfg.proposer_async_pacing == "measured")
            self._pre_draft_thread = PreDraftThread(self.pre_drafter)

    def feature_layers(self) -> tuple[int, ...] | None:
        """What the verifier's engine must hand over (rayspec.proposers.base.Proposer.feature_layers)."""
        layers = self.proposer.feature_layers
        return None if layers is None else tuple(layers)

    async def pin(self) -> dict:
        """The address of this replica's direct channel, for the per-step calls."""
        return {"channel": self._channel_address()}

    def _channel_address(self) -> tuple[str, int] | None:
        """Started on the first pin: the direct channel (deployments.transport.direct_channel) on this node's address."""
        with self._channel_lock:
            if self._channel is None:
                try:
                    import ray

                    host = ray.util.get_node_ip_address()
                except Exception:  # noqa: BLE001 - outside Ray
                    host = "127.0.0.1"
                limits = CallLimits(feature_width=feature_width(self.proposer),
                                    max_requests=self.cfg.engine.max_num_seqs,
                                    max_seq_tokens=self.cfg.engine.max_model_len)
                try:
                    self._channel = ChannelServer(self._propose, self._channel_secret, host, limits,
                                                  max_frame_bytes=self.cfg.proposer_channel_max_frame_mib << 20)
                except OSError:
                    logger.exception("no direct channel; calls go through Serve")
                    return None
            return self._channel.address

    async def propose(self, requests: list[ProposeRequest], released: list[str] | None = None) -> list[Draft]:
        return await asyncio.to_thread(self._propose, requests, released)

    def _propose(self, requests: list[ProposeRequest], released: list[str] | None) -> list[Draft]:
        for r in requests:
            if r.features is not None and r.features.device != self.device:
                r.features = r.features.to(self.device)
        with self._lock:
            for seq_id in released or ():
                if self.pre_drafter is not None:
                    self.pre_drafter.release(seq_id)
                else:
                    self.proposer.release(seq_id)
            if not requests:
                return []
            started = time.perf_counter()
            with self.busy:
                if self.pre_drafter is not None:
                    drafts = self.pre_drafter.propose(requests)
                    self._pre_draft_thread.kick()  # pre-drafts the next step while the verifier verifies
                else:
                    drafts = self.proposer.propose(requests)
            self.propose_seconds += time.perf_counter() - started
            self.num_calls += 1
            self.num_requests += len(requests)
        for d in drafts:  # CPU tensors travel anywhere (the verifier moves them to its device)
            if d.probs is not None and d.probs.device.type != "cpu":
                d.probs = d.probs.cpu()
            if not d.is_chain:  # token trees (EAGLE, greedy) travel as they are: tokens + parents
                self.num_tree_drafts += 1
        return drafts

    def stats(self) -> dict:
        layers = self.proposer.feature_layers
        try:
            replica = serve.get_replica_context().replica_id.unique_id
        except Exception:  # noqa: BLE001 - outside Serve
            replica = None
        return {"replica": replica, "method": self.proposer.name, "device": str(self.device),
                "num_calls": self.num_calls,
                "propose_seconds": round(self.propose_seconds, 4), "busy": round(self.busy.fraction(), 4),
                "num_requests": self.num_requests, "num_tree_drafts": self.num_tree_drafts,
                "feature_layers": None if layers is None else list(layers),
                **(self.pre_drafter.stats.as_dict() if self.pre_drafter is not None else {}),
                # the direct channel: authenticated connections, and those closed (failed handshake,
                # malformed or oversized frame, too many connections)
                "channel_connections": self._channel.num_connections if self._channel else 0,
                "channel_rejected": self._channel.num_rejected if self._channel else 0,
                # draft KV slots (draft models, EAGLE heads): those held by sequences of live verifiers,
                # or of a lost one's until they are the stalest when a slot is needed
                **(self.proposer.kv_usage() or {})}


@serve.deployment
class Proposer(ProposerServer):
    """The proposer pool (proposer_placement 'pool'): verifier replicas pin replicas of it."""

    @serve.multiplexed(max_num_models_per_replica=4096)
    async def _register(self, verifier_tag: str) -> str:
        """Nothing to load: registering the verifier's tag makes Serve's router send that verifier's
        later calls here, to the replica holding its sequences' state (see RemoteProposer)."""
        return verifier_tag

    async def pin(self) -> dict:
        """Registers the caller's tag (its multiplexed model id) on this replica, so the router sends
        the caller's calls here. propose does not register: see RemoteProposer for why. Returns the
        address of this replica's direct channel, for the per-step calls."""
        tag = serve.get_multiplexed_model_id()
        if tag:
            await self._register(tag)
        return await super().pin()

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """Serve's custom autoscaling metric: the fraction of the last seconds spent drafting, over
        the direct channel and Serve alike (deployments.operations.autoscaling.ProposerBusyPolicy reads it)."""
        return {BUSY_METRIC: self.busy.fraction()}
