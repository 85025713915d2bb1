"""Several choices per OpenAI request (`n`, a batched completions prompt): one verifier request
each, run concurrently (they batch in the verifier's engine like any other requests), their
streams merged in arrival order.

Choice c is prompt c // n, sample c % n. A seeded request's sample i uses seed + i, so that the
n samples differ and the request stays reproducible; greedy samples are all the same. The choices of
one request carry its id and their number (GenerateRequest.group, group_size): a verifier replica lets
them in together, by their work, or refuses them together (deployments.replicas.work_budget).
"""

from __future__ import annotations

import asyncio
import uuid
from typing import AsyncIterator

from deployments.frontend.failover import FailoverCounts, FailoverStream
from deployments.transport.protocol import GenerateChunk, GenerateRequest


def check_work(requests: list[GenerateRequest], n: int, budget: int | None, max_model_len: int | None) -> None:
    """A request whose prompts are token ids has its work known here, before any verifier place is
    taken: past a replica's whole budget it is refused at once (a 400, WorkTooLargeError's), not after
    waiting in a full verifier's queue for the verifier to say the same (text and chat prompts are
    weighed by the verifier, which tokenizes them)."""
    from deployments.frontend.openai_limits import OpenAIError
    from deployments.replicas.work_budget import WorkTooLargeError, choice_work

    if not budget or not max_model_len or not requests or not all(isinstance(r.prompt, list) for r in requests):
        return
    works = [choice_work(len(r.prompt), r.max_tokens, max_model_len, r.prompt_logprobs, r.echo_prompt)
             for r in requests]
    total = n * sum(w.tokens for w in works)
    if total > budget:
        raise OpenAIError(
            f"this request is {total} tokens of work ({len(requests)} prompts x {n} choices; one choice: "
            f"{works[0].describe()}), more than a server replica takes in at once (its work budget: {budget} "
            "tokens, the app arg work_budget_tokens); ask for fewer choices (n), fewer tokens (max_tokens) "
            "or fewer prompt logprobs", code=WorkTooLargeError.code)


def expand(requests: list[GenerateRequest], n: int) -> list[GenerateRequest]:
    out = []
    if (size := len(requests) * n) > 1:  # one group (one request alone needs none)
        group = uuid.uuid4().hex
        requests = [r.model_copy(update={"group": group, "group_size": size}) for r in requests]
    for request in requests:
        for i in range(n):
            seed = None if request.seed is None else request.seed + i
            out.append(request if i == 0 else request.model_copy(update={"seed": seed}))
    return out


async def gather_or_cancel(coroutines) -> list:
    """All results, or the first error with the rest cancelled (their verifier requests aborted)."""
    tasks = [asyncio.ensure_future(c) for c in coroutines]
    try:
        return await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        raise


async def _first(stream: FailoverStream) -> GenerateChunk | None:
    try:
        return await stream.__anext__()
    except StopAsyncIteration:
        return None


async def open_streams(verifier, requests: list[GenerateRequest], counts: FailoverCounts):
    """Start every stream and wait for each one's first chunk (so request errors surface before
    any response is sent). Returns (streams, first chunks)."""
    streams = [FailoverStream(verifier, r, counts) for r in requests]
    try:
        firsts = await gather_or_cancel(_first(s) for s in streams)
    except BaseException:
        for s in streams:
            s.cancel()
        raise
    return streams, firsts


async def merged(streams: list[FailoverStream], firsts: list[GenerateChunk | None]
                 ) -> AsyncIterator[tuple[int, GenerateChunk]]:
    """(choice index, chunk) over all streams as chunks arrive. Closing this iterator early (the
    client went away) cancels every unfinished stream."""
    finished: set[int] = set()
    if len(streams) == 1:  # the common case: no task or queue hop per chunk
        try:
            if firsts[0] is not None:
                if firsts[0].finished:
                    finished.add(0)
                yield 0, firsts[0]
            if 0 not in finished:
                async for chunk in streams[0]:
                    if chunk.finished:
                        finished.add(0)
                    yield 0, chunk
                    if chunk.finished:
                        break
        finally:
            if 0 not in finished:
                streams[0].cancel()
        return

    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream: FailoverStream, first: GenerateChunk | None) -> None:
        try:
            if first is not None:
                queue.put_nowait((i, first))
                if first.finished:
                    return
            async for chunk in stream:
                queue.put_nowait((i, chunk))
                if chunk.finished:
                    return
        except Exception as err:  # noqa: BLE001 - handed to the consumer
            queue.put_nowait((i, err))
        finally:
            queue.put_nowait((i, None))

    tasks = [asyncio.ensure_future(pump(i, s, f)) for i, (s, f) in enumerate(zip(streams, firsts))]
    try:
        ended = 0
        while ended < len(tasks):
            i, item = await queue.get()
            if item is None:
                ended += 1
                continue
            if isinstance(item, BaseException):
                raise item
            if item.finished:
                finished.add(i)
            yield i, item
    finally:
        for task in tasks:
            task.cancel()
        for i, stream in enumerate(streams):
            if i not in finished:
                stream.cancel()
