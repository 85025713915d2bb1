"""Prefix-aware routing across verifier replicas, through Ray Serve's request-router API.

A generation request goes to the verifier replica that already holds the longest prefix of its
prompt (so that replica's prefix cache skips that much prefill), unless that replica is much
busier than the least busy one; then to the least busy of two random replicas (Serve's default,
power of two choices). The app args' `prefix_routing` block (deployments.config.PrefixRoutingArgs)
turns it on and sets its threshold; deployments/README.md describes the policy.

The index is approximate, as in Dynamo's KV router without KV events and Ray Serve LLM's prefix
affinity router: it records which prompts this router sent where, not what each replica's cache
still holds. A prompt is cut into blocks of `block_size` units (characters of a text prompt, ids of
a token prompt, characters of chat messages written out) and each block is keyed by a hash of
everything up to its end, so two prompts share a key only where they share the whole prefix.
Each router (one per ingress replica, one per driver handle) keeps its own index.
"""

from __future__ import annotations

import json
import logging
import math
import random
import time
from collections import OrderedDict
from collections.abc import Hashable, Iterable, Sequence
from typing import Any

from ray.serve.request_router import FIFOMixin, PendingRequest, ReplicaID, RequestRouter, RunningReplica

logger = logging.getLogger("ray.serve")

RESERVATION_TTL_S = 30.0  # a preferred request never routed (cancelled) stops counting after this
ROUTED_METHODS = ("generate", "generate_stream")  # verifier calls that carry a prompt to prefill


def prompt_units(request: Any) -> str | tuple[int, ...] | None:
    """What a GenerateRequest (or its dict) prefills, as a sequence to cut into blocks: the text
    prompt, the token-id prompt, or the tools and chat messages written out as text; None when
    there is none."""
    get = request.get if isinstance(request, dict) else lambda key: getattr(request, key, None)
    prompt = get("prompt")
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, (list, tuple)):
        return tuple(prompt)
    messages = get("messages")
    if not messages:
        return None
    # the chat template puts tools ahead of the messages; keys sorted so one dict prints one way
    parts = [json.dumps(get("tools"), sort_keys=True)] if get("tools") else []
    parts += [json.dumps(m, sort_keys=True) if isinstance(m, dict) else str(m) for m in messages]
    return "\n".join(parts)


def block_hashes(units: str | Sequence[int], block_size: int) -> list[int]:
    """One key per full block of `units`: the hash of the block and the key before it, so a key
    stands for the whole prefix up to the block's end. A last partial block gets no key."""
    keys, key = [], 0
    for start in range(0, len(units) - block_size + 1, block_size):
        key = hash((key, units[start:start + block_size]))
        keys.append(key)
    return keys


class PrefixIndex:
    """Which replicas were sent which prompt prefixes, as (block key, replica) entries; at most
    `max_entries`, the least recently used dropped first."""

    def __init__(self, max_entries: int):
        self.max_entries = max_entries
        self._holders: dict[int, set[Hashable]] = {}  # block key -> replicas sent that prefix
        self._lru: OrderedDict[tuple[int, Hashable], None] = OrderedDict()  # oldest first
        self._per_replica: dict[Hashable, int] = {}  # replica -> its entries

    def __len__(self) -> int:
        return len(self._lru)

    @property
    def replicas(self) -> set[Hashable]:
        return set(self._per_replica)

    def num_entries(self, replica: Hashable) -> int:
        return self._per_replica.get(replica, 0)

    def match(self, keys: Sequence[int], replicas: Iterable[Hashable]) -> dict[Hashable, int]:
        """replica -> how many of `keys`, from the first on, it holds (its matched blocks)."""
        matched = dict.fromkeys(replicas, 0)
        still = set(matched)
        for i, key in enumerate(keys):
            still &= self._holders.get(key, set())
            if not still:
                break
            for replica in still:
                matched[replica] = i + 1
        return matched

    def insert(self, keys: Sequence[int], replica: Hashable) -> None:
        # last block first: a prompt's first blocks are then its most recently used, so eviction
        # shortens a cached prefix from its end instead of cutting it off at its start
        for key in reversed(keys):
            entry = (key, replica)
            if entry in self._lru:
                self._lru.move_to_end(entry)
                continue
            self._lru[entry] = None
            self._holders.setdefault(key, set()).add(replica)
            self._per_replica[replica] = self._per_replica.get(replica, 0) + 1
        while len(self._lru) > self.max_entries:
            self._drop(*self._lru.popitem(last=False)[0])

    def remove_replica(self, replica: Hashable) -> None:
        if replica not in self._per_replica:
            return
        for entry in [e for e in self._lru if e[1] == replica]:
            del self._lru[entry]
            self._drop(*entry)

    def keep_only(self, replicas: Iterable[Hashable]) -> None:
        """Forget the replicas not in `replicas` (gone from the deployment)."""
        for replica in self.replicas - set(replicas):
            self.remove_replica(replica)

    def _drop(self, key: int, replica: Hashable) -> None:
        holders = self._holders[key]
        holders.discard(replica)
        if not holders:
            del self._holders[key]
        self._per_replica[replica] -= 1
        if not self._per_replica[replica]:
            del self._per_replica[replica]


