"""The ingress's bounds before any parsing (deployments.frontend.admission), on a small FastAPI app with the
same middlewares (no Ray): a body past max_request_body_bytes is a 413 with OpenAI error JSON
whether its length is declared or not, and is not read past the limit; /tokenize and /detokenize
take a place in the admission gate, in a lane of their own; one client past its share gets 429s
while others get in; the ingress app stacks the middlewares key -> gate -> body limit."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from fastapi import FastAPI
from pydantic import BaseModel

from deployments.frontend.admission import AdmissionGate, AdmissionState, BodyLimit, body_routes

LIMIT = 4096


class Body(BaseModel):
    prompt: str


def _app(state: AdmissionState, seen: list):
    app = FastAPI()

    async def handle(body: Body):
        seen.append(len(body.prompt))
        return {"ok": True}

    for path in ("/v1/completions", "/tokenize", "/detokenize"):
        app.post(path)(handle)

    @app.get("/health")
    async def health():
        return {"ok": True}

    app.add_middleware(BodyLimit, max_bytes=lambda: LIMIT, takes_body=body_routes(), timeout_s=lambda: 0.3)
    app.add_middleware(AdmissionGate, state=lambda: state)
    return app


def _post(app, path: str, **kwargs) -> httpx.Response:
    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
            return await client.post(path, **kwargs)
    return asyncio.run(go())


def _assert_413(r: httpx.Response) -> None:
    assert r.status_code == 413, r.text
    error = r.json()["error"]
    assert error["code"] == "request_too_large" and error["type"] == "invalid_request_error"
    assert str(LIMIT) in error["message"]


def test_a_body_past_the_limit_is_a_413_before_parsing():
    seen = []
    app = _app(AdmissionState(max_in_flight=8), seen)
    ok = _post(app, "/v1/completions", json={"prompt": "x" * (LIMIT - 100)})
    assert ok.status_code == 200 and seen == [LIMIT - 100]
    _assert_413(_post(app, "/v1/completions", json={"prompt": "x" * LIMIT}))  # declared: Content-Length
    _assert_413(_post(app, "/tokenize", content=b"{", headers={"content-length": "99999999999"}))
    _assert_413(_post(app, "/tokenize", content=b"{}", headers={"content-length": "-1"}))  # not a length

    pulled = []

    async def chunks():  # no Content-Length: counted as it comes, and no more is read past the limit
        for i in range(1000):
            pulled.append(i)
            yield b" " * 1024

    _assert_413(_post(app, "/v1/completions", content=chunks()))
    assert len(pulled) <= LIMIT // 1024 + 2
    assert seen == [LIMIT - 100]  # nothing refused reached the route


def test_a_body_within_the_limit_arrives_whole_in_chunks():
    seen = []
    app = _app(AdmissionState(max_in_flight=8), seen)

    async def chunks():
        yield b'{"prompt": "'
        for _ in range(30):
            yield b"y" * 100
        yield b'"}'

    r = _post(app, "/detokenize", content=chunks(), headers={"content-type": "application/json"})
    assert r.status_code == 200 and seen == [3000]


@pytest.mark.parametrize("path", ["/tokenize", "/detokenize", "/v1/completions"])
def test_tokenizer_routes_are_behind_the_admission_gate(path):
    state = AdmissionState(max_in_flight=1, max_tokenizer_in_flight=1)
    state.in_flight = state.tokenizer_in_flight = 1  # the one place of each lane is taken
    r = _post(_app(state, []), path, json={"prompt": "hi"})
    assert r.status_code == 429 and r.json()["error"]["code"] == "server_overloaded"
    assert state.num_refused == 1


def test_tokenizer_routes_have_a_lane_of_their_own():
    """A flood of /tokenize cannot take generation's places, nor generation the tokenizer's."""
    state = AdmissionState(max_in_flight=1, max_tokenizer_in_flight=1)
    app = _app(state, [])
    state.tokenizer_in_flight = 1
    assert _post(app, "/tokenize", json={"prompt": "hi"}).status_code == 429
    assert _post(app, "/v1/completions", json={"prompt": "hi"}).status_code == 200
    state.tokenizer_in_flight, state.in_flight = 0, 1
    assert _post(app, "/v1/completions", json={"prompt": "hi"}).status_code == 429
    assert _post(app, "/detokenize", json={"prompt": "hi"}).status_code == 200
    assert state.num_refused == 2 and state.num_refused_per_client == 0


def _blocking_app(state: AdmissionState, release: asyncio.Event, entered: list):
    app = FastAPI()

    @app.post("/v1/completions")
    async def handle(body: Body):
        entered.append(body.prompt)
        await release.wait()
        return {"ok": True}

    app.add_middleware(AdmissionGate, state=lambda: state)
    return app


@pytest.mark.parametrize("header", [None, "x-forwarded-for"])
def test_one_client_past_its_share_gets_429s_while_others_get_in(header):
    """Client A holds its 2 places: its third request is refused at once; B, from another address
    (or, behind a trusted proxy, another X-Forwarded-For), still gets in; A's requests are served
    in full once released, and the gate's table empties."""
    state = AdmissionState(max_in_flight=8, max_per_client=2, client_header=header)
    release, entered = asyncio.Event(), []
    app = _blocking_app(state, release, entered)

    def client(name: str):
        if header:  # one peer (the proxy), clients told apart by the header
            # (what a client writes comes first; the trusted proxy appends the address it saw)
            return httpx.AsyncClient(transport=httpx.ASGITransport(app=app, client=("10.0.0.9", 1)),
                                     base_url="http://t", headers={header: f"forged-{name}, {name}"})
        return httpx.AsyncClient(transport=httpx.ASGITransport(app=app, client=(name, 1)), base_url="http://t")

    async def go():
        async with client("10.0.0.1") as a, client("10.0.0.2") as b:
            held = [asyncio.create_task(a.post("/v1/completions", json={"prompt": f"a{i}"})) for i in range(2)]
            while len(entered) < 2:
                await asyncio.sleep(0.01)
            third = await a.post("/v1/completions", json={"prompt": "a2"})
            other = asyncio.create_task(b.post("/v1/completions", json={"prompt": "b0"}))
            while len(entered) < 3:
                await asyncio.sleep(0.01)
            assert state.in_flight == 3 and len(state.per_client) == 2
            release.set()
            return third, [await t for t in held], await other

    third, held, other = asyncio.run(go())
    assert third.status_code == 429 and "per client" in third.json()["error"]["message"]
    assert [r.status_code for r in held] == [200, 200] and other.status_code == 200
    assert sorted(entered) == ["a0", "a1", "b0"]
    assert state.num_refused == state.num_refused_per_client == 1
    assert state.in_flight == 0 and not state.per_client


