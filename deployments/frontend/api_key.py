"""API key check for the HTTP ingress: `Authorization: Bearer <key>` on every route but GET /health.

A plain ASGI middleware (not FastAPI's BaseHTTPMiddleware): requests that pass go through
untouched, so streamed responses and client disconnects behave as without it. A request without
the key, or with another one, gets OpenAI's 401 (`invalid_api_key`, error JSON, and a
`WWW-Authenticate: Bearer` header) before its body is read. The key is compared as SHA-256
digests with hmac.compare_digest: constant time, and the length of the key does not show either.
Neither key is ever logged or echoed. Only a readiness probe (GET or HEAD /health) passes without
a key; any other method on /health is checked like every route, so it cannot be used to hold the
ingress with a body nobody authenticated.

Fail closed: with no key configured, a request from anywhere but this machine (a peer address
outside loopback) is refused with a 403 naming the fix, unless the app says
`allow_unauthenticated: true`. Binding 0.0.0.0 by mistake then serves nobody else.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
from typing import Callable

from fastapi.responses import JSONResponse

from deployments.frontend.openai_limits import OpenAIError

OPEN_PATHS = ("/health",)  # a readiness probe has no key
OPEN_METHODS = ("GET", "HEAD")  # ... and sends no body


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


def _is_loopback(scope) -> bool:
    host = (scope.get("client") or ("", 0))[0]
    if host in ("localhost", "testclient"):  # (Starlette's TestClient: in-process)
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _forbidden_remote() -> JSONResponse:
    body = OpenAIError("This server has no API key and serves this machine only. Set api_key (or "
                       "RAYSPEC_API_KEY), or allow_unauthenticated: true to serve other machines without one.",
                       status_code=403, type="permission_error", code="unauthenticated_remote").body()
    return JSONResponse(body, status_code=403)


def _unauthorized(message: str) -> JSONResponse:
    body = OpenAIError(message, status_code=401, code="invalid_api_key").body()
    return JSONResponse(body, status_code=401, headers={"WWW-Authenticate": "Bearer"})


class RequireApiKey:
    """`expected()` -> the key's digest for this request (None: no key configured, all open)."""

    def __init__(self, app, expected: Callable[[], bytes | None], remote_allowed: Callable[[], bool] = lambda: False):
        """remote_allowed() -> whether peers outside loopback may come in without a key."""
        self.app, self.expected, self.remote_allowed = app, expected, remote_allowed

    async def __call__(self, scope, receive, send):
        # lifespan passes; the ingress has no websocket routes (the router closes those)
        probe = _route_path(scope) in OPEN_PATHS and scope.get("method") in OPEN_METHODS
        if scope["type"] == "http" and not probe:
            digest = self.expected()
            if digest is None and not self.remote_allowed() and not _is_loopback(scope):
                return await _forbidden_remote()(scope, receive, send)
            if digest is not None:
                token = _bearer_token(scope)
                if token is None:
                    response = _unauthorized("You didn't provide an API key. Send it in the Authorization "
                                             "header as `Bearer <key>`.")
                    return await response(scope, receive, send)
                if not hmac.compare_digest(hashlib.sha256(token.encode("utf-8")).digest(), digest):
                    return await _unauthorized("Incorrect API key provided.")(scope, receive, send)
        await self.app(scope, receive, send)
