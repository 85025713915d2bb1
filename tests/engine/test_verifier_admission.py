"""A verifier replica's side of admission by work (#51), in this process (no Ray): prompts are
chat-templated and tokenized off the engine's thread, before the request is queued; a request's work
is weighed against the replica's budget (default max_num_seqs x max_model_len): past the whole
budget a 400 at once, beside work in flight that leaves no room a 429 at once, and the work is
released when the request ends, finished or cancelled."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from deployments.replicas.work_budget import WorkBudgetExceeded, WorkTooLargeError
from deployments.transport.protocol import GenerateRequest
from serve_utils import tiny_args

ENGINE_THREAD = "rayspec-engine"  # deployments.replicas.engine_loop's


@pytest.fixture(scope="module")
def verifier(tiny_model_dir):
    from deployments.replicas.verifier import Verifier

    verifier = Verifier.func_or_class(tiny_args(tiny_model_dir, work_budget_tokens=4096))  # one full batch
    yield verifier
    verifier.loop.shutdown()


def _idle(verifier) -> bool:
    return verifier.work.in_use == 0 and not verifier.loop.call(lambda engine: engine.has_unfinished_requests())


def test_prompts_are_templated_and_tokenized_off_the_engine_thread(verifier):
    engine = verifier.loop.engine
    seen: list[str] = []

    def recorded(fn):
        def run(*args, **kwargs):
            seen.append(threading.current_thread().name)
            return fn(*args, **kwargs)
        return run

    messages = [{"role": "user", "content": "Hello there, how are you?"}]
    want = engine.encode_chat(messages)
    engine.encode_chat, engine.encode = recorded(engine.encode_chat), recorded(engine.encode)
    engine.tokenizer.encode = recorded(engine.tokenizer.encode)  # /tokenize's
    try:
        chat = asyncio.run(verifier.generate(GenerateRequest(messages=messages, max_tokens=4, temperature=0)))
        text = asyncio.run(verifier.generate(GenerateRequest(prompt="Hello there", max_tokens=4, temperature=0)))
        tokenized = asyncio.run(verifier.tokenize({"messages": messages}))
        asyncio.run(verifier.tokenize({"prompt": "Hello there"}))
    finally:
        del engine.encode_chat, engine.encode, engine.tokenizer.encode
    assert chat.num_prompt_tokens == len(want) and chat.num_output_tokens == 4
    assert text.num_prompt_tokens == len(engine.encode("Hello there")) and tokenized["tokens"] == want
    assert len(seen) >= 4 and ENGINE_THREAD not in seen, seen


def test_the_default_budget_is_four_full_batches_of_the_longest_sequences(verifier):
    from deployments.replicas.work_budget import default_work_budget

    assert default_work_budget(4, 1024) == 4 * 4 * 1024  # tiny_args: max_num_seqs 4, max_model_len 1024
    assert verifier.work.budget == 4096 and verifier.get_stats()["work_budget_tokens"] == 4096  # (set here)


def test_a_request_past_the_whole_budget_is_refused_at_once(verifier):
    # the request, cut to max_model_len 1024: 64 choices scoring and echoing a 1000-token prompt
    heavy = GenerateRequest(prompt=[1] * 1000, max_tokens=1, prompt_logprobs=20, logprobs=20, echo_prompt=True,
                            group="heavy", group_size=64)
    started = time.monotonic()
    with pytest.raises(WorkTooLargeError, match="64 choices"):
        asyncio.run(verifier.generate(heavy))
    assert time.monotonic() - started < 5
    assert _idle(verifier)  # nothing was queued to the engine


def test_work_beside_work_in_flight_is_a_429_and_is_released_when_requests_end(verifier):
    # a request of 2 choices (one of them routed elsewhere) reserves both: 2 x 1003 tokens
    long = GenerateRequest(prompt=[5, 6, 7], max_tokens=1000, temperature=0, ignore_eos=True, group="long",
                           group_size=2)
    scored = GenerateRequest(prompt=[1] * 100, max_tokens=1, prompt_logprobs=20, echo_prompt=True)  # 2301 tokens

    async def main():
        stream = verifier.generate_stream(long)
        first = asyncio.Event()

        async def read():
            async for _ in stream:
                first.set()

        reader = asyncio.create_task(read())
        await asyncio.wait_for(first.wait(), 60)
        assert verifier.work.in_use == 2006
        started = time.monotonic()
        with pytest.raises(WorkBudgetExceeded, match="2006 tokens of work in flight"):
            await verifier.generate(scored)
        assert time.monotonic() - started < 5
        reader.cancel()  # the client went away (Serve cancels the replica's stream)
        with pytest.raises(asyncio.CancelledError):
            await reader
        assert verifier.work.in_use == 0  # released at once
        out = await verifier.generate(scored)  # now it fits
        assert len(out.prompt_logprobs) == 100 and out.prompt_text is not None
        assert verifier.work.in_use == 0  # released when it finished

    asyncio.run(main())
    deadline = time.monotonic() + 30
    while not _idle(verifier) and time.monotonic() < deadline:  # the cancelled request's abort reaches the engine
        time.sleep(0.05)
    assert _idle(verifier)
    stats = verifier.get_stats()
    assert stats["num_refused_for_work"] >= 1 and stats["work_in_flight_tokens"] == 0


def test_a_stream_closed_by_its_caller_releases_its_work_at_once(verifier):
    """The caller (Serve, for a client gone) closes the chunk stream while it waits at a yield: the
    request's work is released and the engine told within that close, not later, when the garbage
    collector's finalizer gets to the abandoned inner generator (which needs the event loop to run
    again first: before the fix the budget still held the request's work after the close returned)."""
    async def run():
        stream = verifier.generate_stream(GenerateRequest(prompt="Hello there", max_tokens=200, temperature=0.8,
                                                          ignore_eos=True))
        first = await stream.__anext__()  # one chunk in: the request is admitted and running
        assert verifier.work.in_use > 0 and first.delta_token_ids
        await stream.aclose()
        return verifier.work.in_use  # before any other task of this loop runs

    assert asyncio.run(run()) == 0
    deadline = time.monotonic() + 30
    while not _idle(verifier):
        assert time.monotonic() < deadline, "the closed stream's request still runs in the engine"
        time.sleep(0.05)


