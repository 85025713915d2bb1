"""A verifier replica whose engine thread hangs is replaced, and no request waits forever (issue #51):
with work queued or running and no step finished for step_watchdog_s, Serve's check_health fails (an
idle replica never does); a request past its deadline (request_timeout_s) ends with a 504-style
error and is aborted in the engine, also when the engine thread hangs; the deadline holds over
failovers. A fake engine whose step can be made to block (no model, no Ray cluster), and last, on
Serve, a replica whose engine hangs replaced with its stream failed over."""

from __future__ import annotations

import asyncio
import itertools
import json
import threading
import time
from types import SimpleNamespace

import pytest
from pydantic import ValidationError
from ray.exceptions import ActorUnavailableError, RayActorError

from deployments.config import AppArgs
from deployments.frontend.failover import FailoverCounts, FailoverStream
from deployments.replicas.engine_loop import EngineLoop
from deployments.transport.protocol import GenerateChunk, GenerateRequest, RequestTimeoutError
from rayspec.sampling.sampler import SamplingParams

PARAMS = SamplingParams(temperature=0, max_tokens=4)


class FakeEngine:
    """What EngineLoop uses of an LLMEngine. Its requests never finish by themselves; step() blocks
    while `gate` is clear (a CUDA call that never returns), setting `in_step` when it does."""

    num_waiting = 0

    def __init__(self):
        self.requests: set[str] = set()
        self.aborted: list[str] = []
        self.gate, self.in_step = threading.Event(), threading.Event()
        self.gate.set()
        self.config = SimpleNamespace(model="fake", speculative=SimpleNamespace(method="none"))
        self.device, self.dtype, self.num_slots, self.max_model_len = "cpu", "float32", 4, 64
        self.kv, self.model = SimpleNamespace(num_free_slots=4), SimpleNamespace()
        self.proposer = SimpleNamespace(flush=lambda: None, models=lambda: [], close=lambda: None, stats=dict)
        self.stats = SimpleNamespace(as_dict=dict)

    @property
    def num_running(self) -> int:
        return len(self.requests)

    def kv_cache_usage(self) -> float:
        return 0.0

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def add_request(self, prompt, params, request_id, **kwargs) -> None:
        self.requests.add(request_id)

    def abort_request(self, request_id: str) -> bool:
        if request_id not in self.requests:
            return False
        self.requests.discard(request_id)
        self.aborted.append(request_id)
        return True

    def step(self) -> list:
        if not self.gate.is_set():
            self.in_step.set()
            self.gate.wait()
        time.sleep(0.005)
        return []


