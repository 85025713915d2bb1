"""Admission control: a busy server says so at once (429 with Retry-After, as OpenAI error JSON)
instead of queueing without bound or falling over, and no one client takes all of it.

Bounds, outermost first (deployments/README.md has the table and the defaults):
1. the ingress replica's gate (`AdmissionGate`, below), before the body is even read:
   - at most `max_in_flight` generation requests (POST /v1/completions, /v1/chat/completions) in
     flight, a stream counting until its last byte;
   - `/tokenize` and `/detokenize` (a verifier call each, cheap but unbounded in number) in a lane
     of their own, at most `max_tokenizer_in_flight`: a flood of them cannot take generation's places;
   - at most `max_per_client` of either kind from one client (its address, or the header named by
     `client_header` behind a trusted proxy): one host's flood of streams, read or not, gets 429s
     while other clients still get in;
2. Serve's `max_queued_requests` on the verifier, per ingress replica: requests waiting for a verifier
   replica with room; past it the handle raises BackPressureError, which the ingress answers with 429
   (503 `not_ready` while no verifier replica has answered yet: the target is still loading);
3. the engine's waiting queue (`engine.max_num_waiting`, per verifier replica): past it the engine
   refuses the request (EngineOverloadedError) and the ingress answers 429;
4. the verifier replica's work budget (`work_budget_tokens`, deployments.replicas.work_budget): a
   request's work in tokens (prompt + max_tokens per choice, prompts scored or echoed weighted more),
   its choices let in together; past the budget a 429 at once, past the whole budget alone a 400.
Requests let in are served in full and unchanged; refused ones cost microseconds.

Every request body is also bounded before anything parses it (`BodyLimit`, app arg
`max_request_body_bytes`): a Content-Length past the limit is a 413 at once, unread; a body sent
without one is counted as it comes and refused (413) the moment it passes the limit; one not whole
within `body_timeout_s` (a client sending a byte now and then, holding a place) is a 408. Only the
routes that take a body (a POST route of the app) have theirs read: any other method or path goes
on unread, to the router's 404 or 405.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

from fastapi.responses import JSONResponse

from deployments.frontend.openai_limits import OpenAIError

GENERATION_PATHS = frozenset({"/v1/completions", "/v1/chat/completions"})
TOKENIZER_PATHS = frozenset({"/tokenize", "/detokenize"})
GATED_PATHS = GENERATION_PATHS | TOKENIZER_PATHS  # every POST that calls the verifier


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


def client_of(scope, header: str | None = None) -> str:
    """Who sent the request, for the per-client share: the value of `header` when it is set and
    present (a tenant id a trusted proxy adds; for a list such as X-Forwarded-For, its LAST entry:
    the address the trusted proxy itself saw, where the entries before it are whatever the client
    wrote), else the peer address (Serve's proxy hands the replica the HTTP connection's scope)."""
    if header:
        name = header.lower().encode()
        values = [value for key, value in scope.get("headers", ()) if key == name and value.strip()]
        if values:  # (a repeated header: the proxy appends its own last)
            return "h:" + values[-1].decode("latin-1").split(",")[-1].strip()
    peer = scope.get("client") or ("", 0)
    return "a:" + str(peer[0])


def tenant_salt(tenant: str, cache_salt: str | None) -> str:
    """A request's cache salt under the app's tenant_header: its tenant's (the header's value, hashed:
    the salt travels and is logged nowhere, the tenant id is not spelled out), then its own if it
    sent one. Requests of different tenants never share a cached prefix (rayspec.kv.block_manager
    roots each salt's chain apart), whatever salt they send."""
    both = tenant.encode("utf-8") + (b"\0" + cache_salt.encode("utf-8") if cache_salt else b"")
    return "tenant:" + hashlib.sha256(both).hexdigest()[:32]


@dataclass
class AdmissionState:
    """One ingress replica's gate: its bounds, and what went through it (in /v1/stats)."""

    max_in_flight: int
    retry_after_s: float | None = None
    max_tokenizer_in_flight: int | None = None  # None: max_in_flight (one lane's bound each)
    max_per_client: int | None = None  # None: no per-client bound
    client_header: str | None = None
    in_flight: int = 0
    tokenizer_in_flight: int = 0
    num_refused: int = 0  # requests answered 429 by the gate (either bound)
    num_refused_per_client: int = 0  # of those, for their client's share
    num_backpressured: int = 0  # 429/503 for a full verifier queue or engine waiting queue
    per_client: Counter = field(default_factory=Counter)  # client -> its requests in flight (both lanes)

    def as_dict(self) -> dict:
        return {"ingress_in_flight": self.in_flight, "ingress_max_in_flight": self.max_in_flight,
                "ingress_tokenizer_in_flight": self.tokenizer_in_flight,
                "ingress_clients_in_flight": len(self.per_client),
                "num_refused_at_ingress": self.num_refused, "num_refused_per_client": self.num_refused_per_client,
                "num_refused_downstream": self.num_backpressured}

    def refusal(self, tokenizer: bool, client: str) -> str | None:
        """Why a request of this lane and client cannot come in now (None: it can)."""
        if tokenizer:
            bound = self.max_in_flight if self.max_tokenizer_in_flight is None else self.max_tokenizer_in_flight
            if self.tokenizer_in_flight >= bound:
                return f"{self.tokenizer_in_flight} tokenizer requests in flight on this replica (max {bound})"
        elif self.in_flight >= self.max_in_flight:
            return f"{self.in_flight} requests in flight on this replica (max {self.max_in_flight})"
        if self.max_per_client is not None and self.per_client[client] >= self.max_per_client:
            self.num_refused_per_client += 1
            return f"{self.per_client[client]} of your requests are in flight (max {self.max_per_client} per client)"
        return None

    def enter(self, tokenizer: bool, client: str) -> None:
        if tokenizer:
            self.tokenizer_in_flight += 1
        else:
            self.in_flight += 1
        self.per_client[client] += 1

    def leave(self, tokenizer: bool, client: str) -> None:
        if tokenizer:
            self.tokenizer_in_flight -= 1
        else:
            self.in_flight -= 1
        self.per_client[client] -= 1
        if self.per_client[client] <= 0:
            del self.per_client[client]  # the table holds only clients with requests in flight


class AdmissionGate:
    """ASGI middleware: the bounds of `state()` (AdmissionState), per replica.

    `state()` -> the AdmissionState of the replica serving the request. A streamed response counts
    until the ASGI app returns, i.e. until its last event was sent or the client went away."""

    def __init__(self, app, state: Callable[[], AdmissionState]):
        self.app, self.state = app, state

    async def __call__(self, scope, receive, send):
        path = _route_path(scope)
        if scope["type"] != "http" or scope.get("method") != "POST" or path not in GATED_PATHS:
            return await self.app(scope, receive, send)
        state = self.state()
        tokenizer, client = path in TOKENIZER_PATHS, client_of(scope, state.client_header)
        why = state.refusal(tokenizer, client)
        if why is not None:
            state.num_refused += 1
            return await error_response(overloaded(why, state.retry_after_s))(scope, receive, send)
        state.enter(tokenizer, client)
        try:
            await self.app(scope, receive, send)
        finally:
            state.leave(tokenizer, client)


def too_large(limit: int) -> OpenAIError:
    return OpenAIError(f"The request body is larger than this server accepts ({limit} bytes).", status_code=413,
                       code="request_too_large")


def body_too_slow(timeout_s: float) -> OpenAIError:
    return OpenAIError(f"The request body did not arrive within {timeout_s:g} s.", status_code=408,
                       code="request_timeout")


DEFAULT_BODY_TIMEOUT_S = 30.0


class BodyLimit:
    """ASGI middleware: a request body of more than `max_bytes()` bytes gets a 413 (OpenAI error
    JSON) before any of it is parsed, and no more of it is read; one not whole within
    `timeout_s()` seconds gets a 408. The body is read here (at most the limit) and handed on
    whole, so what runs after sees the same messages as without it. `takes_body(method, path, app)`:
    whether a route takes this request's body (body_routes); other requests go on unread (the
    router answers them 404 or 405 without reading a byte of the body)."""

    def __init__(self, app, max_bytes: Callable[[], int], takes_body: Callable[[str, str, object], bool],
                 timeout_s: Callable[[], float] = lambda: DEFAULT_BODY_TIMEOUT_S):
        self.app, self.max_bytes, self.takes_body, self.timeout_s = app, max_bytes, takes_body, timeout_s

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not self.takes_body(scope.get("method", ""), _route_path(scope), scope.get("app")):
            return await self.app(scope, receive, send)
        limit = self.max_bytes()
        for name, value in scope.get("headers", ()):
            if name == b"content-length" and (not value.strip().isdigit() or int(value) > limit):
                return await error_response(too_large(limit))(scope, receive, send)
        timeout_s = self.timeout_s()
        try:
            async with asyncio.timeout(timeout_s):  # the whole body, however it is sent
                parts = await _read_body(receive, limit)
        except TimeoutError:
            return await error_response(body_too_slow(timeout_s))(scope, receive, send)
        if parts is None:  # the client went away
            return
        if parts is _TOO_LARGE:
            return await error_response(too_large(limit))(scope, receive, send)
        await self.app(scope, replaying(parts, receive), send)


_TOO_LARGE: list = []  # (a marker: _read_body's answer for a body past the limit)


def replaying(parts: list[bytes], receive):
    """A receive that hands on a body read whole (its parts) as one message, then the client's own
    messages (a disconnect, for streamed responses)."""
    whole = {"type": "http.request", "body": b"".join(parts), "more_body": False}
    parts.clear()

    async def replay():
        nonlocal whole
        if whole is not None:
            message, whole = whole, None
            return message
        return await receive()

    return replay


async def _read_body(receive, limit: int) -> list[bytes] | None:
    """A request body's parts as they come: None when the client went away, _TOO_LARGE the moment
    it passes `limit` bytes (no more of it read)."""
    parts, size = [], 0
    while True:
        message = await receive()
        if message["type"] != "http.request":  # the client went away
            return None
        body = message.get("body", b"")
        size += len(body)
        if size > limit:
            return _TOO_LARGE
        parts.append(body)
        if not message.get("more_body", False):
            return parts


def body_routes(paths: frozenset[str] = GATED_PATHS) -> Callable[[str, str, object], bool]:
    """(method, path, app) -> whether the request's body is one a route takes: a POST to one of
    `paths` (the ingress's POST routes, declared here: tests/unit/test_ingress_limits.py checks them
    against the ingress's @app.post routes). Declared rather than read from the app: under Serve a
    class-based ingress's routes sit in an included router, whose layout is FastAPI's own."""
    def takes_body(method: str, path: str, app=None) -> bool:
        return method == "POST" and path in paths

    return takes_body
