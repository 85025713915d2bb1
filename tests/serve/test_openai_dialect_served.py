"""vLLM's dialect of the OpenAI routes over HTTP (the parsers and request models without Ray:
tests/unit/test_openai_dialect.py): `structured_outputs`, tool_choice "auto", /tokenize and /detokenize,
`continuous_usage_stats`, the model's path answering as `model`, on one local Ray cluster serving a
tiny random model whose chat template is Hermes-style (its `<tool_call>` marker picks the hermes parser)."""

from __future__ import annotations

import json
import re

import httpx
import openai
import pytest
from pydantic import ValidationError

from conftest import make_tiny_model_dir
from serve_utils import tiny_args

from deployments.config import load_app_args
from deployments.frontend.openai_limits import OpenAIError
from deployments.frontend.openai_requests import ChatCompletionRequest, CompletionRequest
from deployments.frontend.openai_responses import AutoToolCallStream, auto_tool_message
from rayspec.sampling.tool_parsers import ToolCallStreamParser, get_parser, parser_for_template

from openai_dialect_data import AUTH, HERMES_TEMPLATE, KEY, SCHEMA, TOOLS, USER

# ---- over HTTP, on one local Ray cluster ---------------------------------------------------

@pytest.fixture(scope="module")
def hermes_model_dir(tmp_path_factory):
    path = make_tiny_model_dir(tmp_path_factory.mktemp("hermes") / "model")
    (path / "chat_template.jinja").write_text(HERMES_TEMPLATE)
    return path


@pytest.fixture(scope="module")
def server(hermes_model_dir, serve_url):
    from ray_utils import serving

    from deployments.app import build_app

    args = tiny_args(hermes_model_dir, api_key=KEY)
    with serving(("dialect", build_app(args), "/")):
        yield {"url": serve_url, "model_path": str(hermes_model_dir)}


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server["url"] + "/v1", api_key=KEY, max_retries=0, timeout=60)


def post(server, path, body, headers=AUTH):
    return httpx.post(server["url"] + path, json=body, headers=headers, timeout=60)


