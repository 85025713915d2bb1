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
