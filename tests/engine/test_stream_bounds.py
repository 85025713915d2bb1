"""Bounded streams (issue #35): the engine hands a streaming server deltas, not copies of the whole
output so far (memory per buffered output is its step's tokens, not the request's), and a verifier
replica cuts off a reader that leaves more than max_buffered_outputs outputs unread: the request is
aborted (its KV slot freed) and the reader gets StreamBacklogError instead of a buffer without bound."""

from __future__ import annotations

import asyncio
import time

import pytest

from engine_utils import cached_model, make_engine
from rayspec.sampling.sampler import SamplingParams


def test_engine_outputs_are_deltas_when_asked(tiny_model_dir):
    loaded = cached_model(str(tiny_model_dir))
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=1)
    outputs = {}
    for delta in (False, True):
        engine = make_engine(tiny_model_dir, "ngram", k=3, loaded=loaded)
        engine.delta_outputs = delta
        engine.add_request([5, 6, 7, 5, 6, 7], params, "r")
        outputs[delta] = [out for _ in range(100) if engine.has_unfinished_requests() for out in engine.step()]
    whole, deltas = outputs[False][-1], outputs[True]
    assert deltas[-1].finished and deltas[-1].token_ids == whole.token_ids and deltas[-1].text == whole.text
    assert deltas[-1].logprobs == whole.logprobs
    assert sum((o.delta_token_ids for o in deltas), []) == whole.token_ids
    assert sum((o.delta_logprobs for o in deltas), []) == whole.logprobs
    for out in deltas[:-1]:  # nothing of what came before is copied into an unfinished output
        assert out.token_ids == [] and out.logprobs is None and out.text == ""
        assert len(out.delta_token_ids) <= 4 and out.num_output_tokens > 0
    assert [o.num_output_tokens for o in deltas] == [o.num_output_tokens for o in outputs[False]]


def test_a_reader_that_stops_reading_is_cut_off(tiny_model_dir):
    from serve_utils import tiny_args

    from deployments.transport.protocol import GenerateRequest
    from deployments.replicas.verifier import StreamBacklogError, Verifier

    verifier = Verifier.func_or_class(tiny_args(tiny_model_dir))
    # the bound is lowered only once the first output is read: on a busy machine the engine's thread
    # ran 4 outputs ahead before the event loop handed over the first (cut off before any read)
    verifier.max_buffered_outputs = 10_000

    async def read_one_then_stall():
        stream = verifier.generate_stream(GenerateRequest(prompt=[5, 6, 7], max_tokens=200, temperature=0,
                                                          ignore_eos=True))
        first = await stream.__anext__()
        verifier.max_buffered_outputs = 4
        deadline = time.monotonic() + 60
        while verifier.loop.num_aborted == 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.05)  # not reading: the engine runs ahead
        with pytest.raises(StreamBacklogError):
            await stream.__anext__()
        return first

    try:
        first = asyncio.run(read_one_then_stall())
        assert first.delta_token_ids and not first.finished
        assert verifier.loop.num_aborted == 1 and verifier.num_backlogged == 1
        assert verifier.loop.call(lambda engine: engine.has_unfinished_requests()) is False  # its slot is free
    finally:
        verifier.loop.shutdown()
