"""The verifier deployment: one LLMEngine per replica, stepping on a background thread.

colocated: the proposer lives inside the engine (no RPC per step).
disaggregated: the engine drafts through RemoteProposer -> the Proposer deployment, one call per step;
with proposer_placement 'paired', -> this replica's own proposer actor (deployments.replicas.pairing).
A caller that is cancelled or disconnects aborts its request, which frees its KV slot.
A request's prompt is chat-templated and tokenized in its handler, on a worker thread, and its work
weighed against the replica's budget (deployments.replicas.work_budget: 429 / 400 at once) before it
is queued to the engine's thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import time
import uuid
from typing import AsyncIterator

from ray import serve

logger = logging.getLogger("ray.serve")

from deployments.config import load_app_args, replica_device
from deployments.replicas.engine_loop import EngineLoop
from deployments.replicas.work_budget import WorkBudget, choice_work, default_work_budget
from deployments.transport.protocol import (GenerateChunk, GenerateRequest, GenerateResponse, NotStartedInTime,
                                            RequestTimeoutError)
from rayspec.engine.llm_engine import InvalidRequestError, LLMEngine, RequestOutput


CALLER_CHECK_S = 1.0  # how often a request's caller (its ingress replica) is checked to be alive
_CALLER_GONE = object()  # put in a request's queue when its caller died
_BACKLOG = object()  # put in a request's queue when its reader fell too far behind
_TIMED_OUT = object()  # put in a request's queue TIMEOUT_GRACE_S past its deadline
_NOT_STARTED = object()  # put in a request's queue at its start_by, unless it has started by then
UNHEALTHY_AFTER_FAILED_STEPS = 3  # steps in a row that raised: the replica reports unhealthy
MAX_BUFFERED_OUTPUTS = 1024  # outputs of one request waiting for its reader (each a step's delta)
# the engine loop ends a request at its deadline; this much later the replica's event loop ends it
# itself, in case the loop's thread hangs in a step (it is aborted there when the thread is back)
TIMEOUT_GRACE_S = 5.0


class CallerLostError(RuntimeError):
    """The request was aborted (its slot freed) because the replica that sent it died."""


class StreamBacklogError(RuntimeError):
    """The request was aborted (its slot freed) because its reader left MAX_BUFFERED_OUTPUTS unread."""


class CallerLiveness:
    """Whether named actors (the ingress replicas whose requests this verifier serves) are alive: a
    named-actor lookup, at most one per name per CALLER_CHECK_S however many streams ask."""

    def __init__(self, namespace: str = "serve"):
        self.namespace = namespace
        self._checked: dict[str, tuple[float, bool]] = {}
        self._pending: dict[str, asyncio.Future] = {}

    def _lookup(self, name: str) -> bool:
        import ray

        try:
            ray.get_actor(name, namespace=self.namespace)
        except ValueError:  # no live actor holds the name: it died (Serve replicas do not restart)
            return False
        except Exception:  # noqa: BLE001 - GCS unreachable for a moment: not a reason to abort
            return True
        return True

    async def alive(self, name: str) -> bool:
        checked = self._checked.get(name)
        if checked is not None and (not checked[1] or time.monotonic() - checked[0] < CALLER_CHECK_S):
            return checked[1]
        pending = self._pending.get(name)
        if pending is None:
            pending = self._pending[name] = asyncio.ensure_future(asyncio.to_thread(self._lookup, name))
            pending.add_done_callback(lambda _: self._pending.pop(name, None))
        alive = await asyncio.shield(pending)
        self._checked[name] = (time.monotonic(), alive)
        if len(self._checked) > 1024:  # names of long-gone replicas
            self._checked = {n: v for n, v in self._checked.items() if n == name or v[1]}
        return alive


def _replica_tag() -> str:
    try:
        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # noqa: BLE001 - outside Serve
        return uuid.uuid4().hex[:8]


def _end_replica(err: BaseException) -> None:
    """The engine cannot go on (a tensor-parallel rank died: the ranks' caches no longer agree). The
    replica's process ends, so Serve starts a new one and the requests in flight fail over to a live
    replica (deployments.frontend.failover), as when the replica itself dies."""
    import os

    logger.error("verifier replica ending: %r", err)
    os._exit(1)


@serve.deployment
class Verifier:
    def __init__(self, args: dict, proposer_handle=None, channel_secret=None):
        cfg = load_app_args(args)
        self.cfg = cfg
        engine_config = cfg.engine_config()
        engine_config.device = replica_device(cfg.engine.device)
        tag = _replica_tag()
        self.paired = None
        if cfg.paired:  # this replica's own proposer, in the last bundle of its placement group
            from deployments.replicas.pairing import PairedHandle

            self.paired = proposer_handle = PairedHandle(args, channel_secret)

        def factory() -> LLMEngine:
            proposer = None
            if proposer_handle is not None:
                from deployments.transport.remote_proposer import RemoteProposer
                proposer = RemoteProposer(proposer_handle, device=engine_config.device, affinity=tag,
                                          timeout_s=cfg.proposer_call_timeout_s,
                                          direct=cfg.proposer_transport == "direct", channel_secret=channel_secret,
                                          max_frame_bytes=cfg.proposer_channel_max_frame_mib << 20,
                                          repin_interval_s=cfg.repin_interval_s)
            launcher = None
            if engine_config.tensor_parallel_size > 1:  # ranks 1..N-1 in this replica's placement group
                from deployments.replicas.tensor_parallel import RayRankLauncher

                launcher = RayRankLauncher()
            engine = LLMEngine(engine_config, proposer=proposer, rank_launcher=launcher)
            if proposer is not None:  # drafts coming back are checked against the target's vocabulary
                proposer.vocab_size = engine.model.args.vocab_size
            return engine

        try:
            from deployments.replicas.metrics import VerifierMetrics

            metrics = VerifierMetrics(cfg.model_name)
        except Exception:  # noqa: BLE001 - metrics are best effort
            logger.exception("metrics disabled")
            metrics = None
        # a loop whose thread hangs with work fails check_health (step_watchdog_s): Serve replaces the
        # replica, and its requests fail over as from a dead one (deployments.frontend.failover)
        self.loop = EngineLoop(factory, metrics=metrics, on_fatal=_end_replica, step_watchdog_s=cfg.step_watchdog_s)
        self.loop.wait_ready()
        # work let in at once (deployments.replicas.work_budget); default: a full batch of the longest sequences
        engine = self.loop.engine
        self.work = WorkBudget(cfg.work_budget_tokens or default_work_budget(engine.config.max_num_seqs,
                                                                             engine.max_model_len))
        # seq ids unique across verifier replicas: a shared proposer keys its state on them
        self._prefix = f"{tag}-"
        self._ids = itertools.count()
        self.callers = CallerLiveness()
        self.num_caller_lost = 0  # requests aborted because their ingress replica died
        self.max_buffered_outputs = MAX_BUFFERED_OUTPUTS
        self.request_timeout_s = cfg.request_timeout_s  # a request's deadline unless it brings its own
        self.num_backlogged = 0  # requests aborted because their reader fell too far behind
        self.num_not_started = 0  # requests refused (429) because they had not started by their start_by
        self._watched: dict[str, tuple[str, asyncio.Queue]] = {}  # request id -> (its caller, its queue)
        self._watcher: asyncio.Task | None = None

    def _watch_callers(self) -> None:
        """While requests with a caller run: every CALLER_CHECK_S, the requests of a caller that died
        get _CALLER_GONE (Ray does not cancel a replica's stream when the replica reading it dies)."""
        if self._watcher is not None and not self._watcher.done():
            return

        async def watch():
            while self._watched:
                await asyncio.sleep(CALLER_CHECK_S)
                for caller in {c for c, _ in self._watched.values()}:
                    if not await self.callers.alive(caller):
                        for c, queue in list(self._watched.values()):
                            if c == caller:
                                queue.put_nowait(_CALLER_GONE)

        self._watcher = asyncio.get_running_loop().create_task(watch())

    def check_health(self) -> None:
        """Serve calls this every health_check_period_s; raising makes Serve replace the replica."""
        problem = self.loop.health_problem(UNHEALTHY_AFTER_FAILED_STEPS)
        if problem is not None:
            raise RuntimeError(problem)
        ranks = getattr(self.loop.engine, "ranks", None)
        if ranks is not None and not ranks.alive():
            raise RuntimeError("a tensor-parallel rank of this replica died")

    def health(self) -> dict:
        """For the ingress's /health: raises when the engine loop is down."""
        self.check_health()
        snap = self.loop.snapshot
        return {"num_running": snap.get("num_running", 0), "num_waiting": snap.get("num_waiting", 0),
                "topology": self.cfg.topology, "method": self.cfg.speculative.method}

    def placement(self) -> dict:
        """This replica's node and GPU ids, and its paired proposer's (None: the proposer is a pool's)."""
        from deployments.replicas.pairing import placement

        return {**placement(), "proposer": self.paired.placement() if self.paired is not None else None}

    def __del__(self):
        loop = getattr(self, "loop", None)
        if loop is not None:
            loop.shutdown()
        if getattr(self, "paired", None) is not None:
            self.paired.kill()

    # ---- generation ------------------------------------------------------------------------
    async def _stream(self, request: GenerateRequest) -> AsyncIterator[RequestOutput]:
        if isinstance(request, dict):
            request = GenerateRequest.model_validate(request)
        params = request.sampling_params()  # raises InvalidRequestError for bad values
        timeout_s = request.timeout_s if request.timeout_s is not None else self.request_timeout_s
        deadline = None if timeout_s is None else time.perf_counter() + timeout_s
        rid = f"{self._prefix}{next(self._ids)}"
        # a failover has started already: its start deadline is behind it
        start_by = request.start_by if not request.resume_output_ids else None
        if start_by is not None and time.time() >= start_by:  # (it waited its time in Serve's queue)
            self.num_not_started += 1
            raise NotStartedInTime(self._not_started(request))
        prompt = await self._prompt_ids(request)
        self._admit(rid, request, prompt, params)  # raises WorkBudgetExceeded (429) / WorkTooLargeError (400)
        submitted = done = False
        timer = start_timer = None
        try:
            grammar = None
            if params.structured is not None:  # built here, not on the engine's thread (can take ~1 s)
                grammar = await asyncio.to_thread(self.loop.engine.prepare_grammar, params.structured)
            loop = asyncio.get_running_loop()
            queue: asyncio.Queue = asyncio.Queue()

            cut_off = started = False

            def put(item) -> None:  # on the event loop: a reader that stopped reading is cut off, not buffered for
                nonlocal cut_off, started
                if cut_off:
                    return
                started = started or isinstance(item, RequestOutput)
                if queue.qsize() >= self.max_buffered_outputs:
                    cut_off = True
                    while not queue.empty():
                        queue.get_nowait()
                    queue.put_nowait(_BACKLOG)
                    self.loop.abort(rid)
                    return
                queue.put_nowait(item)

            # (the prompt's encoding and the grammar took some of the time)
            left = None if deadline is None else max(0.0, deadline - time.perf_counter())
            self.loop.submit(rid, prompt, params, lambda item: loop.call_soon_threadsafe(put, item),
                             resume=(request.resume_output_ids, request.resume_sent_chars), grammar=grammar,
                             timeout_s=left)
            submitted = True
            timer = None if left is None else loop.call_later(left + TIMEOUT_GRACE_S, queue.put_nowait, _TIMED_OUT)
            if start_by is not None:
                start_timer = loop.call_later(max(0.0, start_by - time.time()), queue.put_nowait, _NOT_STARTED)
            if request.caller is not None:
                self._watched[rid] = (request.caller, queue)
                self._watch_callers()
            while True:
                item = await queue.get()
                if item is _BACKLOG:
                    done = True  # aborted already
                    self.num_backlogged += 1
                    logger.warning("request %s: its reader left %d outputs unread; aborted", rid, self.max_buffered_outputs)
                    raise StreamBacklogError(f"the reader of this stream fell {self.max_buffered_outputs} outputs behind")
                if item is _CALLER_GONE:
                    logger.warning("request %s: its ingress replica %s is gone; aborting", rid, request.caller)
                    self.num_caller_lost += 1
                    raise CallerLostError(f"the ingress replica {request.caller} that sent this request is gone")
                if item is _NOT_STARTED:
                    if started:  # (its first output came first)
                        continue
                    self.num_not_started += 1
                    raise NotStartedInTime(self._not_started(request))  # aborted in the engine (finally)
                if item is _TIMED_OUT:  # the engine's thread did not end it: it hangs (aborted when it is back)
                    logger.warning("request %s: past its deadline (%g s), the engine not answering", rid, timeout_s)
                    raise RequestTimeoutError(f"the request passed its deadline ({timeout_s:.3g} s) and was aborted")
                if isinstance(item, BaseException):
                    done = True
                    raise item
                if item.finished:
                    done = True
                    self.work.release(rid)  # the engine is done: its work is free before the caller sees the end
                yield item
                if done:
                    return
        finally:
            self.work.release(rid)  # (once: a second release is a no-op)
            for pending in (timer, start_timer):
                if pending is not None:
                    pending.cancel()
            self._watched.pop(rid, None)
            if submitted and not done:  # cancelled or disconnected: free the slot
                self.loop.abort(rid)

    @staticmethod
    def _not_started(request: GenerateRequest) -> str:
        return ("the server could not start this request in time (it waited its queue_timeout_s for a place "
                "behind other requests' work); try again later")

    async def _prompt_ids(self, request: GenerateRequest) -> list[int]:
        """The request's prompt as token ids: chat messages through the chat template, text through
        the tokenizer, on a worker thread (not on the engine's thread, where every running request's
        next step would wait for it, nor on this event loop). Its length is the request's work."""
        engine = self.loop.engine
        if request.messages is not None:
            try:
                return await asyncio.to_thread(engine.encode_chat, request.messages, request.tools)
            except InvalidRequestError:
                raise
            except Exception as err:  # noqa: BLE001 - e.g. the chat template refused the messages: the request's fault
                raise InvalidRequestError(f"{type(err).__name__}: {err}") from None
        if isinstance(request.prompt, str):
            return await asyncio.to_thread(engine.encode, request.prompt)  # (no tokenizer: InvalidRequestError)
        return list(request.prompt)

    def _admit(self, rid: str, request: GenerateRequest, prompt_ids: list[int], params) -> None:
        """Charge the request's work to this replica's budget (deployments.replicas.work_budget), or
        refuse it. A prompt too long for max_model_len is not weighed: the engine refuses it as it
        comes, saying so. A failover (resumed request) was let in before: charged, never refused."""
        max_len = self.loop.engine.max_model_len
        num = len(prompt_ids)
        if num >= max_len or (params.max_tokens is not None and num + params.max_tokens > max_len):
            return
        work = choice_work(num, params.max_tokens, max_len, request.prompt_logprobs, request.echo_prompt)
        self.work.admit(rid, work, request.group, request.group_size, force=bool(request.resume_output_ids))

    def _prompt_text(self, request: GenerateRequest) -> str | None:
        if not request.echo_prompt or request.messages is not None:
            return None
        if isinstance(request.prompt, str):
            return request.prompt
        return self.loop.engine.tokenizer.decode(request.prompt) if self.loop.engine.tokenizer is not None else ""

    async def generate_stream(self, request: GenerateRequest) -> AsyncIterator[GenerateChunk]:
        if isinstance(request, dict):
            request = GenerateRequest.model_validate(request)
        first = not request.resume_output_ids  # prompt text and logprobs go in the first chunk
        # aclosing: the request closed with this generator (its work released, the engine told at
        # once), not whenever the garbage collector gets to an abandoned generator
        async with contextlib.aclosing(self._stream(request)) as outputs:
            async for out in outputs:
                new = out.delta_token_ids  # the engine's outputs are deltas (EngineLoop): nothing is copied here
                if not (new or out.delta_text or out.finished):
                    continue
                extra = {}
                if first:
                    extra = dict(prompt_logprobs=out.prompt_logprobs, prompt_text=self._prompt_text(request))
                    first = False
                yield GenerateChunk(request_id=request.request_id or out.request_id, delta_text=out.delta_text, **extra,
                                    delta_token_ids=new,
                                    logprobs=out.delta_logprobs,
                                    finished=out.finished, finish_reason=out.finish_reason,
                                    num_prompt_tokens=out.num_prompt_tokens, num_output_tokens=out.num_output_tokens,
                                    num_draft_tokens=out.num_draft_tokens, num_accepted_tokens=out.num_accepted_tokens,
                                    num_cached_tokens=out.num_cached_tokens)

    async def generate(self, request: GenerateRequest) -> GenerateResponse:
        if isinstance(request, dict):
            request = GenerateRequest.model_validate(request)
        start = time.perf_counter()
        first = None
        last = None
        # aclosing: the request closed with this generator (its work released, the engine told at
        # once), not whenever the garbage collector gets to an abandoned generator
        async with contextlib.aclosing(self._stream(request)) as outputs:
            async for out in outputs:
                if first is None and out.num_output_tokens:
                    first = time.perf_counter() - start
                last = out
        return GenerateResponse(request_id=request.request_id or last.request_id, text=last.text,
                                token_ids=last.token_ids, logprobs=last.logprobs,
                                prompt_logprobs=last.prompt_logprobs, prompt_text=self._prompt_text(request),
                                finish_reason=last.finish_reason,
                                num_prompt_tokens=last.num_prompt_tokens, num_output_tokens=last.num_output_tokens,
                                num_draft_tokens=last.num_draft_tokens, num_accepted_tokens=last.num_accepted_tokens,
                                num_cached_tokens=last.num_cached_tokens,
                                time_to_first_token_s=first, latency_s=time.perf_counter() - start)

    # ---- introspection ----------------------------------------------------------------------
    def get_stats(self) -> dict:
        """Engine counters (SpecDecodeStats) and queue sizes as of the last step."""
        paired = {"paired_proposer_restarts": self.paired.num_restarts} if self.paired is not None else {}
        return dict(self.loop.snapshot, replica=self._prefix.rstrip("-"), metrics=self.loop.metrics is not None,
                    num_caller_lost=self.num_caller_lost, num_backlogged=self.num_backlogged,
                    num_not_started_in_time=self.num_not_started, **self.work.as_dict(),
                    **paired)

    def record_routing_stats(self) -> dict:
        """The same counters, under the name Ray Serve's controller polls each replica by (and a
        custom request router reads): a caller can ask one replica directly through its actor, where
        a handle call goes wherever the router sends it."""
        return self.get_stats()

    async def reset_stats(self) -> dict:
        from rayspec.engine.metrics import SpecDecodeStats

        def reset(engine):
            engine.stats = SpecDecodeStats()
            return True

        await asyncio.to_thread(self.loop.call, reset)
        return self.get_stats()

    def model_info(self) -> dict:
        from rayspec.sampling.tool_parsers import parser_for_template

        tokenizer = self.loop.engine.tokenizer
        return {"model": self.cfg.model, "served_model_name": self.cfg.model_name,
                "max_model_len": self.loop.snapshot["max_model_len"],
                "method": self.cfg.speculative.method, "topology": self.cfg.topology,
                # the call format of the model's chat template (tool_choice "auto"; None: not known)
                "tool_call_parser": parser_for_template(getattr(tokenizer, "chat_template", None))}

    # ---- /tokenize, /detokenize (on a worker thread, not the engine's: its steps go on meanwhile) ----
    async def tokenize(self, request: dict) -> dict:
        """{"prompt", "add_special_tokens"} or {"messages", "tools", "add_generation_prompt"} (the
        ingress validated them) -> {"count", "max_model_len", "tokens"}."""

        def run(engine: LLMEngine) -> list[int]:
            if engine.tokenizer is None:
                raise InvalidRequestError("this model has no tokenizer")
            if request.get("messages") is not None:
                try:
                    return engine.encode_chat(request["messages"], request.get("tools"),
                                              add_generation_prompt=request.get("add_generation_prompt", True))
                except InvalidRequestError:
                    raise
                except Exception as err:  # noqa: BLE001 - e.g. the chat template refused the messages
                    raise InvalidRequestError(f"the chat template failed: {err}") from None
            return engine.tokenizer.encode(request["prompt"], add_special_tokens=request.get("add_special_tokens", True))

        tokens = await asyncio.to_thread(run, self.loop.engine)
        return {"count": len(tokens), "max_model_len": self.loop.snapshot["max_model_len"], "tokens": tokens}

    async def detokenize(self, tokens: list[int]) -> dict:
        def run(engine: LLMEngine) -> str:
            if engine.tokenizer is None:
                raise InvalidRequestError("this model has no tokenizer")
            vocab = engine.model.args.vocab_size
            bad = next((t for t in tokens if not 0 <= t < vocab), None)
            if bad is not None:
                raise InvalidRequestError(f"token ids must be in [0, {vocab}); got {bad}")
            return engine.tokenizer.decode(tokens)

        return {"prompt": await asyncio.to_thread(run, self.loop.engine)}