def test_a_request_not_started_by_its_start_by_is_refused_and_freed(verifier):
    """GenerateRequest.start_by (the ingress sets it from the app's queue_timeout_s): a request whose
    first output has not come by then is refused as overloaded (the ingress's 429), aborted in the
    engine and its work released; one already past it when it arrives is refused before it is queued;
    a failover (resume_output_ids) is never refused by it; one that starts in time runs to its end."""
    from deployments.transport.protocol import NotStartedInTime
    from rayspec.engine.outputs import EngineOverloadedError

    assert issubclass(NotStartedInTime, EngineOverloadedError)  # (what the ingress maps to 429)
    before = verifier.num_not_started
    late = GenerateRequest(prompt=[5, 6, 7], max_tokens=4, temperature=0, start_by=time.time() - 1)
    with pytest.raises(NotStartedInTime, match="could not start this request in time"):
        asyncio.run(verifier.generate(late))
    assert _idle(verifier)

    # the engine's thread held (as by a long step): nothing can start
    held = threading.Thread(target=verifier.loop.call, args=(lambda engine: time.sleep(3),))
    held.start()
    try:
        time.sleep(0.2)
        started = time.monotonic()
        with pytest.raises(NotStartedInTime):
            asyncio.run(verifier.generate(GenerateRequest(prompt=[5, 6, 7], max_tokens=4, temperature=0,
                                                          start_by=time.time() + 0.5)))
        assert time.monotonic() - started < 2.0  # at its start_by, not when the engine is back
    finally:
        held.join()
    assert verifier.num_not_started - before == 2  # (the one refused on arrival was never queued)
    deadline = time.monotonic() + 10
    while not _idle(verifier) and time.monotonic() < deadline:  # aborted once the engine is back
        time.sleep(0.05)
    assert _idle(verifier)

    resumed = GenerateRequest(prompt=[5, 6, 7], max_tokens=4, temperature=0, start_by=time.time() - 1,
                              resume_output_ids=[9])
    assert asyncio.run(verifier.generate(resumed)).num_output_tokens == 4
    in_time = GenerateRequest(prompt=[5, 6, 7], max_tokens=4, temperature=0, start_by=time.time() + 30)
    assert asyncio.run(verifier.generate(in_time)).num_output_tokens == 4
    assert _idle(verifier)
