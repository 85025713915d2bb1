"""A rayspec Proposer that drafts in another Serve deployment (the disaggregated topology).

Transport: the `pin` call goes through Serve and answers with the pinned replica's direct channel
address (deployments.transport.direct_channel); with `direct` (the default) and the application's channel
secret the per-step calls then go over that socket, skipping Serve's routing. Without a channel
(`direct=False`, no secret, no address, or the connection or its handshake fails) they go through
the handle, as described below, and so does a single call too large for the channel's frame
limit; everything else here (affinity, resends, failures, back-off) is the same for both paths.

One RPC per engine step carries the whole batch (ProposeRequest list -> Draft list); releases of
finished sequences are queued and ride along on the next call (or on `flush()`, which the engine
loop calls when idle), so there is never an RPC per request per token. It blocks the engine
thread, which is where the engine calls it: `handle.propose.remote(...).result()`.

Affinity: every call carries this verifier replica's tag as Serve's multiplexed model id, so the
router keeps sending one verifier's batches to the same proposer replica (the one that holds
their draft state) while there are several. The tag is registered on exactly one replica, by a
`pin` call before the first propose (and again after a failed call: that replica may be gone);
propose calls never register it. Why: the router learns registrations a moment late, and calls
sent in that moment go to any replica; had they registered the tag too, it would sit on every
replica and the router would spread the verifier's calls over all of them for good.

EAGLE: `feature_layers` is asked of the proposer deployment once, at construction; the engine
reads it and then puts the target features of every newly committed token into the requests,
which are sent as CPU tensors. The features sent are also kept here, per sequence: a proposer
replica that lacks a sequence's features (its first call landed elsewhere, the replica was
replaced, or it evicted the sequence) answers with `resend_features_from`, and the same call is
retried once for those sequences with the features again from that position. So with several
proposer replicas, or after one is replaced, requests keep going; a sequence that is still not
caught up after the retry just gets no draft for that step. Drafts come back whole: token trees
keep their `parents`.

A failed call (the proposer replica died mid-call, or the call timed out) loses nothing either:
that step runs without drafts (a plain target step, so outputs are unchanged), and the next call
goes to whichever replica Serve routes to; a replacement replica asks for the features again.
After a failure the proposer is left alone for a while (1 s, doubling on each failure in a row up
to a minute): steps in between run without drafts at once, so a proposer that hangs costs one
timeout per interval, not one per step.

Seeds: a seeded request's seed goes to the proposer as it is. The verifier draws a seeded request
coupled (rayspec.sampling.sampler): every token it emits is the target's own draw at that position, whatever
was drafted, so a proposer that knows the seed can only draft better (the same noise as the
target's), never move the output.
"""

from __future__ import annotations

import dataclasses
import logging
import time

import torch

from deployments.transport.direct_channel import DEFAULT_MAX_FRAME_BYTES, CallTooLarge, ChannelClient
from deployments.transport.wire import ReplyLimits, check_drafts
from rayspec.proposers import Draft, Proposer, ProposeRequest

logger = logging.getLogger(__name__)


def _route_in_own_loop(handle) -> None:
    """Give the handle a router on its own event loop, so the engine thread (no asyncio loop) can
    block on `.result()`. Serve does that by default, but not with RAY_SERVE_THROUGHPUT_OPTIMIZED=1
    (or RAY_SERVE_RUN_ROUTER_IN_SEPARATE_LOOP=0), where the router runs in the caller's loop and a
    sync call from the engine thread fails; `_init` is the knob Serve's own error message names."""
    if getattr(handle, "is_initialized", True):  # test doubles, or already set up by the caller
        return
    try:
        handle._init(_run_router_in_separate_loop=True)
    except Exception:  # noqa: BLE001 - another Serve version: keep its defaults
        logger.warning("could not set the proposer handle's router loop; using Serve's default", exc_info=True)