def test_structured_outputs_over_http(server, client):
    fmt = {"type": "json_schema", "json_schema": {"name": "reply", "schema": SCHEMA}}
    ref = client.chat.completions.create(model="tiny", messages=USER, max_tokens=40, temperature=0,
                                         response_format=fmt)
    new = client.chat.completions.create(model="tiny", messages=USER, max_tokens=40, temperature=0,
                                         extra_body={"structured_outputs": {"json": SCHEMA}})
    value = json.loads(new.choices[0].message.content)
    assert set(value) == {"answer", "ok"} and value["answer"] in ("yes", "no", "maybe") and isinstance(value["ok"], bool)
    assert new.choices[0].message.content == ref.choices[0].message.content  # greedy: the same path
    assert new.choices[0].finish_reason == "stop"
    chunks = list(client.chat.completions.create(model="tiny", messages=USER, max_tokens=40, temperature=0,
                                                 stream=True, extra_body={"structured_outputs": {"json": SCHEMA}}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ref.choices[0].message.content

    choices = ["red", "green", "blue sky"]
    resp = client.completions.create(model="tiny", prompt="Colours:", max_tokens=8, temperature=1.0, n=3, seed=2,
                                     extra_body={"structured_outputs": {"choice": choices}})
    assert all(c.text in choices and c.finish_reason == "stop" for c in resp.choices)
    resp = client.completions.create(model="tiny", prompt="Code:", max_tokens=12, temperature=0,
                                     extra_body={"structured_outputs": {"regex": "[0-9]{3}-[a-z]{2}"}})
    assert re.fullmatch("[0-9]{3}-[a-z]{2}", resp.choices[0].text)

    for body, param in [({"structured_outputs": {"json": SCHEMA}, "response_format": {"type": "json_object"}},
                         "structured_outputs"),
                        ({"structured_outputs": {"regex": "a", "disable_fallback": True}}, "structured_outputs"),
                        ({"structured_outputs": {"regex": "[a-"}}, "structured_outputs")]:
        r = post(server, "/v1/chat/completions", {"model": "tiny", "messages": USER, **body})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and param in error["param"]


def _call_text(name, arguments):
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


def test_tool_choice_auto_parses_the_models_calls(server, client):
    """The output is forced to a Hermes call (structured_outputs choice) to get one from a random
    model; tool_choice auto reads the calls back out of the text, streamed and not."""
    one = "Let me check. " + _call_text("get_weather", {"city": "Oslo"})
    resp = client.chat.completions.create(model="tiny", messages=USER, tools=TOOLS, tool_choice="auto",
                                          max_tokens=80, temperature=0,
                                          extra_body={"structured_outputs": {"choice": [one]}})
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Let me check. "
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_") and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Oslo"}

    two = _call_text("get_weather", {"city": "Oslo"}) + "\n" + _call_text("add", {"a": 1, "b": 2})
    for stream in (False, True):
        kwargs = dict(model="tiny", messages=USER, tools=TOOLS, max_tokens=120, temperature=0,  # auto: the default
                      extra_body={"structured_outputs": {"choice": [two]}})
        if not stream:
            resp = client.chat.completions.create(**kwargs)
            calls, content, reason = resp.choices[0].message.tool_calls, resp.choices[0].message.content, \
                resp.choices[0].finish_reason
        else:
            chunks = list(client.chat.completions.create(stream=True, **kwargs))
            assert chunks[0].choices[0].delta.role == "assistant"
            calls = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
            content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) or None
            reason = chunks[-1].choices[0].finish_reason
            assert [c.index for c in calls] == [0, 1]
        assert reason == "tool_calls" and content is None
        assert [(c.function.name, json.loads(c.function.arguments)) for c in calls] == \
            [("get_weather", {"city": "Oslo"}), ("add", {"a": 1, "b": 2})]