def test_the_ingress_stacks_key_then_gate_then_body_limit():
    from deployments.frontend.admission import BodyLimit as Limit
    from deployments.frontend.api_key import RequireApiKey
    from deployments.frontend.ingress import app

    order = [m.cls for m in app.user_middleware]  # outermost first
    assert order == [RequireApiKey, AdmissionGate, Limit]


def test_shipped_configs_bind_loopback_unless_they_opt_in():
    """Every shipped serve config binds 127.0.0.1, except the cluster app (its proxy must be
    reachable from the cluster's load balancer: an explicit opt-in), and `rayspec serve` without a
    host does too; binding elsewhere without an API key is warned about."""
    import yaml

    from deployments.frontend.api_key import exposure_warning
    from rayspec.assets import configs_dir

    opted_in = {"cluster_eagle3.yaml"}
    hosts = {}
    for path in sorted(configs_dir().glob("*.yaml")):
        doc = yaml.safe_load(path.read_text()) or {}
        if isinstance(doc, dict) and "applications" in doc:
            hosts[path.name] = (doc.get("http_options") or {}).get("host")
    assert len(hosts) >= 15
    assert {name for name, host in hosts.items() if host != "127.0.0.1"} == opted_in, hosts
    assert exposure_warning("127.0.0.1", False) is None and exposure_warning("::1", False) is None
    assert "without an API key" in exposure_warning("0.0.0.0", False)
    assert "without an API key" in exposure_warning("my-host.example", False)
    assert exposure_warning("0.0.0.0", True) is None


def test_rayspec_serve_binds_loopback_by_default(monkeypatch):
    from rayspec_cli.main import build_parser
    from rayspec_cli.serve import serve_config

    monkeypatch.delenv("RAYSPEC_API_KEY", raising=False)
    _, host, _ = serve_config(build_parser().parse_args(["serve", "smollm2-135m-instruct"]))
    assert host == "127.0.0.1"


