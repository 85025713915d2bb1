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

from openai_dialect_data import AUTH, HERMES_TEMPLATE, KEY, SCHEMA, TOOLS, USER  # noqa: F401

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
