"""The guard Serve's HTTP proxy runs (deployments/frontend/proxy_guard.py, #51): bodies bounded per
request, in time and in total before the proxy holds any of them. Here as plain ASGI (no Ray); that
the shared test cluster's proxy runs it is tests/serve/test_serve_faults.py's
test_serve_proxy_bounds_a_slow_body_before_the_ingress."""

import asyncio
import json

import pytest

from deployments.frontend import proxy_guard
from deployments.frontend.proxy_guard import ProxyBodyGuard


class App:
    """What the proxy would be: reads the request's messages, answers 200 with the body's size."""

    def __init__(self, hold_s: float = 0.0):
        self.bodies, self.hold_s = [], hold_s  # hold_s: how long it keeps a request (a replica's answer)

    async def __call__(self, scope, receive, send):
        parts = []
        while True:
            message = await receive()
            parts.append(message.get("body", b""))
            if not message.get("more_body"):
                break
        self.bodies.append(b"".join(parts))
        await asyncio.sleep(self.hold_s)
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": str(len(self.bodies[-1])).encode()})


def scope(headers=(), method="POST", path="/v1/completions"):
    return {"type": "http", "method": method, "path": path, "headers": list(headers)}


async def call(guard, messages, headers=(), delay_s=0.0, method="POST", path="/v1/completions"):
    """Run one request through the guard: the client's body messages (then a disconnect), the answer's
    status and JSON body."""
    sent = []
    queue = list(messages)

    async def receive():
        if delay_s:
            await asyncio.sleep(delay_s)
        if queue:
            return queue.pop(0)
        await asyncio.sleep(3600)  # a client that keeps the connection open

    async def send(message):
        sent.append(message)

    await guard(scope(headers, method, path), receive, send)
    status = next(m["status"] for m in sent if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return status, body


def chunks(sizes):
    return [{"type": "http.request", "body": b"x" * n, "more_body": i < len(sizes) - 1} for i, n in enumerate(sizes)]


def test_a_body_within_the_limits_reaches_the_proxy_whole():
    app = App()
    guard = ProxyBodyGuard(app, max_body_bytes=1000, body_timeout_s=5, max_buffered_bytes=4000)
    status, body = asyncio.run(call(guard, chunks([300, 300, 300])))
    assert (status, body) == (200, b"900") and app.bodies == [b"x" * 900]
    assert guard.pool.in_use == 0 and guard.pool.peak == 900  # held while the request ran, given back after


def test_a_declared_length_past_the_limit_is_a_413_unread():
    app = App()
    guard = ProxyBodyGuard(app, max_body_bytes=1000, body_timeout_s=5, max_buffered_bytes=4000)
    status, body = asyncio.run(call(guard, [], headers=[(b"content-length", b"5000")]))
    assert status == 413 and json.loads(body)["error"]["code"] == "request_too_large"
    assert app.bodies == [] and guard.pool.peak == 0


def test_a_chunked_body_past_the_limit_is_refused_as_it_passes_it():
    app = App()
    guard = ProxyBodyGuard(app, max_body_bytes=1000, body_timeout_s=5, max_buffered_bytes=4000)
    status, body = asyncio.run(call(guard, chunks([600, 600, 600, 600])))
    assert status == 413 and app.bodies == [] and guard.pool.in_use == 0


def test_a_slow_body_is_a_408_within_the_deadline():
    app = App()
    guard = ProxyBodyGuard(app, max_body_bytes=1000, body_timeout_s=0.3, max_buffered_bytes=4000)

    async def run():
        start = asyncio.get_running_loop().time()
        answer = await call(guard, chunks([1] * 100), delay_s=0.05)  # a byte every 50 ms: 5 s for the body
        return answer, asyncio.get_running_loop().time() - start

    (status, body), took = asyncio.run(run())
    assert status == 408 and json.loads(body)["error"]["code"] == "request_timeout"
    assert took < 1.5 and app.bodies == [] and guard.pool.in_use == 0


def test_bodies_held_at_once_are_bounded_in_total():
    """Three slow 800-byte bodies against a pool of 2,000 bytes: the third is refused with a 429 and
    Retry-After as it would pass the total, while the first two arrive and are served (each held
    0.2 s after its body is whole, as the proxy holds it until a replica answers)."""
    app = App(hold_s=0.2)
    guard = ProxyBodyGuard(app, max_body_bytes=1000, body_timeout_s=5, max_buffered_bytes=2000)

    async def run():
        return await asyncio.gather(*(call(guard, chunks([200, 200, 200, 200]), delay_s=0.01)
                                      for i in range(3)))

    answers = asyncio.run(run())
    assert sorted(status for status, _ in answers) == [200, 200, 429]
    refused = next(json.loads(body) for status, body in answers if status == 429)
    assert refused["error"]["code"] == "server_overloaded"
    assert guard.pool.peak <= 2000 and guard.pool.in_use == 0 and guard.pool.refused == 1


def test_a_request_without_a_body_goes_on_at_once():
    app = App()
    guard = ProxyBodyGuard(app, max_body_bytes=1000, body_timeout_s=5, max_buffered_bytes=4000)
    status, body = asyncio.run(call(guard, [{"type": "http.request", "body": b"", "more_body": False}]))
    assert (status, body) == (200, b"0")


def test_the_callback_reads_its_bounds_from_the_environment(monkeypatch):
    monkeypatch.setenv(proxy_guard.MAX_BODY_ENV, "2048")
    monkeypatch.setenv(proxy_guard.BODY_TIMEOUT_ENV, "7.5")
    monkeypatch.delenv(proxy_guard.MAX_BUFFERED_ENV, raising=False)
    (middleware,) = proxy_guard.middlewares()
    assert middleware.cls is ProxyBodyGuard
    assert middleware.kwargs == {"max_body_bytes": 2048, "body_timeout_s": 7.5,
                                 "max_buffered_bytes": proxy_guard.DEFAULT_MAX_BUFFERED_BYTES}
    monkeypatch.setenv(proxy_guard.MAX_BODY_ENV, "lots")
    with pytest.raises(ValueError, match="RAYSPEC_PROXY_MAX_BODY_BYTES"):
        proxy_guard.middlewares()


def test_serve_validates_the_callback_and_rayspec_serve_installs_it(monkeypatch):
    """What Serve's proxy does with the variable: imports the callback and checks its answer."""
    from ray.serve._private.http_util import validate_http_proxy_callback_return
    from ray.serve._private.utils import call_function_from_import_path

    assert validate_http_proxy_callback_return(call_function_from_import_path(proxy_guard.PROXY_CALLBACK))
    environ = {}
    assert proxy_guard.unguarded_warning(environ) is not None
    proxy_guard.install_env(environ)
    assert proxy_guard.installed(environ) and proxy_guard.unguarded_warning(environ) is None
    environ = {proxy_guard.CALLBACK_ENV: "mine:callback"}
    proxy_guard.install_env(environ)  # a callback of the user's own is kept
    assert environ[proxy_guard.CALLBACK_ENV] == "mine:callback"
