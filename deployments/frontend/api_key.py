"""API key check for the HTTP ingress: `Authorization: Bearer <key>` on every route but /health.

A plain ASGI middleware (not FastAPI's BaseHTTPMiddleware): requests that pass go through
untouched, so streamed responses and client disconnects behave as without it. A request without
the key, or with another one, gets OpenAI's 401 (`invalid_api_key`, error JSON, and a
`WWW-Authenticate: Bearer` header) before its body is read. The key is compared as SHA-256
digests with hmac.compare_digest: constant time, and the length of the key does not show either.
Neither key is ever logged or echoed.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
from typing import Callable

from fastapi.responses import JSONResponse

from deployments.frontend.openai_limits import OpenAIError

OPEN_PATHS = ("/health",)  # a readiness probe has no key


def key_digest(key) -> bytes | None:
    """str or pydantic SecretStr -> what requests are checked against; None: no key."""
    if key is None:
        return None
    if hasattr(key, "get_secret_value"):
        key = key.get_secret_value()
    return hashlib.sha256(key.encode("utf-8")).digest()


def exposure_warning(host: str | None, has_key: bool) -> str | None:
    """What to warn about when the HTTP proxy binds `host`: None on a loopback address or with a key."""
    if has_key or host in (None, "", "localhost"):
        return None
    try:
        if ipaddress.ip_address(host).is_loopback:
            return None
    except ValueError:  # a host name: reachable from wherever it resolves
        pass
    return (f"serving on {host} without an API key: anyone who can reach this port can use the model. "
            "Set api_key (or RAYSPEC_API_KEY), or bind 127.0.0.1")


def _route_path(scope) -> str:
    """The path inside the app (Serve mounts an app under its route_prefix, given as root_path)."""
    path, root = scope.get("path", ""), scope.get("root_path", "")
    if root and path.startswith(root) and path[len(root):len(root) + 1] in ("", "/"):
        path = path[len(root):]
    return path or "/"


def _bearer_token(scope) -> str | None:
    for name, value in scope.get("headers", ()):
        if name == b"authorization":
            scheme, _, token = value.decode("latin-1").strip().partition(" ")
            return token.strip() if scheme.lower() == "bearer" and token.strip() else None
    return None


def _unauthorized(message: str) -> JSONResponse:
    body = OpenAIError(message, status_code=401, code="invalid_api_key").body()
    return JSONResponse(body, status_code=401, headers={"WWW-Authenticate": "Bearer"})


class RequireApiKey:
    """`expected()` -> the key's digest for this request (None: no key configured, all open)."""

    def __init__(self, app, expected: Callable[[], bytes | None]):
        self.app, self.expected = app, expected

    async def __call__(self, scope, receive, send):
        # lifespan passes; the ingress has no websocket routes (the router closes those)
        if scope["type"] == "http" and _route_path(scope) not in OPEN_PATHS:
            digest = self.expected()
            if digest is not None:
                token = _bearer_token(scope)
                if token is None:
                    response = _unauthorized("You didn't provide an API key. Send it in the Authorization "
                                             "header as `Bearer <key>`.")
                    return await response(scope, receive, send)
                if not hmac.compare_digest(hashlib.sha256(token.encode("utf-8")).digest(), digest):
                    return await _unauthorized("Incorrect API key provided.")(scope, receive, send)
        await self.app(scope, receive, send)
