"""A background thread that owns an LLMEngine.

All engine calls (build, add, step, abort, stats) happen on that thread. Callers hand requests in
through a thread-safe queue and get RequestOutputs back through a callback, which the verifier
points at an asyncio queue with `loop.call_soon_threadsafe`. No Ray import here.
"""

from __future__ import annotations

import logging
import math
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Union

from deployments.transport.protocol import RequestTimeoutError
from rayspec.engine.llm_engine import EngineOverloadedError, InvalidRequestError, LLMEngine, RequestOutput
from rayspec.engine.metrics import FinishedRequestStats, IterationStats

logger = logging.getLogger("rayspec.serve")

Deliver = Callable[[Any], None]  # gets RequestOutput items, or an Exception that ends the stream


@dataclass
class _Stream:
    deliver: Deliver
    submitted: float  # arrival, for TTFT, queue time and e2e latency
    num_tokens: int = 0  # output tokens already counted (a resumed request starts with some)
    scheduled: bool = False  # left the engine's waiting queue (its queue time is observed)
    num_prompt_tokens: int | None = None  # set (and counted) at its first output, when its prefill is done
    first_token: float | None = None
    last_token: float | None = None  # when it last got tokens: the inter-token latency's start
    deadline: float | None = None  # perf_counter time past which it is aborted (RequestTimeoutError)


@dataclass(frozen=True)
class ChatPrompt:
    """A chat request's prompt: its messages (and tools), which the engine's chat template turns into
    token ids on the loop thread, where the tokenizer is."""

    messages: list[dict]
    tools: list[dict] | None = None


Prompt = Union[str, list[int], ChatPrompt]


KERNEL_CHECK_S = 5.0  # a provisional CPU kernel choice is measured again, while idle, this long apart at least
KERNEL_CHECKS = 6  # and at most this many times

# the commands callers put on the loop's queue, run in order on the loop thread
@dataclass
class _Add:
    request_id: str
    prompt: Prompt
    params: Any
    deliver: Deliver
    resume: tuple[list[int], int] = ((), 0)  # (output ids so far, characters already sent): see add_request
    grammar: Any = None  # a structured request's grammar state, built off this thread (engine.prepare_grammar)
    timeout_s: float | None = None  # from `submitted`; None: no deadline
    submitted: float = field(default_factory=time.perf_counter)


@dataclass(frozen=True)
class _Abort:
    request_id: str


@dataclass(frozen=True)
class _Call:
    fn: Callable[[LLMEngine], None]  # runs on the loop thread; hands its result back itself


@dataclass(frozen=True)
class _Stop:
    pass


