"""After a failover the old replica's call or stream is cancelled (deployments.frontend.failover): a replica
that is only unreachable (ActorUnavailableError) would otherwise go on decoding for no one. Handle
doubles, no Ray cluster."""

from __future__ import annotations

import asyncio

from ray.exceptions import ActorUnavailableError

from deployments.frontend.failover import FailoverCounts, FailoverStream, call_with_failover
from deployments.transport.protocol import GenerateChunk, GenerateRequest


def _chunk(tokens, finished):
    return GenerateChunk(request_id="r", delta_text="x" * len(tokens), delta_token_ids=tokens, finished=finished,
                         num_prompt_tokens=3, num_output_tokens=0, num_draft_tokens=0, num_accepted_tokens=0)


class _Stream:
    def __init__(self, items):
        self.items, self.cancelled = list(items), False

    def __aiter__(self):
        return self

    async def __anext__(self):
        item = self.items.pop(0)
        if isinstance(item, BaseException):
            raise item
        return item

    def cancel(self):
        self.cancelled = True


class _Verifier:
    """generate_stream: the first replica streams a chunk, then becomes unreachable; the next one
    finishes. generate: the first call fails the same way."""

    def __init__(self):
        self.streams, self.responses = [], []

    def options(self, **kwargs):
        return self

    @property
    def generate_stream(self):
        outer = self

        class _Method:
            def remote(self, request):
                lost = ActorUnavailableError("unreachable", None)
                items = [_chunk([1, 2], False), lost] if not outer.streams else [_chunk([3], True)]
                outer.streams.append(_Stream(items))
                return outer.streams[-1]
        return _Method()


class _Response:
    def __init__(self, fail):
        self.fail, self.cancelled = fail, False

    def __await__(self):
        if self.fail:
            raise ActorUnavailableError("unreachable", None)
        return "done"
        yield  # a generator: awaitable

    def cancel(self):
        self.cancelled = True


def test_a_failed_over_stream_cancels_the_old_one():
    verifier = _Verifier()
    stream = FailoverStream(verifier, GenerateRequest(prompt=[5, 6, 7]), FailoverCounts())

    async def read_all():
        out = []
        async for chunk in stream:
            out.append(chunk)
            if chunk.finished:
                return out

    chunks = asyncio.run(read_all())
    assert sum((c.delta_token_ids for c in chunks), []) == [1, 2, 3] and stream.num_failovers == 1
    assert verifier.streams[0].cancelled and not verifier.streams[1].cancelled


def test_a_failed_over_call_cancels_the_old_one():
    responses = []

    def call():
        responses.append(_Response(fail=not responses))
        return responses[-1]

    counts = FailoverCounts()
    assert asyncio.run(call_with_failover(call, counts)) == "done" and counts.requests == 1
    assert responses[0].cancelled and not responses[1].cancelled
