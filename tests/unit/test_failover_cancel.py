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


def test_a_resumed_stream_refused_for_room_waits_for_it(monkeypatch):
    """The stream's replica is lost after a chunk; Serve refuses the resumed stream twice for want of room
    (BackPressureError: its router still counting the lost replica's request, the replacement not up yet;
    seen in CI as a 429 in the middle of a 200 stream). The stream waits and resumes: the caller gets every
    token once, and a refusal before any failover still raises (a new request is answered with a 429)."""
    import deployments.frontend.failover as failover
    from ray.serve.exceptions import BackPressureError

    monkeypatch.setattr(failover, "RESUME_PAUSES_S", (0.0,) * 4)

    class Refusing(_Verifier):
        @property
        def generate_stream(self):
            outer = self

            class _Method:
                def remote(self, request):
                    n = len(outer.streams)
                    if n == 0:
                        items = [_chunk([1, 2], False), ActorUnavailableError("unreachable", None)]
                    elif n in (1, 2):
                        items = [BackPressureError(num_queued_requests=1, max_queued_requests=1)]
                    else:
                        assert request.resume_output_ids == [1, 2]
                        items = [_chunk([3], True)]
                    outer.streams.append(_Stream(items))
                    return outer.streams[-1]
            return _Method()

    async def read_all(stream):
        out = []
        async for chunk in stream:
            out += chunk.delta_token_ids
            if chunk.finished:
                return out

    verifier = Refusing()
    counts = FailoverCounts()
    assert asyncio.run(read_all(FailoverStream(verifier, GenerateRequest(prompt=[5, 6, 7]), counts))) == [1, 2, 3]
    assert len(verifier.streams) == 4 and counts.streams == 1

    class RefusedAtOnce(_Verifier):
        @property
        def generate_stream(self):
            class _Method:
                def remote(self, request):
                    return _Stream([BackPressureError(num_queued_requests=1, max_queued_requests=1)])
            return _Method()

    try:
        asyncio.run(read_all(FailoverStream(RefusedAtOnce(), GenerateRequest(prompt=[5]), FailoverCounts())))
    except BackPressureError:
        pass
    else:
        raise AssertionError("a new stream refused for room must raise (the ingress answers 429)")
