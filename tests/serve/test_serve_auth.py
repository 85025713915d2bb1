"""API keys on the OpenAI ingress (deployments.frontend.api_key), on a real local Ray cluster (tiny model).

Every route but /health answers 401 with OpenAI's error JSON (`invalid_api_key`) and a
`WWW-Authenticate: Bearer` header without the key or with another one, over raw HTTP and through
the official client (openai.AuthenticationError); with the key, everything works as without one,
streams included. The app is served under a route prefix, as Serve mounts it in production.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import openai
import pytest
import ray
from ray_utils import serving
from serve_utils import tiny_args

from deployments.app import build_app

KEY = "sk-test-5b0e8c2d4f1a"
PREFIX = "/keyed"
ROUTES = [("GET", "/v1/models", None), ("GET", "/v1/stats", None),
          ("POST", "/v1/completions", {"model": "tiny", "prompt": "one two one two", "max_tokens": 4,
                                       "temperature": 0}),
          ("POST", "/v1/chat/completions", {"model": "tiny", "max_tokens": 4, "temperature": 0,
                                            "messages": [{"role": "user", "content": "hi"}]}),
          ("GET", "/v1/no-such-route", None),  # anything else under /v1 too
          ("GET", "/openapi.json", None), ("GET", "/docs", None)]  # and FastAPI's own pages


@pytest.fixture(scope="module")
def server(tiny_model_dir, serve_url):
    with serving(("keyed", build_app(tiny_args(tiny_model_dir, api_key=KEY)), PREFIX)):
        yield f"{serve_url}{PREFIX}"


def _send(url: str, method: str, path: str, body, headers: dict) -> httpx.Response:
    return httpx.request(method, url + path, json=body, headers=headers, timeout=60)


def _assert_401(resp: httpx.Response) -> None:
    assert resp.status_code == 401, (resp.status_code, resp.text)
    assert resp.headers["www-authenticate"] == "Bearer"
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", None, "invalid_api_key")
    assert KEY not in resp.text


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer sk-wrong"}, {"Authorization": KEY},
                                     {"Authorization": f"Basic {KEY}"}, {"Authorization": "Bearer"}],
                         ids=["none", "wrong", "no-scheme", "basic", "empty"])
def test_every_route_but_health_wants_the_key(server, headers):
    for method, path, body in ROUTES:
        _assert_401(_send(server, method, path, body, headers))
    assert _send(server, "GET", "/health", None, headers).status_code == 200


def test_the_key_opens_every_route(server):
    auth = {"Authorization": f"Bearer {KEY}"}
    for method, path, body in ROUTES:
        resp = _send(server, method, path, body, auth)
        assert resp.status_code == (404 if path == "/v1/no-such-route" else 200), (path, resp.text)
    assert _send(server, "GET", "/v1/models", None, {"authorization": f"bearer {KEY}"}).status_code == 200
    with httpx.stream("POST", server + "/v1/completions", headers=auth, timeout=60,
                      json={"model": "tiny", "prompt": "one two", "max_tokens": 4, "stream": True}) as resp:
        assert resp.status_code == 200
        events = [line for line in resp.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]" and json.loads(events[0][6:])["object"] == "text_completion"


def test_official_client(server):
    calls = [lambda c: c.models.list(),
             lambda c: c.completions.create(model="tiny", prompt="one two one two", max_tokens=4, temperature=0),
             lambda c: c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=4, temperature=0)]
    for key in ("sk-wrong", "x"):
        client = openai.OpenAI(base_url=server + "/v1", api_key=key, max_retries=0, timeout=60)
        for call in calls:
            with pytest.raises(openai.AuthenticationError) as info:
                call(client)
            assert info.value.status_code == 401 and info.value.code == "invalid_api_key"
    client = openai.OpenAI(base_url=server + "/v1", api_key=KEY, max_retries=0, timeout=60)
    assert [m.id for m in calls[0](client).data] == ["tiny"]
    assert calls[1](client).usage.completion_tokens == 4
    assert calls[2](client).choices[0].message.role == "assistant"
    chunks = list(client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=4, temperature=0, stream=True))
    assert chunks[-1].choices[0].finish_reason is not None


def test_bench_serve_sends_the_key(server, tmp_path, monkeypatch, capsys):
    """`rayspec bench serve --api-key`, or $RAYSPEC_API_KEY, against the keyed server."""
    from rayspec_cli.main import main

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"turns": ["one two one two"]}) + "\n")
    out = tmp_path / "res.json"
    common = ["bench", "serve", "--endpoint", server, "--model", "tiny", "--prompts", str(prompts),
              "--max-tokens", "4", "--concurrency", "1", "--warmup", "0", "--output-json", str(out)]
    monkeypatch.delenv("RAYSPEC_API_KEY", raising=False)
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    assert main(common) == 1  # no key: every request refused
    assert "401" in json.dumps(json.loads(out.read_text())["results"][0]["errors"])
    assert main(common + ["--api-key", KEY]) == 0
    result = json.loads(out.read_text())
    assert result["results"][0]["completed"] == 1 and KEY not in out.read_text()
    monkeypatch.setenv("RAYSPEC_API_KEY", KEY)
    assert main(common) == 0
    capsys.readouterr()


def test_the_key_is_not_in_the_logs(server):
    """Every Ray and Serve log of the session (replicas, proxy, controller), after the tests above."""
    session = Path(ray._private.worker._global_node.get_session_dir_path())
    for path in (session / "logs").rglob("*"):
        if path.is_file():
            assert KEY.encode() not in path.read_bytes(), path


def test_key_from_the_environment(monkeypatch):
    from pydantic import SecretStr

    from deployments.config import load_app_args, resolve_api_key

    monkeypatch.delenv("RAYSPEC_API_KEY", raising=False)
    assert resolve_api_key(None) is None
    monkeypatch.setenv("RAYSPEC_API_KEY", "from-env")
    assert resolve_api_key(None).get_secret_value() == "from-env"
    assert resolve_api_key("from-args").get_secret_value() == "from-args"  # the args win
    cfg = load_app_args({"api_key": "sekrit-k3y"})
    assert isinstance(cfg.api_key, SecretStr) and "sekrit" not in repr(cfg) and "sekrit" not in str(cfg.api_key)
    assert "api_key" not in cfg.model_dump(mode="json", exclude={"api_key"})
    with pytest.raises(ValueError):
        load_app_args({"api_key": " "})
