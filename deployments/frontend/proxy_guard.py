"""Bounds on what Ray Serve's HTTP proxy buffers (#51), installed in the proxy itself.

Serve's proxy (one per node, the head's beside Ray's GCS) reads a request's body as fast as the
client sends it, into a queue of its own with no limit, from the moment the request is routed:
while it waits for an ingress replica, and whether or not the ingress ever reads it
(`ray.serve._private.proxy`, `proxy_asgi_receive`). The ingress's own bounds (`BodyLimit`: 16 MiB,
30 s) act only once a replica takes the request, so before this guard a client could make the proxy
hold bodies of any size, for as long as it liked, in as many requests as Serve would queue.

`ProxyBodyGuard` is ASGI middleware that Serve applies to its proxy's app through the
`RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH` environment variable (`PROXY_CALLBACK`, the callback
`middlewares` below). It reads each request's body itself, before the proxy sees any of it, and
bounds it three ways (every app of the cluster, every route: the proxy serves other apps beside ours,
whose routes it cannot know, so a POST /health with a body is read too, within these bounds, before
the ingress answers it 405):
- **per request**: a Content-Length past `RAYSPEC_PROXY_MAX_BODY_BYTES` (default 16 MiB, the
  ingress's own limit) is a 413 at once, unread; a body sent without one is refused (413) the moment it
  passes the limit;
- **in time**: a body not whole within `RAYSPEC_PROXY_BODY_TIMEOUT_S` (default 30 s) is a 408: a
  client sending a byte now and then holds nothing for long;
- **in total**: the bodies the proxy holds at once, all requests together, are at most
  `RAYSPEC_PROXY_MAX_BUFFERED_BYTES` (default 256 MiB). Bytes are reserved as they arrive and given
  back when the request ends; a body that would pass the total is refused with a 429 and Retry-After
  (a flood of large bodies is refused; ordinary requests, a few KiB each, fit beside it).
Then the body goes on to the proxy whole, as one message: the proxy and everything after it see the
same request as without the guard. Every answer is OpenAI error JSON (deployments.frontend.admission).

Where it is installed: `rayspec serve` sets the variable before it starts Ray (its embedded cluster
and the proxies in it inherit it); the test clusters set it (tests/ray_utils.py); the KubeRay manifest
and `configs/cluster.yaml` set it on every node. Under a plain `serve run configs/<name>.yaml` set it
in the shell that starts Ray: `export RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH=deployments.frontend.proxy_guard:middlewares`.
The ingress logs a warning at start when its own process lacks it (the proxy and the replicas
inherit one environment, the raylet's).
"""

from __future__ import annotations

import asyncio
import os

from deployments.frontend.admission import (_TOO_LARGE, _read_body, body_too_slow, error_response, overloaded, replaying,
                                            too_large)

PROXY_CALLBACK = "deployments.frontend.proxy_guard:middlewares"
CALLBACK_ENV = "RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH"
MAX_BODY_ENV, BODY_TIMEOUT_ENV, MAX_BUFFERED_ENV = (
    "RAYSPEC_PROXY_MAX_BODY_BYTES", "RAYSPEC_PROXY_BODY_TIMEOUT_S", "RAYSPEC_PROXY_MAX_BUFFERED_BYTES")
DEFAULT_MAX_BODY_BYTES = 16 << 20
DEFAULT_BODY_TIMEOUT_S = 30.0
DEFAULT_MAX_BUFFERED_BYTES = 256 << 20
RETRY_AFTER_S = 1.0


class _Pool:
    """Bytes of request bodies held at once, all requests of this proxy together. One event loop
    (the proxy's): no lock."""

    def __init__(self, capacity: int):
        self.capacity, self.in_use, self.peak, self.refused = capacity, 0, 0, 0

    def take(self, size: int) -> bool:
        if self.in_use + size > self.capacity:
            self.refused += 1
            return False
        self.in_use += size
        self.peak = max(self.peak, self.in_use)
        return True

    def give(self, size: int) -> None:
        self.in_use -= size


class ProxyBodyGuard:
    """ASGI middleware for Serve's proxy (the module docstring)."""

    def __init__(self, app, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
                 body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S, max_buffered_bytes: int = DEFAULT_MAX_BUFFERED_BYTES):
        if max_body_bytes < 1 or body_timeout_s <= 0 or max_buffered_bytes < max_body_bytes:
            raise ValueError(f"proxy guard: need max_body_bytes >= 1, body_timeout_s > 0 and max_buffered_bytes >= "
                             f"max_body_bytes; got {max_body_bytes}, {body_timeout_s}, {max_buffered_bytes}")
        self.app, self.max_body_bytes, self.body_timeout_s = app, max_body_bytes, body_timeout_s
        self.pool = _Pool(max_buffered_bytes)

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        limit = self.max_body_bytes
        for name, value in scope.get("headers", ()):
            if name == b"content-length" and (not value.strip().isdigit() or int(value) > limit):
                return await error_response(too_large(limit))(scope, receive, send)
        held = 0

        async def counted():  # the client's messages, their bytes reserved from the pool as they come
            nonlocal held
            message = await receive()
            size = len(message.get("body", b"")) if message["type"] == "http.request" else 0
            if size and not self.pool.take(size):
                raise _PoolFull
            held += size
            return message

        try:
            try:
                async with asyncio.timeout(self.body_timeout_s):  # the whole body, however it is sent
                    parts = await _read_body(counted, limit)
            except TimeoutError:
                return await error_response(body_too_slow(self.body_timeout_s))(scope, receive, send)
            except _PoolFull:
                return await error_response(overloaded(
                    "it is receiving as many request bodies as it holds at once", RETRY_AFTER_S))(scope, receive, send)
            if parts is None:  # the client went away
                return
            if parts is _TOO_LARGE:
                return await error_response(too_large(limit))(scope, receive, send)
            await self.app(scope, replaying(parts, receive), send)
        finally:
            self.pool.give(held)


class _PoolFull(Exception):
    pass


def _env_number(name: str, default, kind):
    raw = os.environ.get(name)
    if raw is None or not raw.strip():
        return default
    try:
        return kind(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not a {kind.__name__}") from None


def middlewares() -> list:
    """Serve's proxy callback (RAY_SERVE_HTTP_PROXY_CALLBACK_IMPORT_PATH): the guard, its bounds from
    the environment."""
    from starlette.middleware import Middleware

    return [Middleware(ProxyBodyGuard,
                       max_body_bytes=_env_number(MAX_BODY_ENV, DEFAULT_MAX_BODY_BYTES, int),
                       body_timeout_s=_env_number(BODY_TIMEOUT_ENV, DEFAULT_BODY_TIMEOUT_S, float),
                       max_buffered_bytes=_env_number(MAX_BUFFERED_ENV, DEFAULT_MAX_BUFFERED_BYTES, int))]


def install_env(environ=os.environ) -> None:
    """Install the guard for proxies started from here on (a Ray cluster started by this process
    passes its environment to its proxies); a callback already set is left as it is."""
    environ.setdefault(CALLBACK_ENV, PROXY_CALLBACK)


def installed(environ=os.environ) -> bool:
    return environ.get(CALLBACK_ENV) == PROXY_CALLBACK


def unguarded_warning(environ=os.environ) -> str | None:
    """The ingress's warning at start when this process (and so, most likely, Serve's proxy beside it)
    lacks the guard."""
    if installed(environ):
        return None
    return (f"Serve's HTTP proxy reads request bodies without a bound of ours: set {CALLBACK_ENV}="
            f"{PROXY_CALLBACK} in the environment that starts Ray (`rayspec serve` does; deployments/README.md)")