def test_tool_choice_auto_plain_answer_is_the_models_output(server, client):
    """No call in the text: plain content, token for token what the model makes for the same prompt
    (the chat template with the tools, via /tokenize, sent as token ids to /v1/completions)."""
    resp = client.chat.completions.create(model="tiny", messages=USER, tools=TOOLS, tool_choice="auto",
                                          max_tokens=24, temperature=0)
    choice = resp.choices[0]
    assert choice.message.tool_calls is None and choice.finish_reason in ("stop", "length")
    ids = post(server, "/tokenize", {"model": "tiny", "messages": USER, "tools": TOOLS}).json()["tokens"]
    assert len(ids) == resp.usage.prompt_tokens
    ref = client.completions.create(model="tiny", prompt=ids, max_tokens=24, temperature=0)
    assert choice.message.content == ref.choices[0].text and resp.usage.completion_tokens == ref.usage.completion_tokens
    chunks = list(client.chat.completions.create(model="tiny", messages=USER, tools=TOOLS, tool_choice="auto",
                                                 max_tokens=24, temperature=0, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == choice.message.content
    assert chunks[-1].choices[0].finish_reason == choice.finish_reason


def test_tokenize_and_detokenize(server, client):
    text = "The quick brown fox jumps over the lazy dog."
    r = post(server, "/tokenize", {"model": "tiny", "prompt": text})
    assert r.status_code == 200, r.text
    body = r.json()
    assert set(body) >= {"count", "max_model_len", "tokens"} and body["count"] == len(body["tokens"]) > 0
    assert body["max_model_len"] == 1024
    back = post(server, "/detokenize", {"model": "tiny", "tokens": body["tokens"]})
    assert back.status_code == 200 and back.json() == {"prompt": text}
    resp = client.completions.create(model="tiny", prompt=text, max_tokens=1, temperature=0)
    assert resp.usage.prompt_tokens == body["count"]
    # chat messages: the chat template's tokens, with and without the generation prompt
    chat = post(server, "/tokenize", {"model": "tiny", "messages": USER}).json()
    resp = client.chat.completions.create(model="tiny", messages=USER, max_tokens=1, temperature=0)
    assert chat["count"] == resp.usage.prompt_tokens
    bare = post(server, "/tokenize", {"model": "tiny", "messages": USER, "add_generation_prompt": False}).json()
    assert bare["tokens"] == chat["tokens"][:bare["count"]] and bare["count"] < chat["count"]
    rendered = post(server, "/detokenize", {"model": "tiny", "tokens": chat["tokens"]}).json()["prompt"]
    assert rendered.endswith("<|im_start|>assistant\n") and USER[0]["content"] in rendered

    for path, request, status, param in [
            ("/tokenize", {"model": "nope", "prompt": "hi"}, 404, "model"),
            ("/detokenize", {"model": "nope", "tokens": [1]}, 404, "model"),
            ("/tokenize", {"model": "tiny", "prompt": ""}, 400, "prompt"),
            ("/tokenize", {"model": "tiny"}, 400, "prompt"),
            ("/tokenize", {"model": "tiny", "prompt": "hi", "messages": USER}, 400, "prompt"),
            ("/tokenize", {"model": "tiny", "messages": []}, 400, "messages"),
            ("/detokenize", {"model": "tiny", "tokens": []}, 400, "tokens"),
            ("/detokenize", {"model": "tiny", "tokens": [1, 10 ** 6]}, 400, None),
            ("/detokenize", {"model": "tiny", "tokens": [-1]}, 400, None),
            ("/detokenize", {"model": "tiny", "tokens": ["a"]}, 400, "tokens")]:
        r = post(server, path, request)
        assert r.status_code == status, (path, request, r.text)
        error = r.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["message"]
        if param is not None:
            assert param in (error["param"] or ""), (request, error)
    # the API key rule of the other routes
    for path, request in [("/tokenize", {"model": "tiny", "prompt": "hi"}), ("/detokenize", {"model": "tiny",
                                                                                          "tokens": [1]})]:
        r = post(server, path, request, headers={})
        assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"


def test_continuous_usage_stats(client):
    full = client.chat.completions.create(model="tiny", messages=USER, max_tokens=16, temperature=0)
    chunks = list(client.chat.completions.create(model="tiny", messages=USER, max_tokens=16, temperature=0,
                                                 stream=True, stream_options={"continuous_usage_stats": True}))
    assert chunks and all(c.usage is not None for c in chunks)
    assert all(c.usage.prompt_tokens == full.usage.prompt_tokens for c in chunks)
    assert all(c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens for c in chunks)
    done = [c.usage.completion_tokens for c in chunks]
    assert done[0] == 0 and done == sorted(done) and done[-1] == full.usage.completion_tokens
    # completions, with include_usage too: the usage-only chunk at the end as well
    chunks = list(client.completions.create(model="tiny", prompt="one two three", max_tokens=12, temperature=0,
                                            stream=True, stream_options={"include_usage": True,
                                                                         "continuous_usage_stats": True}))
    assert all(c.usage is not None for c in chunks) and chunks[-1].choices == []
    assert chunks[-2].usage.completion_tokens == chunks[-1].usage.completion_tokens > 0


def test_model_path_answers_as_model(server, client):
    [listed] = client.models.list().data
    assert listed.id == "tiny" and listed.model_extra["root"] == server["model_path"]
    by_path = client.completions.create(model=server["model_path"], prompt="one two", max_tokens=4, temperature=0)
    by_name = client.completions.create(model="tiny", prompt="one two", max_tokens=4, temperature=0)
    assert by_path.choices[0].text == by_name.choices[0].text and by_path.model == "tiny"
    chat = client.chat.completions.create(model=server["model_path"], messages=USER, max_tokens=2)
    assert chat.choices[0].message.content is not None
    assert post(server, "/tokenize", {"model": server["model_path"], "prompt": "hi"}).status_code == 200
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="something-else", prompt="hi", max_tokens=2)
