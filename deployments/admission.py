"""Admission control: a busy server says so at once (429 with Retry-After, as OpenAI error JSON)
instead of queueing without bound or falling over.

Bounds, outermost first (deployments/README.md has the table and the defaults):
1. the ingress replica's gate (`AdmissionGate`, below): at most `ingress.max_ongoing_requests`
   generation requests (POST /v1/completions, /v1/chat/completions) in flight, a stream counting
   until its last byte; past it, 429 here, before the body is even read;
2. Serve's `max_queued_requests` on the verifier, per ingress replica: requests waiting for a verifier
   replica with room; past it the handle raises BackPressureError, which the ingress answers with 429
   (503 `not_ready` while no verifier replica has answered yet: the target is still loading);
3. the engine's waiting queue (`engine.max_num_waiting`, per verifier replica): past it the engine
   refuses the request (EngineOverloadedError) and the ingress answers 429.
Requests let in are served in full and unchanged; refused ones cost microseconds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from fastapi.responses import JSONResponse

from deployments.openai_protocol import OpenAIError

GENERATION_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})


def overloaded(message: str, retry_after_s: float | None) -> OpenAIError:
    return OpenAIError(f"The server is busy: {message}. Try again later.", status_code=429,
                       type="rate_limit_error", code="server_overloaded", retry_after_s=retry_after_s)


def not_ready(message: str, retry_after_s: float | None) -> OpenAIError:
    return OpenAIError(f"The model is not ready: {message}. Try again later.", status_code=503,
                       type="service_unavailable", code="not_ready", retry_after_s=retry_after_s)


def error_response(err: OpenAIError) -> JSONResponse:
    return JSONResponse(err.body(), status_code=err.status_code, headers=err.headers())


def _route_path(scope) -> str:
    path = scope.get("path", "")
    root = scope.get("root_path", "")
    return path[len(root):] if root and path.startswith(root) else path


@dataclass
class AdmissionState:
    """One ingress replica's gate: its bound, and what went through it (in /v1/stats)."""

    max_in_flight: int
    retry_after_s: float | None = None
    in_flight: int = 0
    num_refused: int = 0  # requests answered 429 by the gate
    num_backpressured: int = 0  # 429/503 for a full verifier queue or engine waiting queue

    def as_dict(self) -> dict:
        return {"ingress_in_flight": self.in_flight, "ingress_max_in_flight": self.max_in_flight,
                "num_refused_at_ingress": self.num_refused, "num_refused_downstream": self.num_backpressured}


class AdmissionGate:
    """ASGI middleware: at most `state().max_in_flight` generation requests in this replica at once.

    `state()` -> the AdmissionState of the replica serving the request. A streamed response counts
    until the ASGI app returns, i.e. until its last event was sent or the client went away."""

    def __init__(self, app, state: Callable[[], AdmissionState]):
        self.app, self.state = app, state

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope.get("method") != "POST" or _route_path(scope) not in GENERATION_PATHS:
            return await self.app(scope, receive, send)
        state = self.state()
        if state.in_flight >= state.max_in_flight:
            state.num_refused += 1
            err = overloaded(f"{state.in_flight} requests in flight on this replica (max {state.max_in_flight})",
                             state.retry_after_s)
            return await error_response(err)(scope, receive, send)
        state.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            state.in_flight -= 1
