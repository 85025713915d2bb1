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
`/tokenize` and `/detokenize` (a verifier call each) go through the same gate.

Every request body is also bounded before anything parses it (`BodyLimit`, app arg
`max_request_body_bytes`): a Content-Length past the limit is a 413 at once, unread; a body sent
without one is counted as it comes and refused (413) the moment it passes the limit.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from fastapi.responses import JSONResponse

from deployments.openai_limits import OpenAIError

GENERATION_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})
GATED_PATHS = GENERATION_PATHS | {"/tokenize", "/detokenize"}  # every POST that calls the verifier


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
    """ASGI middleware: at most `state().max_in_flight` generation (and tokenizer) requests in this
    replica at once.

    `state()` -> the AdmissionState of the replica serving the request. A streamed response counts
    until the ASGI app returns, i.e. until its last event was sent or the client went away."""

    def __init__(self, app, state: Callable[[], AdmissionState]):
        self.app, self.state = app, state

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope.get("method") != "POST" or _route_path(scope) not in GATED_PATHS:
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


def too_large(limit: int) -> OpenAIError:
    return OpenAIError(f"The request body is larger than this server accepts ({limit} bytes).", status_code=413,
                       code="request_too_large")


class BodyLimit:
    """ASGI middleware: a request body of more than `max_bytes()` bytes gets a 413 (OpenAI error
    JSON) before any of it is parsed, and no more of it is read. The body is read here (at most
    the limit) and handed on whole, so what runs after sees the same messages as without it."""

    def __init__(self, app, max_bytes: Callable[[], int]):
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope.get("method") not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        limit = self.max_bytes()
        for name, value in scope.get("headers", ()):
            if name == b"content-length" and (not value.strip().isdigit() or int(value) > limit):
                return await error_response(too_large(limit))(scope, receive, send)
        parts, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client went away
                return
            body = message.get("body", b"")
            size += len(body)
            if size > limit:
                return await error_response(too_large(limit))(scope, receive, send)
            parts.append(body)
            if not message.get("more_body", False):
                break
        whole = {"type": "http.request", "body": b"".join(parts), "more_body": False}
        del parts

        async def replay():
            nonlocal whole
            if whole is not None:
                message, whole = whole, None
                return message
            return await receive()  # a disconnect, for streamed responses

        await self.app(scope, replay, send)
