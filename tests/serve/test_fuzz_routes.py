"""Property-based fuzzing of the served OpenAI routes from the app's own OpenAPI schema
(schemathesis + hypothesis), against a live Serve app on localhost: no 5xx, no hang.

Every operation in /openapi.json gets bodies that fit the schema ("positive") and bodies that do not
("negative"). Half of the positive generation bodies name the served model (else nearly all of them
would stop at the 404 for an unknown model and never reach the engine); their max_tokens and n are
cut to keep the run short (set to 16 when absent: the server's default is the whole context). Hypothesis runs derandomized: the same examples in every run, a bounded
budget (FUZZ_EXAMPLES per operation and mode; more with RAYSPEC_FUZZ_EXAMPLES=N, e.g. for a longer
local run). Every response must come within CALL_TIMEOUT_S, be below 500, and a 4xx must be OpenAI
error JSON.
"""

from __future__ import annotations

import json
import os
import time
from collections import Counter

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.generation.modes import GenerationMode

from deployments.app import build_app
from ray_utils import serving
from serve_utils import tiny_args

FUZZ_EXAMPLES = int(os.environ.get("RAYSPEC_FUZZ_EXAMPLES", "80"))
CALL_TIMEOUT_S = 60.0
GENERATION = {"/v1/completions", "/v1/chat/completions"}


@pytest.fixture(scope="module")
def served(tiny_model_dir, serve_url):
    with serving(("fuzz", build_app(tiny_args(tiny_model_dir)), "/")):
        yield serve_url


@pytest.fixture(scope="module")
def operations(served):
    schema = schemathesis.openapi.from_url(f"{served}/openapi.json")
    ops = [result.ok() for result in schema.get_all_operations()]
    return {(op.method.upper(), op.path): op for op in ops}


def test_schema_lists_the_openai_routes(operations):
    assert {("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("GET", "/v1/models"),
            ("GET", "/health"), ("GET", "/v1/stats")} <= set(operations)


def _tame(case) -> None:
    """Bodies that reach the engine: the served model's name, bounded output."""
    body = case.body
    if not isinstance(body, dict) or case.operation.path not in GENERATION:
        return
    body["model"] = "tiny"
    if isinstance(body.get("max_tokens"), int) and not isinstance(body["max_tokens"], bool):
        body["max_tokens"] = max(1, min(body["max_tokens"], 16))
    if isinstance(body.get("n"), int) and not isinstance(body["n"], bool):
        body["n"] = max(1, min(body["n"], 2))
    if isinstance(body.get("max_completion_tokens"), int) and not isinstance(body["max_completion_tokens"], bool):
        body["max_completion_tokens"] = max(1, min(body["max_completion_tokens"], 16))
    for key in ("max_tokens", "max_completion_tokens"):
        if key in body and body[key] is None:  # null is "absent" to the server
            del body[key]
    if "max_tokens" not in body and "max_completion_tokens" not in body:
        # absent means "up to max_model_len": hundreds of tokens per example, the whole budget in a few
        body["max_tokens"] = 16


def _check(response, case) -> None:
    status = response.status_code
    assert status < 500, f"{case.operation.path} {json.dumps(case.body)} -> {status} {response.text[:500]}"
    if status >= 400 and status != 405:  # 405: a method the route lacks (Starlette's plain body)
        error = response.json().get("error")
        assert isinstance(error, dict) and error.get("message"), (status, response.text[:500])


CASES = [(route, mode) for route in ("POST /v1/completions", "POST /v1/chat/completions")
         for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)]
CASES += [(route, GenerationMode.POSITIVE) for route in ("GET /v1/models", "GET /health", "GET /v1/stats")]
# (the GET routes take no parameters: there is nothing in them to violate)


@pytest.mark.parametrize("route,mode", CASES)
def test_route_fuzz_no_server_error(served, operations, route, mode):
    method, path = route.split(" ", 1)
    op = operations[(method, path)]
    statuses: list[int] = []
    slowest: list[tuple[float, str]] = []
    budget = FUZZ_EXAMPLES if path in GENERATION else max(5, FUZZ_EXAMPLES // 12)

    @settings(max_examples=budget, deadline=None, derandomize=True, database=None, print_blob=True,
              suppress_health_check=list(HealthCheck))
    @given(case=op.as_strategy(generation_mode=mode))
    def fuzz(case):
        if mode is GenerationMode.POSITIVE:
            _tame(case)
        started = time.monotonic()
        response = case.call(base_url=served, timeout=CALL_TIMEOUT_S)
        slowest.append((time.monotonic() - started, repr(case.body)[:200]))
        slowest.sort(reverse=True)
        del slowest[3:]
        statuses.append(response.status_code)
        _check(response, case)

    fuzz()
    print(f"{route} {mode}: statuses {dict(sorted(Counter(statuses).items()))}")  # shown with -s
    for seconds, body in slowest:
        print(f"  {seconds:.2f}s {body}")
    assert statuses, "no example ran"
    if mode is GenerationMode.POSITIVE and path in GENERATION:
        assert 200 in statuses, sorted(set(statuses))  # some bodies reached the engine and were served
    if mode is GenerationMode.NEGATIVE:
        assert all(400 <= s < 500 for s in statuses), sorted(set(statuses))  # never accepted, never a 5xx
    # the server still serves afterwards, and nothing is left running
    resp = httpx.post(f"{served}/v1/completions", json={"model": "tiny", "prompt": "a b c", "max_tokens": 4},
                      timeout=CALL_TIMEOUT_S)
    assert resp.status_code == 200, resp.text
