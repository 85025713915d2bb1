"""Streamed responses tell a reverse proxy not to buffer them (deployments/frontend/sse.py): every SSE
response of the ingress carries `X-Accel-Buffering: no` and `Cache-Control: no-cache` besides its
`text/event-stream` type. Without Ray: the ingress class's stream response over stubbed verifier
streams (tests/serve/test_serve_faults.py checks the same headers over HTTP)."""

from __future__ import annotations

import asyncio

import deployments.frontend.ingress as ingress_module
from deployments.frontend.completions import CompletionChoices


def test_sse_responses_ask_proxies_not_to_buffer(monkeypatch):
    async def open_streams(verifier, requests, failovers):
        return [], []

    monkeypatch.setattr(ingress_module, "open_streams", open_streams)
    cls = ingress_module.OpenAIIngress.func_or_class.__bases__[0]  # serve.ingress wraps our class
    ingress = object.__new__(cls)
    ingress.verifier, ingress.failovers, ingress.verifier_answered = None, None, False
    response = asyncio.run(ingress._stream_response([], None, CompletionChoices(None)))
    assert response.media_type == "text/event-stream"
    assert response.headers["x-accel-buffering"] == "no"
    assert response.headers["cache-control"] == "no-cache"
    assert response.headers["content-type"].startswith("text/event-stream")


def test_abuse_benchmark_tells_an_error_event_from_a_token_named_error():
    """benchmarks/abuse.py classes a stream by its events, not by the bytes '"error"': a choice whose
    text is the token "error" (a random model's output once gave one, and CI failed on it) is a
    complete stream; a real error event gives its code, else its type."""
    import json
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    import abuse

    def sse(*events) -> bytes:
        return "".join(f"data: {json.dumps(e)}\n\n" for e in events).encode() + b"data: [DONE]\n\n"

    token = sse({"choices": [{"index": 0, "text": "error", "finish_reason": None}]})
    assert b'"error"' in token and abuse._error_events(token) == []
    failed = sse({"choices": [{"index": 0, "text": "a"}]}, {"error": {"message": "x", "type": "internal_error", "code": 500}})
    assert abuse._in_band_error(failed) == "500"
    typed = sse({"error": {"message": "x", "type": "overloaded", "code": None}})
    assert abuse._in_band_error(typed) == "overloaded"
    assert abuse._in_band_error(b"data: {not json, \"error\"\n\n") == "unparsed error event"
    assert abuse._in_band_error(token) == "no [DONE]"
