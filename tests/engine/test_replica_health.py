"""A verifier replica that is alive but broken gets replaced (issue #35): when its last steps all
raise (a sticky device error), Serve's check_health fails, so Serve starts a new replica instead of
routing more requests to the one that empties fastest; one good step makes it healthy again."""

from __future__ import annotations

import threading

import pytest

from engine_utils import cached_model, make_engine
from rayspec.sampling.sampler import SamplingParams


def test_a_replica_whose_steps_all_fail_reports_unhealthy(tiny_model_dir):
    from deployments.replicas.engine_loop import EngineLoop
    from deployments.replicas.verifier import UNHEALTHY_AFTER_FAILED_STEPS, Verifier

    loop = EngineLoop(lambda: make_engine(tiny_model_dir, "ngram", loaded=cached_model(str(tiny_model_dir))))
    loop.wait_ready(120)
    verifier = object.__new__(Verifier.func_or_class)  # only check_health is used: it reads `loop`
    verifier.loop = loop

    def run(rid: str):
        done, got = threading.Event(), []

        def deliver(item):
            got.append(item)
            if isinstance(item, BaseException) or item.finished:
                done.set()
        loop.submit(rid, [5, 6, 7], SamplingParams(temperature=0, max_tokens=4), deliver)
        assert done.wait(60)
        return got[-1]

    def sticky_error():
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    try:
        verifier.check_health()
        loop.call(lambda engine: setattr(engine, "step", sticky_error))
        for i in range(UNHEALTHY_AFTER_FAILED_STEPS):
            assert isinstance(run(f"bad-{i}"), RuntimeError)
            if i < UNHEALTHY_AFTER_FAILED_STEPS - 1:
                verifier.check_health()  # one or two failed steps: a request's bad luck, not the replica's
        with pytest.raises(RuntimeError, match="steps all failed"):
            verifier.check_health()
        loop.call(lambda engine: delattr(engine, "step"))  # the device recovered
        assert run("good").finished
        verifier.check_health()
    finally:
        loop.shutdown()