# ---- hardening, third round (issue #51) -------------------------------------------------------

async def _raw(app, method: str, path: str, chunks: list[bytes], gap_s: float = 0.0, hang: bool = False,
               headers=(), client=("127.0.0.1", 1)):
    """An ASGI request whose body comes in `chunks`, `gap_s` apart (with `hang`, the body never
    ends: after the chunks the client sends nothing more); returns (status, body, number of
    receive() calls the app made)."""
    calls, sent = [0], []

    async def receive():
        calls[0] += 1
        if calls[0] > len(chunks):
            await asyncio.sleep(3600)  # a client that never sends the rest (or gone: never asked here)
        if calls[0] > 1 and gap_s:
            await asyncio.sleep(gap_s)
        return {"type": "http.request", "body": chunks[calls[0] - 1], "more_body": hang or calls[0] < len(chunks)}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": method, "path": path, "root_path": "", "query_string": b"",
             "headers": [(b"transfer-encoding", b"chunked"), (b"content-type", b"application/json"), *headers],
             "client": client, "server": ("t", 80),
             "scheme": "http", "http_version": "1.1", "asgi": {"version": "3.0"}}
    await asyncio.wait_for(app(scope, receive, send), 10)
    status = next(m["status"] for m in sent if m["type"] == "http.response.start")
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return status, body, calls[0]


def test_only_the_routes_that_take_a_body_have_it_read():
    """POST /health (a GET route) and a POST to no route are answered 405 / 404 without a byte of
    their bodies read: a client sending a byte now and then cannot hold the ingress there (issue
    #51: ~100 keyless `POST /health` bodies stalled every other request)."""
    app = _app(AdmissionState(max_in_flight=8), [])
    status, _, calls = asyncio.run(_raw(app, "POST", "/health", [b"{"]))
    assert status == 405 and calls == 0
    status, _, calls = asyncio.run(_raw(app, "POST", "/nowhere", [b"{"]))
    assert status == 404 and calls == 0
    status, _, calls = asyncio.run(_raw(app, "POST", "/tokenize", [b'{"prompt": "hi"}']))
    assert status == 200 and calls >= 1  # (a body route's body is read)


def test_a_body_not_whole_within_its_deadline_is_a_408():
    """A body trickling in (or stopping half way) is cut at body_timeout_s with OpenAI's error JSON."""
    import json
    import time

    app = _app(AdmissionState(max_in_flight=8), [])
    started = time.monotonic()
    status, body, _ = asyncio.run(_raw(app, "POST", "/v1/completions", [b'{"prompt": ', b'"x"'], hang=True))
    assert status == 408 and time.monotonic() - started < 3
    assert json.loads(body)["error"]["code"] == "request_timeout"
    status, body, _ = asyncio.run(_raw(app, "POST", "/v1/completions", [b'{"pro', b'mpt": ', b'"x"}'], gap_s=0.2))
    assert status == 408  # 0.4 s in all past its 0.3 s: the deadline is the whole body's, not per chunk


def _keyed(expected, remote_allowed=lambda: False):
    from deployments.frontend.api_key import RequireApiKey

    inner = FastAPI()

    @inner.get("/health")
    async def health():
        return {"ok": True}

    @inner.post("/v1/completions")
    async def completions(body: Body):
        return {"ok": True}

    inner.add_middleware(RequireApiKey, expected=expected, remote_allowed=remote_allowed)
    return inner


def test_only_a_readiness_probe_passes_without_the_key():
    from deployments.frontend.api_key import key_digest

    app = _keyed(lambda: key_digest("k"))
    assert asyncio.run(_raw(app, "GET", "/health", []))[0] == 200
    status, _, calls = asyncio.run(_raw(app, "POST", "/health", [b"{"]))
    assert status == 401 and calls == 0  # refused before its body is read
    assert asyncio.run(_raw(app, "POST", "/v1/completions", [b"{"]))[0] == 401