def preferred_replicas(matched: dict[Hashable, int], loads: dict[Hashable, int], imbalance_threshold: float,
                       min_matched: int) -> list[Hashable]:
    """The replicas to try first: among those with a known load (ongoing requests) at most
    `imbalance_threshold` above the least busy one's, the ones with the longest matched prefix,
    when that is at least `min_matched` blocks; else [] (no preference)."""
    if not loads:
        return []
    least = min(loads.values())
    eligible = [r for r, load in loads.items() if load - least <= imbalance_threshold]
    longest = max(matched.get(r, 0) for r in eligible)
    if longest < max(1, min_matched):
        return []
    return [r for r in eligible if matched.get(r, 0) == longest]


class PrefixAwareRouter(FIFOMixin, RequestRouter):
    """Serve's request router for the Verifier deployment (`request_router_config`).

    FIFOMixin, as Serve's own default router has it: the choices of one HTTP request (n > 1) are
    separate verifier calls that share the request's internal id (Serve's handles take it from the
    ingress's request context), and Serve's router indexes pending requests by that id, one per id.
    Without FIFOMixin's fallback, a replica chosen for the second choice found no pending request to
    give itself to (the first had taken the id's entry), so that choice's routing task chose again,
    forever, probing the replicas' queue lengths each time without backoff: the request never
    answered, and the probes (thousands a second, more than the replicas answered) queued up in the
    ingress until no call reached a verifier (tests/serve/test_serve_faults.py, the n > 1 test).

    choose_replicas returns ranks: the preferred replicas first (preferred_replicas), then two
    random ones; Serve takes the least busy replica of the first rank that has room. The index
    learns a prompt when a replica accepts it (on_request_routed) and forgets replicas that go.
    """

    def initialize_state(self, imbalance_threshold: float = 8, min_match_ratio: float = 0.1, block_size: int = 64,
                         max_entries: int = 200_000) -> None:
        self.imbalance_threshold = imbalance_threshold
        self.min_match_ratio = min_match_ratio
        self.block_size = block_size
        self.index = PrefixIndex(max_entries)
        # requests this router preferred a replica for and has not yet seen routed: request id ->
        # (replica, when). Counted in that replica's load, so a burst of requests chosen at once
        # (Serve runs several routing tasks concurrently, each reading the same queue lengths
        # before any of them is sent) spills past imbalance_threshold instead of all going to
        # the prefix's replica. Forgotten once Serve has chosen its replica (_choose_replica_for_request;
        # on_request_routed where that hook is missing) or it completed, or after RESERVATION_TTL_S.
        self._reserved: dict[str, tuple[ReplicaID, float]] = {}

    def _keys(self, pending_request: PendingRequest | None) -> tuple[list[int], int]:
        """(block keys, prompt length in units) of a generation request; ([], 0) for other calls."""
        if pending_request is None or pending_request.metadata.call_method not in ROUTED_METHODS:
            return [], 0
        units = next((u for u in map(prompt_units, pending_request.args) if u is not None), None)
        if units is None:
            return [], 0
        return block_hashes(units, self.block_size), len(units)

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        two = random.sample(candidate_replicas, min(2, len(candidate_replicas)))
        try:
            preferred = await self._preferred(candidate_replicas, pending_request)
        except Exception:  # noqa: BLE001 - a routing hint must never fail a request
            logger.exception("prefix routing failed; routing by load alone")
            preferred = []
        return [preferred, two] if preferred else [two]

    async def _preferred(self, candidates: list[RunningReplica],
                         pending_request: PendingRequest | None) -> list[RunningReplica]:
        keys, length = self._keys(pending_request)
        if not keys or len(candidates) < 2:
            return []
        by_id = {r.replica_id: r for r in candidates}
        matched = self.index.match(keys, by_id)
        min_matched = math.ceil(self.min_match_ratio * length / self.block_size)
        if max(matched.values()) < max(1, min_matched):  # nothing worth a look at the loads
            return []
        loads = await self._loads(candidates)
        request_id = pending_request.metadata.internal_request_id
        now = time.monotonic()
        self._reserved.pop(request_id, None)  # chosen again (its first choice was full): count it once
        for rid, (replica, since) in list(self._reserved.items()):
            if now - since > RESERVATION_TTL_S:
                del self._reserved[rid]
            elif replica in loads:
                loads[replica] += 1
        preferred = preferred_replicas(matched, loads, self.imbalance_threshold, min_matched)
        if preferred:
            self._reserved[request_id] = (min(preferred, key=loads.__getitem__), now)
        return [by_id[r] for r in preferred]

    async def _loads(self, candidates: list[RunningReplica]) -> dict[ReplicaID, int]:
        """Ongoing requests of each candidate with room for one more: from Serve's queue-length cache
        (kept up to date by every request's accept/reject answer), probing those not in it or full
        there (as Serve's own selection does)."""
        loads: dict[ReplicaID, int] = {}
        to_probe = []
        for r in candidates:
            load = self.replica_queue_len_cache.get(r.replica_id) if self._use_replica_queue_len_cache else None
            if load is None or load >= r.max_ongoing_requests:
                to_probe.append(r)
            else:
                loads[r.replica_id] = load
        if to_probe:
            # RequestRouter's own probe (the one Serve's selection uses); it updates the cache
            for r, load in await self._probe_queue_lens(to_probe, 0):
                if load is not None and load < r.max_ongoing_requests:
                    loads[r.replica_id] = load
        return loads

    async def _choose_replica_for_request(self, pending_request: PendingRequest, *, is_retry: bool = False
                                          ) -> RunningReplica:
        # Serve counts a request in its queue-length cache (on_send_request) right after this returns,
        # with no await in between: the reservation ends here, so the request is never counted twice.
        # Counted twice until it was accepted (on_request_routed, one round trip later), a burst's
        # concurrent routing tasks saw the prefix's replica one or more requests busier than it was
        # and spilled early. (A private hook of Serve's RequestRouter; were it renamed, this is never
        # called and the reservation ends at on_request_routed, as before.)
        try:
            return await super()._choose_replica_for_request(pending_request, is_retry=is_retry)
        finally:
            self._reserved.pop(pending_request.metadata.internal_request_id, None)

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        self._reserved.pop(pending_request.metadata.internal_request_id, None)  # normally gone at the choice
        keys, _ = self._keys(pending_request)
        if keys:
            self.index.insert(keys, replica_id)

    def on_request_completed(self, replica_id: ReplicaID, internal_request_id: str) -> None:
        super().on_request_completed(replica_id, internal_request_id)
        self._reserved.pop(internal_request_id, None)

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        super().update_replicas(replicas)
        self.index.keep_only(self.curr_replicas)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        super().on_replica_actor_died(replica_id)
        self.index.remove_replica(replica_id)