class EngineLoop:
    def __init__(self, engine_factory: Callable[[], LLMEngine], metrics=None, idle_poll_s: float = 0.2,
                 on_fatal: Callable[[BaseException], None] | None = None, step_watchdog_s: float | None = None):
        """on_fatal(err): called on the loop thread when a step fails in a way the engine cannot go on
        from (`err.fatal`: a tensor-parallel rank died); the loop stops either way (not alive).
        step_watchdog_s: with requests queued or running and no step finished for this long, the loop
        is unhealthy (health_problem: the thread hangs in a step); None: never for that."""
        self._factory = engine_factory
        self._on_fatal = on_fatal
        self.step_watchdog_s = step_watchdog_s
        # time.monotonic() when a step last finished (or failed) or the loop last found nothing to do
        self.last_progress = time.monotonic()
        self._in_command = False  # a command is being handled (a hang there is the watchdog's too)
        self._next_deadline = math.inf  # no request's deadline is earlier (the scan's gate)
        self.metrics = metrics  # observe_iteration(IterationStats) once per step, update(snapshot) after it
        self._idle_poll_s = idle_poll_s
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._streams: dict[str, _Stream] = {}
        self._stop = threading.Event()
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self.engine: LLMEngine | None = None  # only the loop thread touches it
        self.snapshot: dict[str, Any] = {}
        self.num_finished = 0
        self.num_aborted = 0
        self.num_failed = 0  # requests the engine failed alone (finish_reason "error")
        self.num_rejected = 0  # refused with the waiting queue full (EngineOverloadedError)
        self.num_timed_out = 0  # aborted at their deadline (RequestTimeoutError)
        self.num_steps = 0
        self.num_failed_steps = 0
        self.failed_steps_in_a_row = 0  # steps that raised since the last one that did not
        self.step_seconds = 0.0  # engine.step() wall time, to tell engine time from serving overhead
        # provisional CPU kernel choices (measured on busy cores) are measured again while idle
        self._kernel_checks, self._last_kernel_check = 0, time.perf_counter()
        self._thread = threading.Thread(target=self._run, name="rayspec-engine", daemon=True)
        self._thread.start()

    # ---- called from any thread -----------------------------------------------------------
    def wait_ready(self, timeout: float | None = None) -> None:
        if not self._ready.wait(timeout):
            raise TimeoutError("engine did not start in time")
        if self._error is not None:
            raise RuntimeError(f"engine failed to start: {self._error!r}") from self._error

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self._error is None

    def health_problem(self, max_failed_steps: int) -> str | None:
        """Why this loop should be replaced (None: it should not): its thread ended, or its last
        `max_failed_steps` steps all raised (a sticky device error: every step fails, the replica
        empties fastest, and a router would send it the most requests), or it has work and no step
        finished for step_watchdog_s (a CUDA/NCCL call or a grammar step that hangs: its requests
        would wait forever on a replica that looks healthy). Idle, it is never stalled."""
        if not self.alive:
            return "engine loop is not running"
        if self.failed_steps_in_a_row >= max_failed_steps:
            return f"the last {self.failed_steps_in_a_row} engine steps all failed"
        if self.step_watchdog_s is not None and (self._streams or self._in_command or not self._commands.empty()):
            since = time.monotonic() - self.last_progress
            if since > self.step_watchdog_s:
                return (f"no engine step finished for {since:.0f} s with requests queued or running "
                        f"(step_watchdog_s {self.step_watchdog_s:g}): the engine thread hangs")
        return None

    def submit(self, request_id: str, prompt: Prompt, params, deliver: Deliver,
               resume: tuple[list[int], int] = ((), 0), grammar=None, timeout_s: float | None = None) -> None:
        """timeout_s: from now, past it the request is aborted and deliver gets a RequestTimeoutError."""
        self._commands.put(_Add(request_id, prompt, params, deliver, resume, grammar, timeout_s))

    def abort(self, request_id: str) -> None:
        self._commands.put(_Abort(request_id))

    def call(self, fn: Callable[[LLMEngine], Any], timeout: float = 60.0) -> Any:
        """Run fn(engine) on the loop thread and return its result."""
        done = threading.Event()
        box: dict[str, Any] = {}

        def run(engine):
            try:
                box["value"] = fn(engine)
            except BaseException as err:  # noqa: BLE001 - handed back to the caller
                box["error"] = err
            done.set()

        self._commands.put(_Call(run))
        if not done.wait(timeout):
            raise TimeoutError("engine loop did not answer")
        if "error" in box:
            raise box["error"]
        return box["value"]

    def shutdown(self) -> None:
        self._stop.set()
        self._commands.put(_Stop())
        # a remote proposer's call in flight (its deployment may be going down too) ends now
        # (Proposer.close is the one call made from outside the loop thread)
        engine = self.engine
        if engine is not None:
            engine.proposer.close()
        self._thread.join(timeout=10)

    # ---- the loop thread ------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self.engine = self._factory()
        except BaseException as err:  # noqa: BLE001
            logger.exception("engine construction failed")
            self._error = err
            self._ready.set()
            return
        self.engine.delta_outputs = True  # callers stream deltas: no output copies the whole output so far
        self._update_snapshot()
        self._ready.set()
        engine = self.engine
        try:
            self._serve(engine)
        finally:
            shutdown = getattr(engine, "shutdown", None)  # releases tensor-parallel ranks (no-op at TP=1)
            try:
                if shutdown is not None:
                    shutdown()
            except Exception:  # noqa: BLE001 - the ranks may be gone already
                logger.exception("engine shutdown failed")

    def _serve(self, engine) -> None:
        self.last_progress = time.monotonic()
        while not self._stop.is_set():
            idle = not engine.has_unfinished_requests()
            self._drain(block=idle)
            if self._stop.is_set():
                break
            self._expire()
            if not engine.has_unfinished_requests():
                try:
                    engine.proposer.flush()
                except Exception:  # noqa: BLE001 - releases are retried on the next call
                    logger.exception("proposer flush failed")
                self._settle_cpu_kernels(engine)
                self._update_snapshot()
                self.last_progress = time.monotonic()
                continue
            try:
                started = time.perf_counter()
                outputs = engine.step()
                self.step_seconds += time.perf_counter() - started
                self.num_steps += 1
                self.failed_steps_in_a_row = 0
                self.last_progress = time.monotonic()
            except Exception as err:  # noqa: BLE001 - fail the running requests, keep serving
                self.last_progress = time.monotonic()  # a step that raises is no hang (health_problem counts them)
                logger.exception("engine step failed")
                self.num_failed_steps += 1
                self.failed_steps_in_a_row += 1
                if getattr(err, "fatal", False):
                    self._error = err
                    if self._on_fatal is not None:
                        self._on_fatal(err)
                    self._fail_all(err)
                    break
                self._fail_all(err)
                continue
            now = time.perf_counter()
            stats = IterationStats()
            self._observe_scheduled(engine, started, stats)
            for out in outputs:
                self._dispatch(out, now, stats)
            self._observe(stats)
            self._update_snapshot()

    def _settle_cpu_kernels(self, engine) -> None:
        """While idle, measure a provisional CPU kernel choice again (rayspec.cpu.kernels: one measured
        while other processes kept the cores busy, e.g. replicas loading beside this one), every
        KERNEL_CHECK_S at most, KERNEL_CHECKS times at most, until a measurement is not contended.
        A request arriving meanwhile waits for it (~MEASURE_BUDGET_S)."""
        if self._kernel_checks >= KERNEL_CHECKS or time.perf_counter() - self._last_kernel_check < KERNEL_CHECK_S:
            return
        models = [engine.model, *engine.proposer.models()]
        pending = [m for m in models if getattr(getattr(m, "cpu_kernels", None), "contended", False)
                   and hasattr(m, "remeasure_cpu_kernels")]
        if not pending:
            return
        self._kernel_checks += 1
        for model in pending:
            try:
                model.remeasure_cpu_kernels()
            except Exception:  # noqa: BLE001 - the choice in use stays
                logger.exception("measuring the CPU kernels again failed")
        self._last_kernel_check = time.perf_counter()

    def _drain(self, block: bool) -> None:
        try:
            cmd = self._commands.get(timeout=self._idle_poll_s) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            self._in_command = True
            try:
                self._handle(cmd)
            finally:
                self._in_command = False
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return

    def _handle(self, cmd: _Add | _Abort | _Call | _Stop) -> None:
        engine = self.engine
        if isinstance(cmd, _Add):
            try:
                prompt = cmd.prompt
                if isinstance(prompt, ChatPrompt):
                    prompt = engine.encode_chat(prompt.messages, prompt.tools)
                engine.add_request(prompt, cmd.params, cmd.request_id, resume_output_ids=list(cmd.resume[0]),
                                   resume_sent_chars=cmd.resume[1], grammar=cmd.grammar)
            except (InvalidRequestError, EngineOverloadedError) as err:  # the caller's 400 / 429
                self.num_rejected += isinstance(err, EngineOverloadedError)
                cmd.deliver(err)
                return
            except Exception as err:  # noqa: BLE001 - e.g. a chat template error: the request's fault
                cmd.deliver(InvalidRequestError(f"{type(err).__name__}: {err}"))
                return
            deadline = None if cmd.timeout_s is None else cmd.submitted + cmd.timeout_s
            self._streams[cmd.request_id] = _Stream(cmd.deliver, cmd.submitted, num_tokens=len(cmd.resume[0]),
                                                    deadline=deadline)
            if deadline is not None:
                self._next_deadline = min(self._next_deadline, deadline)
            return
        if isinstance(cmd, _Abort):
            stream = self._streams.pop(cmd.request_id, None)
            if stream is not None and engine.abort_request(cmd.request_id):
                self.num_aborted += 1
                self._observe(IterationStats(finished=[self._finished(stream, "abort", time.perf_counter())]))
        elif isinstance(cmd, _Call):
            cmd.fn(engine)
        elif isinstance(cmd, _Stop):
            self._stop.set()

    def _expire(self) -> None:
        """Requests past their deadline are aborted in the engine (their KV slots freed) and their
        callers get RequestTimeoutError. The streams are scanned only once the earliest deadline
        known has passed (finished requests leave it early: one scan then finds the next)."""
        now = time.perf_counter()
        if now < self._next_deadline:
            return
        stats = IterationStats()
        for rid in [rid for rid, s in self._streams.items() if s.deadline is not None and s.deadline <= now]:
            stream = self._streams.pop(rid)
            self.engine.abort_request(rid)
            self.num_timed_out += 1
            stats.finished.append(self._finished(stream, "abort", now))
            try:
                timeout = stream.deadline - stream.submitted
                stream.deliver(RequestTimeoutError(f"the request passed its deadline ({timeout:.3g} s) and was aborted"))
            except Exception:  # noqa: BLE001 - the caller is gone
                pass
        self._observe(stats)
        self._next_deadline = min((s.deadline for s in self._streams.values() if s.deadline is not None),
                                  default=math.inf)

    def _dispatch(self, out: RequestOutput, now: float, stats: IterationStats) -> None:
        stream = self._streams.get(out.request_id)
        if stream is None:
            return
        if out.error is not None:  # the engine failed this request alone (it went on with the others)
            del self._streams[out.request_id]
            self.num_failed += 1
            stats.finished.append(self._finished(stream, "error", now))
            try:
                stream.deliver(RuntimeError(f"the engine failed this request: {out.error}"))
            except Exception:  # noqa: BLE001 - the caller is gone
                pass
            return
        self._count(stream, out, now, stats)
        if out.finished:
            del self._streams[out.request_id]
            self.num_finished += 1
            stats.finished.append(self._finished(stream, out.finish_reason or "stop", now))
        try:
            stream.deliver(out)
        except Exception:  # noqa: BLE001 - the caller's event loop is gone: drop the request
            if not out.finished:
                self._streams.pop(out.request_id, None)
                if self.engine.abort_request(out.request_id):
                    self.num_aborted += 1
                    stats.finished.append(self._finished(stream, "abort", now))

    # ---- request metrics (vLLM's set: rayspec.engine.metrics.IterationStats) -------------------------
    def _observe_scheduled(self, engine, started: float, stats: IterationStats) -> None:
        """Queue time of the requests this step took out of the waiting queue (admission happens
        at the step's start, so the step's start time is when they were scheduled)."""
        pending = [(rid, s) for rid, s in self._streams.items() if not s.scheduled]
        if not pending:
            return
        waiting = {seq.request_id for seq in getattr(engine, "waiting", ())}
        for rid, stream in pending:
            if rid not in waiting:
                stream.scheduled = True
                stats.queue_times.append(max(0.0, started - stream.submitted))

    @staticmethod
    def _count(stream: _Stream, out: RequestOutput, now: float, stats: IterationStats) -> None:
        if stream.num_prompt_tokens is None:  # the first output comes when the prompt's prefill is done
            stream.num_prompt_tokens = out.num_prompt_tokens
            stats.num_prompt_tokens += out.num_prompt_tokens
            stats.num_prefix_cache_queries += out.num_prompt_tokens
            stats.num_prefix_cache_hits += getattr(out, "num_cached_tokens", 0) or 0
        new = out.num_output_tokens - stream.num_tokens
        if new <= 0:
            return
        stream.num_tokens = out.num_output_tokens
        stats.num_generation_tokens += new
        if stream.first_token is None:
            stream.first_token = now
            stats.time_to_first_tokens.append(now - stream.submitted)
        else:
            stats.inter_token_latencies.append(now - stream.last_token)
        stream.last_token = now

    @staticmethod
    def _finished(stream: _Stream, reason: str, now: float) -> FinishedRequestStats:
        tpot = None
        if stream.first_token is not None and stream.num_tokens > 1:
            tpot = (stream.last_token - stream.first_token) / (stream.num_tokens - 1)
        return FinishedRequestStats(reason, now - stream.submitted, stream.num_prompt_tokens or 0, stream.num_tokens,
                                    tpot)

    def _observe(self, stats: IterationStats) -> None:
        if self.metrics is None or not stats:
            return
        try:
            self.metrics.observe_iteration(stats)
        except Exception:  # noqa: BLE001 - metrics are best effort, serving goes on
            logger.exception("metrics observation failed")

    def _fail_all(self, err: Exception) -> None:
        now = time.perf_counter()
        self._observe(IterationStats(finished=[self._finished(s, "error", now) for s in self._streams.values()]))
        for rid, stream in list(self._streams.items()):
            self.engine.abort_request(rid)
            try:
                stream.deliver(RuntimeError(f"engine step failed: {err!r}"))
            except Exception:  # noqa: BLE001
                pass
        self._streams.clear()

    def _update_snapshot(self) -> None:
        engine = self.engine
        self.snapshot = {
            "model": engine.config.model,
            "method": engine.config.speculative.method,
            "device": str(engine.device),
            "num_slots": engine.num_slots,
            "num_free_slots": engine.kv.num_free_slots,  # KV slots no sequence holds
            "kv_cache_usage": round(engine.kv_cache_usage(), 6),
            "max_model_len": engine.max_model_len,
            "dtype": str(engine.dtype).removeprefix("torch."),
            "cpu_kernels": _kernels_label(getattr(engine.model, "cpu_kernels", None)),
            "num_running": engine.num_running,
            "num_waiting": engine.num_waiting,
            "num_finished": self.num_finished,
            "num_aborted": self.num_aborted,
            "num_failed": self.num_failed,
            "num_rejected": self.num_rejected,
            "num_timed_out": self.num_timed_out,
            "num_steps": self.num_steps,
            "step_seconds": round(self.step_seconds, 4),
            **engine.stats.as_dict(),
        }
        self.snapshot.update(engine.proposer.stats())  # (disaggregated: the per-step proposer RPC)
        if self.metrics is not None:
            try:
                self.metrics.update(self.snapshot)
            except Exception:  # noqa: BLE001 - metrics are best effort
                logger.exception("metrics update failed")


def _kernels_label(kernels) -> str | None:
    """/v1/stats' cpu_kernels: the choice, marked while provisional (measured on busy cores)."""
    if kernels is None:
        return None
    return kernels.variant + (" (provisional: measured on busy cores)" if getattr(kernels, "contended", False) else "")