def test_without_a_key_only_this_machine_is_served_unless_the_config_opts_in():
    """Fail closed: no key configured, a peer outside loopback gets a 403 naming the fix (binding
    0.0.0.0 by mistake serves nobody else); allow_unauthenticated lets it in; probes pass."""
    import json

    app = _keyed(lambda: None)
    body = [b'{"prompt": "hi"}']
    assert asyncio.run(_raw(app, "POST", "/v1/completions", body, client=("127.0.0.1", 5)))[0] == 200
    assert asyncio.run(_raw(app, "POST", "/v1/completions", body, client=("::1", 5)))[0] == 200
    status, text, calls = asyncio.run(_raw(app, "POST", "/v1/completions", body, client=("10.1.2.3", 5)))
    assert status == 403 and calls == 0 and "allow_unauthenticated" in json.loads(text)["error"]["message"]
    assert asyncio.run(_raw(app, "GET", "/health", [], client=("10.1.2.3", 5)))[0] == 200
    opened = _keyed(lambda: None, remote_allowed=lambda: True)
    assert asyncio.run(_raw(opened, "POST", "/v1/completions", body, client=("10.1.2.3", 5)))[0] == 200


def test_the_client_behind_a_proxy_is_the_last_forwarded_address():
    """X-Forwarded-For's entries before the last are whatever the client wrote; the trusted proxy
    appends the address it saw. A client forging the first entry stays itself."""
    from deployments.frontend.admission import client_of

    scope = {"headers": [(b"x-forwarded-for", b"1.1.1.1, 203.0.113.7")], "client": ("10.0.0.9", 1)}
    assert client_of(scope, "x-forwarded-for") == "h:203.0.113.7"
    forged = {"headers": [(b"x-forwarded-for", b"9.9.9.9, 203.0.113.7")], "client": ("10.0.0.9", 1)}
    assert client_of(forged, "x-forwarded-for") == client_of(scope, "x-forwarded-for")
    assert client_of({"headers": [], "client": ("10.0.0.9", 1)}, "x-forwarded-for") == "a:10.0.0.9"


def test_rayspec_serve_refuses_to_expose_without_a_key(monkeypatch, tmp_path, capsys):
    """Binding beyond loopback without a key refuses to start (exit 2, before Ray starts) unless
    --allow-unauthenticated; --api-key-file reads the key (not visible in process listings)."""
    from rayspec_cli.main import build_parser
    from rayspec_cli.serve import cmd_serve, serve_config

    monkeypatch.delenv("RAYSPEC_API_KEY", raising=False)
    parse = build_parser().parse_args
    assert cmd_serve(parse(["serve", "smollm2-135m-instruct", "--host", "0.0.0.0"])) == 2
    assert "allow-unauthenticated" in capsys.readouterr().err
    key = tmp_path / "key"
    key.write_text("s3cret\n")
    cfg, host, _ = serve_config(parse(["serve", "smollm2-135m-instruct", "--host", "0.0.0.0", "--api-key-file", str(key)]))
    assert host == "0.0.0.0" and cfg.api_key.get_secret_value() == "s3cret"
    cfg, _, _ = serve_config(parse(["serve", "smollm2-135m-instruct", "--host", "0.0.0.0", "--allow-unauthenticated"]))
    assert cfg.allow_unauthenticated and cfg.api_key is None


def test_shipped_configs_bound_requests_and_keep_the_dashboard_local():
    """Every shipped serve config sets Serve's end-to-end request deadline; the cluster launcher
    starts the Ray dashboard (job submission: code execution) on the head's loopback only."""
    import yaml

    from rayspec.assets import configs_dir

    for path in sorted(configs_dir().glob("*.yaml")):
        doc = yaml.safe_load(path.read_text()) or {}
        if isinstance(doc, dict) and "applications" in doc:
            assert (doc.get("http_options") or {}).get("request_timeout_s"), path.name
    launcher = (configs_dir() / "cluster.yaml").read_text()
    assert "--dashboard-host=127.0.0.1" in launcher and "dashboard-host=0.0.0.0" not in launcher


def test_the_body_routes_are_the_ingress_post_routes():
    """BodyLimit reads bodies on the routes body_routes declares: exactly the ingress's POST routes
    (a new POST route must be declared, or its body would go to FastAPI unbounded)."""
    import re
    from pathlib import Path

    import deployments.frontend.ingress as ingress
    from deployments.frontend.admission import GATED_PATHS

    posts = set(re.findall(r'@app\.post\("([^"]+)"', Path(ingress.__file__).read_text()))
    assert posts and posts == set(GATED_PATHS), posts
    takes = body_routes()
    assert all(takes("POST", p) for p in posts) and not takes("GET", "/v1/completions") and not takes("POST", "/health")
