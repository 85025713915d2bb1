"""vLLM's dialect of the OpenAI routes: `structured_outputs`, tool_choice "auto" (calls parsed out of
the model's own text, per model family), /tokenize and /detokenize, `continuous_usage_stats`, the
model's path answering as `model`. Parsers and request models without Ray; the routes on one local
Ray cluster serving a tiny random model whose chat template is Hermes-style (its `<tool_call>`
marker picks the hermes parser)."""

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

KEY = "dialect-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
HERMES_TEMPLATE = """{%- if tools %}<|im_start|>system
You may call these tools:
<tools>
{%- for t in tools %}
{{ t | tojson }}
{%- endfor %}
</tools>
To call one, answer <tool_call>{"name": <name>, "arguments": <args>}</tool_call><|im_end|>
{% endif %}
{%- for m in messages %}<|im_start|>{{ m.role }}
{{ m.content or "" }}
{%- for c in m.tool_calls or [] %}<tool_call>{{ {"name": c.function.name, "arguments": c.function.arguments} | tojson }}</tool_call>{%- endfor %}<|im_end|>
{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
    {"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {
        "a": {"type": "integer"}, "b": {"type": "integer"}}}}}]
SCHEMA = {"type": "object", "additionalProperties": False, "required": ["answer", "ok"],
          "properties": {"answer": {"enum": ["yes", "no", "maybe"]}, "ok": {"type": "boolean"}}}
USER = [{"role": "user", "content": "What is the weather in Oslo?"}]

# ---- parsers, without Ray -------------------------------------------------------------------

# (parser, text, expected content, expected calls as (name, arguments dict))
CASES = [
    ("hermes", '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>',
     None, [("get_weather", {"city": "Oslo"})]),
    ("hermes", 'Let me look. <tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>\n'
               '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>',
     "Let me look. ", [("get_weather", {"city": "Oslo"}), ("add", {"a": 1, "b": 2})]),
    ("hermes", '<tool_call>{"name": "add", "arguments": {"a": 1}}', None, [("add", {"a": 1})]),  # EOS before the tag
    ("hermes", "It is sunny in Oslo. 3 < 4 and <tool is not a tag.", "It is sunny in Oslo. 3 < 4 and <tool is not a tag.",
     []),
    ("hermes", '<tool_call>{"name": "add", "arguments": {"a": 1</tool_call>', None, None),  # malformed: plain
    ("hermes", '<tool_call>{"arguments": {}}</tool_call>', None, None),  # no name: plain
    ("llama3_json", '{"name": "get_weather", "parameters": {"city": "Oslo"}}', None, [("get_weather", {"city": "Oslo"})]),
    ("llama3_json", '<|python_tag|>{"name": "add", "parameters": {"a": 1}}; {"name": "get_weather", "parameters": {}}',
     None, [("add", {"a": 1}), ("get_weather", {})]),
    ("llama3_json", 'The answer: <|python_tag|>{"name": "add", "arguments": {"a": 2}}', "The answer: ",
     [("add", {"a": 2})]),
    ("llama3_json", "Oslo is in Norway.", "Oslo is in Norway.", []),
    ("llama3_json", '{"name": "add", "parameters": {"a": 1}} and more words', None, None),
    ("llama3_json", '{"name": "add", "parameters": {"a": ', None, None),  # cut by max_tokens
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Oslo"}}, '
                '{"name": "add", "arguments": "{\\"a\\": 1}"}]', None,
     [("get_weather", {"city": "Oslo"}), ("add", {"a": 1})]),
    ("mistral", 'Sure.[TOOL_CALLS][{"name": "add", "arguments": {}}]', "Sure.", [("add", {})]),
    ("mistral", '[{"name": "add", "arguments": {"b": 3}}]', None, [("add", {"b": 3})]),  # marker decoded away
    ("mistral", "[1] A citation, not a call.", "[1] A citation, not a call.", []),
    ("mistral", "[TOOL_CALLS][{\"name\": \"add\", \"arguments\": {oops}}]", None, None),
]


def _expected_content(text, content, calls):
    return text if not calls else content  # no calls (or malformed ones): the whole text is content


@pytest.mark.parametrize("name,text,content,calls", CASES)
def test_parser_non_streamed(name, text, content, calls):
    parsed = get_parser(name).parse(text)
    assert parsed.content == _expected_content(text, content, calls)
    assert [(n, json.loads(a)) for n, a in parsed.calls] == (calls or [])
    message, reason = auto_tool_message(text, get_parser(name), "stop")
    if calls:
        assert reason == "tool_calls" and message["content"] == content
        assert [c["function"]["name"] for c in message["tool_calls"]] == [n for n, _ in calls]
        assert all(c["type"] == "function" and c["id"].startswith("call_") and isinstance(c["function"]["arguments"], str)
                   for c in message["tool_calls"])
    else:
        assert message == {"role": "assistant", "content": text} and reason == "stop"


@pytest.mark.parametrize("step", [1, 3, 7])
@pytest.mark.parametrize("name,text,content,calls", CASES)
def test_parser_streamed_incrementally(name, text, content, calls, step):
    """Fed in pieces: the content sent adds up to the non-streamed content, the calls come at the end
    and equal the non-streamed ones; nothing that may start a marker goes out as content."""
    parser = get_parser(name)
    stream = ToolCallStreamParser(parser)
    sent = ""
    for i in range(0, len(text), step):
        piece, got = stream.feed(text[i:i + step], finished=False)
        assert got == []
        sent += piece
        assert not any(m in sent for m in parser.markers) or not calls
    piece, got = stream.feed("", finished=True)
    sent += piece
    assert (sent or None) == _expected_content(text, content, calls)
    assert got == parser.parse(text).calls
    if calls and content:  # the text ahead of a call goes out before the output ends
        early = ToolCallStreamParser(parser)
        assert early.feed(text, finished=False)[0] == content


def test_held_back_marker_prefix_and_stream_deltas():
    stream = ToolCallStreamParser(get_parser("hermes"))
    assert stream.feed("Hello <tool", False) == ("Hello ", [])  # "<tool" may begin <tool_call>
    assert stream.feed("s are nice", False) == ("<tools are nice", [])  # it did not
    llama = ToolCallStreamParser(get_parser("llama3_json"))
    assert llama.feed("  ", False) == ("", [])  # a call may still come first
    assert llama.feed("Hi", False) == ("  Hi", [])
    auto = AutoToolCallStream(get_parser("hermes"))
    assert auto.delta("Checking. <tool_", False, None) == ({"content": "Checking. "}, None)
    assert auto.delta('call>{"name": "add", "arguments": {}}</tool_call>', False, None) == ({}, None)
    delta, reason = auto.delta("", True, "stop")
    assert reason == "tool_calls" and "content" not in delta
    [entry] = delta["tool_calls"]
    assert entry["index"] == 0 and entry["id"].startswith("call_") and entry["function"] == {"name": "add",
                                                                                              "arguments": "{}"}
    plain = AutoToolCallStream(get_parser("hermes"))
    plain.delta("no call", False, None)
    assert plain.delta("", True, "length") == ({}, "length")


def test_parser_from_template_or_app_arg():
    assert parser_for_template(HERMES_TEMPLATE) == "hermes"
    assert parser_for_template("{{ '[TOOL_CALLS]' }}{% for t in tools %}{% endfor %}") == "mistral"
    assert parser_for_template("<|start_header_id|>{% if tools %}{{ '<|python_tag|>' }}{% endif %}") == "llama3_json"
    assert parser_for_template("<|start_header_id|>{% if tools is not none %}{% endif %}") == "llama3_json"
    # SmolLM2's: no place for tools, rayspec describes them and asks for a JSON list of calls
    assert parser_for_template("{% for m in messages %}<|im_start|>{{ m.content }}{% endfor %}") == "json_list"
    assert parser_for_template("{% for t in tools %}<call>{% endfor %}") is None  # renders tools, format unknown
    assert load_app_args({"tool_call_parser": "mistral"}).tool_call_parser == "mistral"
    assert load_app_args({}).tool_call_parser is None
    with pytest.raises(ValidationError):
        load_app_args({"tool_call_parser": "xml"})


def test_ingress_picks_the_app_arg_over_the_template(tiny_model_dir):
    """The ingress asks the verifier once for the template's parser; the app arg wins over it; with
    neither, tool_choice auto is a 400 that names tool_call_parser."""
    import asyncio

    import deployments.frontend.ingress as ingress_module

    class _Verifier:
        def __init__(self, found):
            self.asked, outer = 0, self

            class _ModelInfo:
                def remote(self):
                    outer.asked += 1

                    async def info():
                        return {"tool_call_parser": found}
                    return info()
            self.model_info = _ModelInfo()

    ours = ingress_module.OpenAIIngress.func_or_class.__bases__[0]  # serve.ingress wraps our class

    def parser(found, **args):
        ingress, verifier = object.__new__(ours), _Verifier(found)
        ours.__init__(ingress, tiny_args(tiny_model_dir, **args), verifier)
        names = [asyncio.run(ingress._tool_parser()).name for _ in range(2)]
        return names, verifier.asked

    assert parser("hermes") == (["hermes", "hermes"], 1)
    assert parser("hermes", tool_call_parser="mistral") == (["mistral", "mistral"], 0)
    with pytest.raises(OpenAIError) as err:
        parser(None)
    assert err.value.status_code == 400 and err.value.param == "tool_choice" and "tool_call_parser" in err.value.message


def test_structured_outputs_maps_onto_the_same_constraint():
    """Each structured_outputs key gives the request exactly what the older field gives."""
    pairs = [({"json": SCHEMA}, {"response_format": {"type": "json_schema", "json_schema": {"schema": SCHEMA}}}),
             ({"json": SCHEMA}, {"guided_json": SCHEMA}),
             ({"json_object": True}, {"response_format": {"type": "json_object"}}),
             ({"regex": "[0-9]+"}, {"guided_regex": "[0-9]+"}),
             ({"choice": ["a", "b"]}, {"guided_choice": ["a", "b"]}),
             ({"grammar": 'start: "x" | "y"'}, {"guided_grammar": 'start: "x" | "y"'})]
    for new, old in pairs:
        for cls, body in ((CompletionRequest, {"prompt": "hi"}), (ChatCompletionRequest, {"messages": USER})):
            a = cls(model="m", structured_outputs=new, **body).to_generate(1024)[0]
            b = cls(model="m", **old, **body).to_generate(1024)[0]
            assert a.structured == b.structured and a.structured is not None
    for bad, param in [({"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}},
                        "structured_outputs"),
                       ({"structured_outputs": {"regex": "a"}, "guided_choice": ["x"]}, "structured_outputs"),
                       ({"structured_outputs": {"regex": "a", "choice": ["x"]}}, "structured_outputs"),
                       ({"structured_outputs": {}}, "structured_outputs"),
                       ({"structured_outputs": {"json_object": False}}, "structured_outputs"),
                       ({"structured_outputs": {"choice": []}}, "structured_outputs"),
                       ({"structured_outputs": {"json": "{not json"}}, "structured_outputs")]:
        with pytest.raises(OpenAIError) as err:
            CompletionRequest(model="m", prompt="hi", **bad).to_generate(1024)
        assert err.value.status_code == 400 and err.value.param == param, bad
    with pytest.raises(ValidationError):  # unknown keys are refused, never ignored
        CompletionRequest(model="m", prompt="hi", structured_outputs={"regex": "a", "whitespace": "x"})


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
