"""Tool calls by constrained decoding (rayspec.sampling.tools), without Ray."""

from __future__ import annotations

import json

import pytest

from rayspec.config import EngineConfig, SpeculativeConfig
from rayspec.engine.llm_engine import LLMEngine
from rayspec.sampling.sampler import SamplingParams
from rayspec.sampling.structured import StructuredOutput
from rayspec.sampling.tools import call_schema, inline_tools, parse_calls

WEATHER = {"name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}
ADD = {"name": "add", "parameters": {"type": "object", "properties": {"a": {"type": "integer"}}}}
CALL = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return LLMEngine(EngineConfig(model=str(tiny_model_dir), max_model_len=1024, max_num_seqs=2,
                                  kv_cache_memory_gb=0.25,
                                  speculative=SpeculativeConfig(method="ngram", num_speculative_tokens=4)))


def test_call_schema():
    assert call_schema([WEATHER, ADD], "add") == {**ADD["parameters"], "additionalProperties": False}
    required = call_schema([WEATHER, ADD], None, parallel=False)
    assert required["type"] == "array" and required["minItems"] == 1 and required["maxItems"] == 1
    names = [item["properties"]["name"]["const"] for item in required["items"]["anyOf"]]
    assert names == ["get_weather", "add"]
    assert "maxItems" not in call_schema([WEATHER], None, parallel=True)
    loose = {"name": "f", "parameters": {"type": "object", "properties": {}, "additionalProperties": True}}
    assert call_schema([loose], "f")["additionalProperties"] is True  # a schema's own choice stays


def test_parse_calls():
    assert parse_calls('{"city": "Oslo"}', "get_weather") == [("get_weather", '{"city": "Oslo"}')]
    assert parse_calls('[{"name": "add", "arguments": {"a": 1}}, {"name": "get_weather", "arguments": {}}]',
                       None) == [("add", '{"a": 1}'), ("get_weather", "{}")]
    assert parse_calls('[{"name": "add", "argu', None) is None  # cut by max_tokens
    assert parse_calls('{"city": "Os', "get_weather") is None


def test_tools_inlined_for_a_template_without_them():
    messages = [{"role": "user", "content": "Weather in Oslo?"}, {"role": "assistant", "content": "", "tool_calls": [CALL]},
                {"role": "tool", "tool_call_id": "call_1", "content": "3 degrees"}]
    out = inline_tools(messages, [WEATHER])
    assert out[0]["role"] == "system" and "get_weather: The weather in a city" in out[0]["content"]
    assert json.loads(out[2]["content"]) == [{"name": "get_weather", "arguments": {"city": "Oslo"}}]
    assert out[3] == messages[2]
    with_system = inline_tools([{"role": "system", "content": "Be brief."}] + messages[:1], [WEATHER])
    assert with_system[0]["content"].startswith("Be brief.\n\nYou can call") and len(with_system) == 2


def test_encode_chat_with_tools(engine):
    """SmolLM2's template ignores tools: they go into the system message. A template that renders
    tools gets them (and the calls, arguments as objects) itself."""
    question = [{"role": "user", "content": "Weather in Oslo?"}]
    text = engine.tokenizer.decode(engine.encode_chat(question, [WEATHER]))
    assert "get_weather: The weather in a city" in text and text.count("<|im_start|>system") == 1
    assert engine.encode_chat(question) != engine.encode_chat(question, [WEATHER])

    original = engine.tokenizer.chat_template
    engine.tokenizer.chat_template = (
        "{% for t in tools or [] %}TOOL {{ t.function.name }};{% endfor %}"
        "{% for m in messages %}{{ m.role }}:{{ m.content }}"
        "{% for c in m.tool_calls or [] %}CALL {{ c.function.name }} {{ c.function.arguments.city }}{% endfor %}|"
        "{% endfor %}")
    try:
        text = engine.tokenizer.decode(engine.encode_chat(
            question + [{"role": "assistant", "content": "", "tool_calls": [CALL]}], [WEATHER]))
    finally:
        engine.tokenizer.chat_template = original
    assert text == "TOOL get_weather;user:Weather in Oslo?|assistant:CALL get_weather Oslo|"


def test_constrained_call_is_lossless_under_speculation(engine, tiny_model_dir):
    """The call is structured output: with drafts it equals target-only decoding."""
    plain = LLMEngine(EngineConfig(model=str(tiny_model_dir), max_model_len=1024, max_num_seqs=2,
                                   kv_cache_memory_gb=0.25, speculative=SpeculativeConfig(method="none")))
    ids = engine.encode_chat([{"role": "user", "content": "Weather in Oslo? Oslo Oslo"}], [WEATHER, ADD])
    params = SamplingParams(temperature=0, max_tokens=48,
                            structured=StructuredOutput.json_schema(call_schema([WEATHER, ADD], None)))
    got, ref = engine.generate([ids], params)[0], plain.generate([ids], params)[0]
    assert got.token_ids == ref.token_ids
    assert got.num_draft_tokens > 0  # the grammar's forced keys are drafted at least
    # the random model writes an endless "city" string: cut by max_tokens, not a call yet
    assert got.finish_reason == "length" and parse_calls(got.text, None) is None

    # a bounded city and one call at most: the call closes (the grammar's forced tail is drafted and
    # accepted) and parses
    city = {**WEATHER, "parameters": {**WEATHER["parameters"], "properties": {
        "city": {"type": "string", "maxLength": 12}}}}
    params = SamplingParams(temperature=0, max_tokens=48,
                            structured=StructuredOutput.json_schema(call_schema([city, ADD], None, parallel=False)))
    got, ref = engine.generate([ids], params)[0], plain.generate([ids], params)[0]
    assert got.token_ids == ref.token_ids and got.finish_reason == ref.finish_reason == "stop"
    assert got.num_accepted_tokens > 0
    [(name, arguments)] = parse_calls(got.text, None)
    assert name == "get_weather" and set(json.loads(arguments)) == {"city"}
    assert len(json.loads(arguments)["city"]) <= 12


@pytest.mark.parametrize("name", ["hermes", "llama3_json", "mistral"])
def test_deeply_nested_model_output_is_text_not_a_500(name):
    """A model writing JSON nested past Python's parser (RecursionError, a 500 before) gets its text
    back as content, no call parsed."""
    from rayspec.sampling.tool_parsers import get_parser

    nested = '{"name": "f", "arguments": ' + "[" * 5000 + "]" * 5000 + "}"
    text = {"hermes": f"<tool_call>{nested}</tool_call>", "llama3_json": nested, "mistral": f"[TOOL_CALLS][{nested}]"}[name]
    parsed = get_parser(name).parse(text)
    assert not parsed.calls and parsed.content == text