class RemoteProposer(Proposer):
    name = "remote"
    in_process = False  # its draft cache lives in the proposer deployment, not in this engine's KV budget

    MAX_BACKOFF_S = 60.0

    def __init__(self, handle, device: torch.device | str | None = None, timeout_s: float | None = 30.0,
                 startup_timeout_s: float | None = 1800.0, affinity: str | None = None, clock=time.monotonic,
                 direct: bool = True, channel_secret=None, vocab_size: int | None = None,
                 max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES, repin_interval_s: float | None = None):
        _route_in_own_loop(handle)
        self.direct = direct  # per-step calls over the pinned replica's direct channel when it offers one
        self._channel: ChannelClient | None = None
        self._channel_secret = channel_secret  # the application's (deployments.app); never logged
        self.vocab_size = vocab_size  # the target's: what the drafts' tokens and probs are checked against
        self.max_frame_bytes = max_frame_bytes
        self.num_direct_calls = 0
        self._base_handle = handle
        self.handle = handle.options(multiplexed_model_id=affinity) if affinity else handle
        self.affinity = affinity
        self._pinned = affinity is None  # with a tag, the first call pins it to one proposer replica
        # pin again (a new tag, so Serve's router chooses afresh) this often: spreads the verifiers
        # over a proposer pool that grew (deployments.operations.autoscaling)
        self.repin_interval_s = repin_interval_s if affinity else None
        self.num_repins = 0
        self._pinned_at = float("-inf")
        self.device = torch.device(device) if device is not None else None
        self.timeout_s = timeout_s
        self._released: list[str] = []
        self.num_calls = 0
        self.num_resent = 0  # sequences whose features were sent again (a replica lacked them)
        self.num_failed_calls = 0  # calls that raised (replica died, timeout): those steps had no drafts
        self.num_skipped_steps = 0  # steps without drafts because a failure was recent
        self._clock, self._backoff_s, self._skip_until = clock, 0.0, float("-inf")
        self.num_cache_hits = 0  # drafts the proposer had pre-drafted (deployments.replicas.proposer, async_hypotheses)
        self.num_cache_misses = 0  # drafts it drafted on the call while pre-drafting
        self.call_seconds = 0.0  # wall time of propose calls seen from here (transport + drafting)
        self.num_hit_calls = 0  # calls answered from the speculation cache alone (no drafting on the call)
        self.hit_call_seconds = 0.0  # their wall time: the call's own cost (transport, the handler)
        # waits for the proposer replica to be up (it may be loading a large target's embedding)
        layers = handle.feature_layers.remote().result(timeout_s=startup_timeout_s)
        self.feature_layers: tuple[int, ...] | None = None if layers is None else tuple(layers)
        self._sent: dict[str, list[torch.Tensor]] = {}  # seq id -> CPU features sent so far, in order
        self._inflight = None  # the handle call being waited on (close() cancels it)
        self._closed = False

    def _portable(self, req: ProposeRequest) -> ProposeRequest:
        update = {}
        if req.features is not None and req.features.device.type != "cpu":
            update["features"] = req.features.cpu()
        return dataclasses.replace(req, **update) if update else req

    def _remember(self, req: ProposeRequest) -> None:
        if req.features is not None and len(req.features):
            self._sent.setdefault(req.seq_id, []).append(req.features)

    def _again(self, req: ProposeRequest, start: int) -> ProposeRequest:
        sent = torch.cat(self._sent.get(req.seq_id) or [torch.empty(0)])
        return dataclasses.replace(req, features=sent[start:] if len(sent) > start else None, features_start=start)

    def close(self) -> None:
        """The replica is shutting down (EngineLoop.shutdown, from another thread than the engine's):
        no call waits on the proposer any more, and one waiting now is cancelled (a proposer
        deployment going down with the app would otherwise hold the engine thread up to timeout_s)."""
        self._closed = True
        response = self._inflight
        if response is not None:
            response.cancel()
        self._drop_channel()

    def _result(self, response):
        """A handle call's result, cancellable by close()."""
        self._inflight = response
        try:
            if self._closed:
                raise RuntimeError("the remote proposer is closed")
            return response.result(timeout_s=self.timeout_s)
        except Exception:
            response.cancel()  # a timed-out call must not run later on stale state (no-op once failed)
            raise
        finally:
            self._inflight = None

    def _pin(self) -> None:
        answer = self._result(self.handle.pin.remote())
        self._pinned = True
        self._pinned_at = self._clock()
        address = (answer or {}).get("channel") if isinstance(answer, dict) else None
        if self.direct and address is not None and self._channel_secret is None:
            logger.warning("no channel secret for the proposer's direct channel; calls go through Serve")
        elif self.direct and address is not None:
            try:
                self._channel = ChannelClient(tuple(address), self._channel_secret, self.timeout_s,
                                              ReplyLimits(vocab_size=self.vocab_size), self.max_frame_bytes)
            except OSError as err:  # a firewall between nodes, another secret: Serve's path still works
                logger.warning("no direct channel to the proposer at %s (%s); calls go through Serve", address, err)

    def _repin_due(self) -> bool:
        return (self._pinned and self.repin_interval_s is not None
                and self._clock() - self._pinned_at >= self.repin_interval_s)

    def _repin(self) -> None:
        """Leave the pinned replica: the next call pins a new tag wherever Serve's router sends it
        (the least busy of two replicas it samples). Landing on another replica costs one resend of
        the sequences' features (`resend_features_from`); the old replica's draft state for them is
        evicted there as slots are needed."""
        self.num_repins += 1
        self.handle = self._base_handle.options(multiplexed_model_id=f"{self.affinity}.{self.num_repins}")
        self._drop_channel()
        self._pinned = False

    def _drop_channel(self) -> None:
        channel, self._channel = self._channel, None
        if channel is not None:
            channel.close()  # a reply still on its way would be read as the next call's

    def _call(self, requests: list[ProposeRequest], released: list[str]) -> list[Draft]:
        started = time.perf_counter()
        drafts = None
        if self._channel is not None:
            try:
                drafts = self._channel.call(requests, released)
                self.num_direct_calls += 1
            except CallTooLarge as err:  # nothing was sent: this one call goes through Serve
                logger.warning("%s; this call goes through Serve", err)
            except Exception:
                self._drop_channel()
                raise
        if drafts is None:  # through Serve's handle: held to the channel's checks all the same
            drafts = check_drafts(self._result(self.handle.propose.remote(requests, released)),
                                  ReplyLimits(vocab_size=self.vocab_size), len(requests))
        self.num_calls += 1
        took = time.perf_counter() - started
        self.call_seconds += took
        if drafts and all(d.pre_drafted for d in drafts):
            self.num_hit_calls += 1
            self.hit_call_seconds += took
        return drafts

    def propose(self, requests: list[ProposeRequest]) -> list[Draft]:
        requests = [self._portable(r) for r in requests]
        for r in requests:
            self._remember(r)
        if self._closed:
            return [Draft([]) for _ in requests]
        if self._clock() < self._skip_until:  # a recent failure: do not wait on the proposer again yet
            self.num_skipped_steps += 1
            return [Draft([]) for _ in requests]
        released, self._released = self._released, []
        try:
            if self._repin_due():
                self._repin()
            if not self._pinned:
                self._pin()
            drafts = self._call(requests, released)
            self._backoff_s = 0.0
        except Exception as err:  # noqa: BLE001 - a lost proposer costs this step's drafts, not the requests
            self._released = released + self._released  # try again next time
            return self._no_drafts(requests, err)
        retry = [i for i, d in enumerate(drafts) if d.resend_features_from is not None]
        if retry:
            self.num_resent += len(retry)
            try:
                again = self._call([self._again(requests[i], drafts[i].resend_features_from) for i in retry], [])
            except Exception as err:  # noqa: BLE001
                again = self._no_drafts([requests[i] for i in retry], err)
            for i, d in zip(retry, again):
                if d.resend_features_from is not None:
                    logger.warning("proposer still lacks features of %s; no draft this step", requests[i].seq_id)
                    d = Draft([])
                drafts[i] = d
        for d in drafts:
            if d.pre_drafted is not None:
                self.num_cache_hits += d.pre_drafted
                self.num_cache_misses += not d.pre_drafted
        if self.device is not None:
            for d in drafts:
                if d.probs is not None and d.probs.device != self.device:
                    d.probs = d.probs.to(self.device)
        return drafts

    def _no_drafts(self, requests: list[ProposeRequest], err: Exception) -> list[Draft]:
        self.num_failed_calls += 1
        self._pinned = self.affinity is None  # pin again: that replica may be gone
        self._drop_channel()
        self._backoff_s = min(max(2 * self._backoff_s, 1.0), self.MAX_BACKOFF_S)
        self._skip_until = self._clock() + self._backoff_s
        logger.warning("proposer call failed (%s: %s); %d sequence(s) step without drafts",
                       type(err).__name__, err, len(requests))
        return [Draft([]) for _ in requests]

    def release(self, seq_id: str) -> None:
        self._released.append(seq_id)
        self._sent.pop(seq_id, None)

    def flush(self) -> None:
        if self._released:
            self.propose([])

    def stats(self) -> dict[str, float]:
        """The per-step proposer RPC, for the verifier's /v1/stats."""
        return {"proposer_calls": self.num_calls, "proposer_direct_calls": self.num_direct_calls,
                "proposer_call_seconds": round(self.call_seconds, 4), "proposer_features_resent": self.num_resent,
                "proposer_failed_calls": self.num_failed_calls, "proposer_skipped_steps": self.num_skipped_steps,
                "proposer_repins": self.num_repins, "speculation_cache_hits": self.num_cache_hits,
                "speculation_cache_misses": self.num_cache_misses, "proposer_hit_calls": self.num_hit_calls,
                "proposer_hit_call_seconds": round(self.hit_call_seconds, 4)}
