"""Requests survive a verifier replica that dies (the ingress side).

A stream that breaks because its verifier replica's actor died is sent again with the output it
had so far (`GenerateRequest.resume_output_ids`, `resume_sent_chars`): the next replica Serve
routes to (another one, or the replacement once it is up) prefills prompt + those tokens and goes
on, and the caller sees one unbroken stream. Greedy output is the same token for token, and so is a
seeded sampled one (its draws are coupled to its seed and positions, not to a stream: rayspec.sampling.sampler);
an unseeded one keeps the target's distribution. A whole (non-streamed) request is sent again
from the start. Usage counts add up over the replicas. Before a request goes again, its call or stream
on the lost replica is cancelled: a replica that is only unreachable (ActorUnavailableError) would
otherwise go on decoding it for no one. A request's deadline (GenerateRequest.timeout_s) holds over
failovers: each replica gets the time left (`time_left`), none left is a RequestTimeoutError. A resumed
stream that Serve refuses for want of room before its first chunk (BackPressureError: its router may still
count the lost replica's request, or the replacement is not up) is tried again after short pauses, within
the deadline: a caller who has part of its output waits rather than ending with a 429 mid-stream.
A verifier replica whose engine hangs fails its health check (step_watchdog_s); Serve then stops it
and its requests come here as from any dead replica.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Awaitable, Callable, TypeVar

from ray.exceptions import ActorUnavailableError, RayActorError
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError

from deployments.transport.protocol import GenerateChunk, GenerateRequest, RequestTimeoutError

logger = logging.getLogger("rayspec.serve")

MAX_FAILOVERS = 3
REPLICA_LOST = (RayActorError, ActorUnavailableError)  # the verifier replica died or cannot be reached

# a resumed stream that Serve refuses for want of room (its router may still count the lost replica's
# request, or the replacement is not up yet): tried again after these pauses, within the deadline
REFUSED = (BackPressureError, DeploymentUnavailableError)
RESUME_PAUSES_S = (0.1, 0.25, 0.5, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 8.0, 8.0, 8.0)

T = TypeVar("T")


def time_left(request: GenerateRequest, started: float) -> GenerateRequest:
    """The request with the time left of its deadline (timeout_s, counted from `started`, a
    time.monotonic()) to send to a replica; a RequestTimeoutError when none is left."""
    if request.timeout_s is None:
        return request
    left = request.timeout_s - (time.monotonic() - started)
    if left <= 0:
        raise RequestTimeoutError(f"the request passed its deadline ({request.timeout_s:.3g} s) "
                                  "while its verifier replica was replaced")
    return request.model_copy(update={"timeout_s": left})


class FailoverCounts:
    """How often requests outlived a lost verifier replica (reported in the ingress's stats)."""

    def __init__(self):
        self.streams = 0  # streams resumed on another replica (one per failover)
        self.requests = 0  # whole requests sent again from the start
        # when a verifier last answered anything (a chunk, a whole call): the ingress's readiness
        # counts it as a health answer, so a verifier busy with a full queue still reads as ready
        self.answered_at: float | None = None

    def as_dict(self) -> dict:
        return {"num_stream_failovers": self.streams, "num_request_failovers": self.requests,
                "num_failovers": self.streams + self.requests}


class FailoverStream:
    """Async iterator of a request's GenerateChunks from the verifier, across replica deaths."""

    def __init__(self, verifier, request: GenerateRequest, counts: FailoverCounts):
        self.verifier, self.request = verifier, request
        self.counts = counts  # the ingress replica's
        self.output_ids: list[int] = []  # every token streamed so far, over all replicas
        self.sent_chars = 0
        self.num_failovers = 0
        self._drafts_before = self._accepted_before = 0  # counts of the replicas that died
        self._drafts = self._accepted = 0  # the current replica's, as of its last chunk
        self._started = time.monotonic()  # the deadline's start
        self._resumed_waiting = False  # resumed after a failover, no chunk from the new replica yet
        self._resume_request: GenerateRequest | None = None
        self._gen = self._open(request)

    def _open(self, request: GenerateRequest):
        return self.verifier.options(stream=True).generate_stream.remote(request)

    def __aiter__(self):
        return self

    async def __anext__(self) -> GenerateChunk:
        refusals = 0
        while True:
            try:
                chunk = await self._gen.__anext__()
                break
            except REFUSED:
                # a stream resumed after a failover, refused before its first chunk: the caller has had
                # part of its output already, so it waits for room rather than ending with a 429
                if not self._resumed_waiting or refusals >= len(RESUME_PAUSES_S):
                    raise
                await asyncio.sleep(RESUME_PAUSES_S[refusals])
                refusals += 1
                logger.info("the resumed stream was refused (no room yet); trying again (%d)", refusals)
                self._gen = self._open(time_left(self._resume_request, self._started))
            except REPLICA_LOST as err:
                if self.num_failovers >= MAX_FAILOVERS:
                    raise
                self._cancel_current()  # unreachable is not dead: it must not decode on for no one
                resumed = time_left(self.request, self._started)  # (none left: RequestTimeoutError)
                self.num_failovers += 1
                self.counts.streams += 1
                logger.warning("verifier replica lost mid-stream (%s); resuming after %d tokens",
                               type(err).__name__, len(self.output_ids))
                self._drafts_before += self._drafts
                self._accepted_before += self._accepted
                self._drafts = self._accepted = 0
                self._resume_request = self.request.model_copy(update={
                    "resume_output_ids": list(self.request.resume_output_ids) + self.output_ids,
                    "resume_sent_chars": self.request.resume_sent_chars + self.sent_chars})
                self._gen = self._open(resumed.model_copy(update={
                    "resume_output_ids": self._resume_request.resume_output_ids,
                    "resume_sent_chars": self._resume_request.resume_sent_chars}))
                self._resumed_waiting = True
        self._resumed_waiting = False
        self.counts.answered_at = time.monotonic()
        self.output_ids += chunk.delta_token_ids
        self.sent_chars += len(chunk.delta_text)
        self._drafts, self._accepted = chunk.num_draft_tokens, chunk.num_accepted_tokens
        if self.num_failovers:
            chunk = chunk.model_copy(update={"num_draft_tokens": self._drafts_before + self._drafts,
                                             "num_accepted_tokens": self._accepted_before + self._accepted})
        return chunk

    def cancel(self) -> None:
        """The caller went away: abort the request on its current replica."""
        self._gen.cancel()

    def _cancel_current(self) -> None:
        try:
            self._gen.cancel()
        except Exception:  # noqa: BLE001 - the replica is gone: nothing left to cancel
            logger.debug("cancelling the lost replica's stream failed", exc_info=True)


async def call_with_failover(call: Callable[[], Awaitable[T]], counts: FailoverCounts) -> T:
    """A whole request: sent again from the start if its verifier replica is lost."""
    for attempt in range(MAX_FAILOVERS + 1):
        response = call()
        try:
            result = await response
            counts.answered_at = time.monotonic()
            return result
        except REPLICA_LOST as err:
            cancel = getattr(response, "cancel", None)
            if cancel is not None:  # a replica that is unreachable may still be running the request
                try:
                    cancel()
                except Exception:  # noqa: BLE001
                    logger.debug("cancelling the lost replica's call failed", exc_info=True)
            if attempt == MAX_FAILOVERS:
                raise
            counts.requests += 1
            logger.warning("verifier replica lost (%s); sending the request again", type(err).__name__)
    raise AssertionError("unreachable")