def _wait(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def _verifier(loop: EngineLoop, request_timeout_s: float | None = None):
    """A Verifier around `loop`, without Serve: what check_health and generate read."""
    from deployments.replicas.verifier import MAX_BUFFERED_OUTPUTS, Verifier
    from deployments.replicas.work_budget import WorkBudget

    verifier = object.__new__(Verifier.func_or_class)
    verifier.loop, verifier._prefix, verifier._ids = loop, "t-", itertools.count()
    verifier._watched, verifier._watcher = {}, None
    verifier.max_buffered_outputs, verifier.request_timeout_s = MAX_BUFFERED_OUTPUTS, request_timeout_s
    verifier.work = WorkBudget(1 << 30)  # admission by work: never the bound here
    return verifier


def test_a_hung_step_with_work_fails_health_an_idle_loop_never_does():
    engine = FakeEngine()
    loop = EngineLoop(lambda: engine, idle_poll_s=0.05, step_watchdog_s=1.0)
    loop.wait_ready(10)
    verifier = _verifier(loop)
    try:
        time.sleep(2.0)  # idle for twice the watchdog's time: no step, nothing to do, healthy
        verifier.check_health()
        engine.gate.clear()  # the next step hangs
        loop.submit("r", [5, 6, 7], PARAMS, lambda item: None)
        assert engine.in_step.wait(10)
        verifier.check_health()  # hung, but not for step_watchdog_s yet
        time.sleep(1.5)
        with pytest.raises(RuntimeError, match="no engine step finished"):
            verifier.check_health()
        engine.gate.set()  # the step returns: healthy again, busy or not
        _wait(lambda: loop.health_problem(3) is None)
        loop.abort("r")
        _wait(lambda: not engine.requests)
        time.sleep(1.5)
        verifier.check_health()
        assert engine.aborted == ["r"]
    finally:
        engine.gate.set()
        loop.shutdown()


def test_a_request_past_its_deadline_gets_the_error_and_is_aborted():
    engine = FakeEngine()
    loop = EngineLoop(lambda: engine, idle_poll_s=0.05)
    loop.wait_ready(10)
    got, done = [], threading.Event()

    def deliver(item):
        got.append(item)
        done.set()

    try:
        loop.submit("late", [5, 6, 7], PARAMS, deliver, timeout_s=0.3)
        loop.submit("open", [5, 6, 7], PARAMS, lambda item: None)  # no deadline: runs on
        assert done.wait(10)
        assert isinstance(got[-1], RequestTimeoutError) and "deadline" in str(got[-1])
        assert engine.aborted == ["late"] and engine.requests == {"open"}
        _wait(lambda: loop.snapshot.get("num_timed_out") == 1)
        assert loop.num_aborted == 0  # (aborts are the callers'; this one is counted as timed out)
    finally:
        loop.shutdown()


def test_a_deadline_holds_when_the_engine_thread_hangs(monkeypatch):
    """The loop thread hangs in a step: the replica's event loop ends the request itself, a moment
    past its deadline, and the abort reaches the engine once the thread is back."""
    from deployments.replicas import verifier as verifier_module

    monkeypatch.setattr(verifier_module, "TIMEOUT_GRACE_S", 0.2)
    engine = FakeEngine()
    loop = EngineLoop(lambda: engine, idle_poll_s=0.05)
    loop.wait_ready(10)
    verifier = _verifier(loop, request_timeout_s=600)
    engine.gate.clear()

    async def run():
        started = time.monotonic()
        with pytest.raises(RequestTimeoutError, match="deadline"):
            await verifier.generate(GenerateRequest(prompt=[5, 6, 7], max_tokens=4, timeout_s=0.3))
        return time.monotonic() - started

    try:
        took = asyncio.run(asyncio.wait_for(run(), 10))
        assert 0.4 < took < 5, took
        assert engine.in_step.is_set() and engine.aborted == []  # the thread still hangs
        engine.gate.set()
        _wait(lambda: engine.aborted == ["t-0"] and not engine.requests)
    finally:
        engine.gate.set()
        loop.shutdown()


def _chunk(tokens: list[int]) -> GenerateChunk:
    return GenerateChunk(request_id="r", delta_text="x" * len(tokens), delta_token_ids=tokens, finished=False,
                         num_prompt_tokens=3, num_output_tokens=len(tokens), num_draft_tokens=0, num_accepted_tokens=0)


class _LostEachTime:
    """A verifier handle whose every replica streams one chunk, then is lost."""

    def __init__(self):
        self.requests: list[GenerateRequest] = []

    def options(self, **kwargs):
        return self

    @property
    def generate_stream(self):
        outer = self

        class _Stream:
            def __init__(self):
                self.items = [_chunk([1]), ActorUnavailableError("unreachable", None)]

            def __aiter__(self):
                return self

            async def __anext__(self):
                item = self.items.pop(0)
                if isinstance(item, BaseException):
                    raise item
                return item

            def cancel(self):
                pass

        class _Method:
            def remote(self, request):
                outer.requests.append(request)
                return _Stream()
        return _Method()


def test_the_deadline_holds_over_failovers():
    verifier = _LostEachTime()
    stream = FailoverStream(verifier, GenerateRequest(prompt=[5, 6, 7], timeout_s=30), FailoverCounts())

    async def run():
        await stream.__anext__()
        await stream.__anext__()  # the first replica is lost: resumed with the time left
        assert 29 < verifier.requests[1].timeout_s < 30 and verifier.requests[1].resume_output_ids == [1]
        stream._started -= 31  # (as if the second replica took 31 s)
        with pytest.raises(RequestTimeoutError, match="deadline"):
            await stream.__anext__()

    asyncio.run(run())
    assert len(verifier.requests) == 2 and stream.num_failovers == 1  # no third replica asked


def test_timeouts_and_lost_replicas_map_to_504_and_503():
    from deployments.frontend import ingress as ingress_module

    timed_out = ingress_module._as_openai_error(RequestTimeoutError("the request passed its deadline (1 s)"), None, 1.5)
    response = ingress_module._error_response(timed_out)
    body = json.loads(response.body)["error"]
    assert response.status_code == 504 and (body["type"], body["code"]) == ("timeout_error", "request_timeout")
    lost = ingress_module._error_response(ingress_module._as_openai_error(RayActorError(), None, 1.5))
    assert (lost.status_code, lost.headers["retry-after"]) == (503, "2")
    assert json.loads(lost.body)["error"]["code"] == "replica_lost"


def test_the_settings_and_the_ingress_deadline():
    from deployments.frontend.ingress import OpenAIIngress

    cfg = AppArgs()
    assert (cfg.step_watchdog_s, cfg.request_timeout_s) == (120, 600)
    off = AppArgs.model_validate({"step_watchdog_s": None, "request_timeout_s": None})
    assert (off.step_watchdog_s, off.request_timeout_s) == (None, None)
    for bad in ({"step_watchdog_s": 0}, {"request_timeout_s": -1}):
        with pytest.raises(ValidationError, match=f"{next(iter(bad))}\n.*greater than 0"):
            AppArgs.model_validate(bad)
    ingress = object.__new__(OpenAIIngress.func_or_class.__bases__[0])  # serve.ingress wraps our class
    ingress.cfg, ingress.actor_name = AppArgs.model_validate({"request_timeout_s": 42}), None
    assert ingress._tagged({"prompt": "hi"}).timeout_s == 42
    assert ingress._tagged({"prompt": "hi", "timeout_s": 5}).timeout_s == 5  # a handle request's own
    ingress.cfg = off
    assert ingress._tagged({"prompt": "hi"}).timeout_s is None


def test_a_replica_whose_engine_hangs_is_replaced_and_its_stream_fails_over(tiny_model_dir, serve_url, tmp_path):
    """On Serve: the only verifier replica's engine hangs mid-stream (its 21st step never returns); the
    watchdog (3 s) fails its health check, Serve stops it, and the stream resumes on the replacement,
    unbroken: the same greedy text as a request served whole afterwards."""
    import httpx
    from ray import serve
    from ray_utils import serving
    from serve_utils import tiny_args

    from deployments.config import load_app_args
    from deployments.frontend.ingress import OpenAIIngress
    from deployments.replicas.verifier import Verifier

    flag = tmp_path / "hang_once"
    flag.write_text("")

    class HangingVerifier(Verifier.func_or_class):  # (defined here: pickled by value for the replicas)
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            if flag.exists():  # the first replica only: its replacement serves
                flag.unlink()

                def hang(engine):
                    step, seen = engine.step, [0]

                    def stepping():
                        seen[0] += 1
                        if seen[0] > 20:
                            threading.Event().wait()  # a CUDA call that never returns
                        return step()
                    engine.step = stepping
                self.loop.call(hang)

    args = tiny_args(tiny_model_dir, step_watchdog_s=3,
                     verifier={"health_check_period_s": 1, "graceful_shutdown_timeout_s": 2})
    cfg = load_app_args(args)
    plain = cfg.model_dump(mode="json", exclude={"api_key"})
    verifier = serve.deployment(HangingVerifier).options(**cfg.verifier_options()).bind(plain, None, None)
    app = OpenAIIngress.options(**cfg.ingress_options()).bind(plain, verifier, None)
    body = {"model": "tiny", "prompt": "The quick brown fox jumps over the lazy dog.", "max_tokens": 300,
            "temperature": 0, "ignore_eos": True}
    with serving(("watchdog", app, "/watchdog")):
        with httpx.stream("POST", serve_url + "/watchdog/v1/completions", json={**body, "stream": True},
                          timeout=300) as response:
            events = [line[len("data: "):] for line in response.iter_lines() if line]
        assert response.status_code == 200 and events[-1] == "[DONE]", events[-3:]
        text = "".join(c["text"] for e in events[:-1] for c in json.loads(e)["choices"])
        stats = serve.get_app_handle("watchdog").stats.remote().result()
        assert not flag.exists() and stats["num_stream_failovers"] == 1
        whole = httpx.post(serve_url + "/watchdog/v1/completions", json=body, timeout=120).json()
        assert whole["choices"][0]["text"] == text and whole["usage"]["completion_tokens"] == 300
