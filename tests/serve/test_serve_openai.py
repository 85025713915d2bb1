"""The OpenAI HTTP API and the Python handle API on a real local Ray cluster (tiny random model)."""

from __future__ import annotations

import json
import time

import httpx
import pytest

import ray.serve as serve
import openai

from ray_utils import serving
from serve_utils import is_error_event, tiny_args, wait_for  # noqa: E402

from deployments.app import build_app  # noqa: E402
from deployments.transport.protocol import GenerateRequest, RequestTimeoutError  # noqa: E402
from rayspec.config import EngineConfig, SpeculativeConfig  # noqa: E402
from rayspec.engine.llm_engine import LLMEngine  # noqa: E402
from rayspec.sampling.sampler import SamplingParams  # noqa: E402

PROMPT = "The quick brown fox jumps over the lazy dog. The quick brown fox jumps"  # the tiny model repeats it: n-gram drafts accepted
TOOLS = [{"type": "function", "function": {
             "name": "get_weather", "description": "The weather in a city",
             "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                             "unit": {"enum": ["c", "f"]}},
                            "required": ["city", "unit"]}}},
         {"type": "function", "function": {
             "name": "add", "parameters": {"type": "object", "properties": {"a": {"type": "integer"},
                                                                            "b": {"type": "integer"}},
                                           "required": ["a", "b"]}}}]


@pytest.fixture(scope="module")
def server(tiny_model_dir, ray_cluster, serve_url):
    """The app on the shared cluster, which exports Ray's metrics every second (tests/ray_utils.py).
    The conftest runs this module first of those that serve rayspec apps there: the exported
    series are then this app's alone (a dead replica's series may vanish between two scrapes of
    test_prometheus_metrics)."""
    # adaptive off (here and in local_engine): a greedy request then drafts the same tokens on both,
    # so the served draft/accept counts can be checked against the in-process engine's
    args = tiny_args(tiny_model_dir, speculative={"adaptive": False})
    with serving(("rayspec", build_app(args), "/")):
        yield {"url": serve_url, "args": args,
               "metrics_url": f"http://127.0.0.1:{ray_cluster['metrics_port']}/metrics"}


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server["url"] + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def local_engine(tiny_model_dir):
    return LLMEngine(EngineConfig(model=str(tiny_model_dir), max_model_len=1024, max_num_seqs=4,
                                  kv_cache_memory_gb=0.25,
                                  speculative=SpeculativeConfig(method="ngram", num_speculative_tokens=4,
                                                                adaptive=False)))


def verifier_stats():
    return serve.get_deployment_handle("Verifier", app_name="rayspec").get_stats.remote().result()


def test_health_and_models(server, client):
    health = httpx.get(server["url"] + "/health")
    assert health.status_code == 200
    assert health.json() == {"status": "ok"}  # nothing of the replicas' state: the route needs no key
    assert [m.id for m in client.models.list().data] == ["tiny"]


def test_health_answers_from_the_ingress_without_internals(tiny_model_dir, monkeypatch):
    """/health answers from the ingress's background probe of a verifier replica: a verifier still
    loading (no answer in time) or failing reads as not ready (503, OpenAI error JSON) without its
    error's text, one that answered reads as {"status": "ok"}; however often /health is asked, the
    verifier is asked only by the probe."""
    import asyncio

    import deployments.frontend.ingress as ingress_module

    monkeypatch.setattr(ingress_module, "HEALTH_TIMEOUT_S", 0.2)

    class _Verifier:
        def __init__(self, health):
            self._health, self.calls = health, 0

        @property
        def health(self):
            outer = self

            class _Method:
                def remote(self):
                    outer.calls += 1
                    return outer._health()
            return _Method()

    async def loading():
        await asyncio.sleep(10)

    async def engine_down():
        raise RuntimeError("the last 3 engine steps all failed: CUDA error at 0x7f00")

    async def ready():
        return {"num_running": 2, "num_waiting": 0, "topology": "colocated", "method": "ngram"}

    wrapper = ingress_module.OpenAIIngress.func_or_class  # serve.ingress's ASGI wrapper around our class
    ours = wrapper.__bases__[0]
    for health, status in [(loading, 503), (engine_down, 503), (ready, 200)]:
        verifier = _Verifier(health)
        ingress = object.__new__(ours)
        ours.__init__(ingress, tiny_args(tiny_model_dir), verifier)
        asyncio.run(ingress._probe_verifier())  # what the background probe does every HEALTH_PROBE_S
        for _ in range(5):
            resp = asyncio.run(ingress.health())
            if status == 200:
                assert resp == {"status": "ok"}
                continue
            assert resp.status_code == status
            body = resp.body.decode()
            error = json.loads(body)["error"]
            assert error["type"] == "service_unavailable" and error["code"] == "not_ready"
            assert "CUDA" not in body and "steps" not in body and "Timeout" not in body
        assert verifier.calls == 1  # the probe's; none from /health


def test_completion_greedy_matches_engine(client, local_engine):
    resp = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=24, temperature=0)
    ref = local_engine.generate([PROMPT], SamplingParams(temperature=0, max_tokens=24))[0]
    assert resp.choices[0].text == ref.text
    assert resp.choices[0].finish_reason in ("stop", "length")
    u = resp.usage
    assert u.prompt_tokens == ref.num_prompt_tokens and u.completion_tokens == ref.num_output_tokens
    assert u.total_tokens == u.prompt_tokens + u.completion_tokens
    # the same greedy request drafts the same n-grams served and in process (adaptive off on both)
    assert ref.num_accepted_tokens > 0  # this prompt's output repeats itself: drafts are accepted
    details = u.completion_tokens_details
    assert details.accepted_prediction_tokens == ref.num_accepted_tokens
    assert details.rejected_prediction_tokens == ref.num_draft_tokens - ref.num_accepted_tokens
    # every step emits one token the target chose itself besides the accepted drafts
    assert details.accepted_prediction_tokens <= u.completion_tokens - 1


def test_prefix_cached_tokens_in_usage(client):
    """A second request sharing a long prefix reports its cached prompt tokens, as OpenAI does
    (usage.prompt_tokens_details.cached_tokens): completions, chat, and the streamed usage."""
    shared = list(range(300, 400))  # 100 tokens: 6 full blocks of 16
    first = client.completions.create(model="tiny", prompt=shared + [7], max_tokens=2, temperature=0)
    second = client.completions.create(model="tiny", prompt=shared + [8, 9], max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens == 96
    system = {"role": "system", "content": "You answer briefly. " * 30}
    chats = [client.chat.completions.create(model="tiny", messages=[system, {"role": "user", "content": q}],
                                            max_tokens=2, temperature=0) for q in ("Hi?", "Why?")]
    assert chats[1].usage.prompt_tokens_details.cached_tokens >= 96
    chunks = list(client.completions.create(model="tiny", prompt=shared + [10], max_tokens=2, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == 96


def test_completion_token_ids_and_length(client, local_engine):
    ids = local_engine.encode(PROMPT)
    resp = client.completions.create(model="tiny", prompt=ids, max_tokens=5, temperature=0,
                                     extra_body={"ignore_eos": True})
    assert resp.choices[0].finish_reason == "length" and resp.usage.completion_tokens == 5
    ref = local_engine.generate([ids], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))[0]
    assert resp.choices[0].text == ref.text


def test_chat_greedy_matches_engine(client, local_engine):
    messages = [{"role": "user", "content": "Say hello hello hello"}]
    resp = client.chat.completions.create(model="tiny", messages=messages, max_tokens=20, temperature=0)
    ref = local_engine.generate([local_engine.encode_chat(messages)], SamplingParams(temperature=0, max_tokens=20))[0]
    assert resp.choices[0].message.role == "assistant"
    assert resp.choices[0].message.content == ref.text
    assert resp.usage.prompt_tokens == ref.num_prompt_tokens


def test_streaming_completion_and_chat(client):
    full = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=20, temperature=0)
    chunks = list(client.completions.create(model="tiny", prompt=PROMPT, max_tokens=20, temperature=0, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == full.choices[0].finish_reason

    messages = [{"role": "user", "content": "count: one two three"}]
    full = client.chat.completions.create(model="tiny", messages=messages, max_tokens=16, temperature=0)
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=16, temperature=0,
                                                 stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == full.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == full.choices[0].finish_reason


def test_tool_calls_named_and_required(client, local_engine):
    """tool_choice 'required' or a named function: the output is constrained to a valid call (the
    tiny random model still produces one), returned as tool_calls, streamed and not; greedy output
    equals the in-process engine's under the same constraint."""
    from rayspec.sampling.structured import StructuredOutput
    from rayspec.sampling.tools import call_schema

    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    named = {"type": "function", "function": {"name": "get_weather"}}
    resp = client.chat.completions.create(model="tiny", messages=messages, tools=TOOLS, tool_choice=named,
                                          temperature=0, max_tokens=60)
    [call] = resp.choices[0].message.tool_calls
    assert resp.choices[0].message.content is None and call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather" and resp.choices[0].finish_reason == "stop"
    args = json.loads(call.function.arguments)
    assert set(args) == {"city", "unit"} and args["unit"] in ("c", "f") and len(args["city"]) <= 12
    functions = [t["function"] for t in TOOLS]
    ref = local_engine.generate([local_engine.encode_chat(messages, functions)], SamplingParams(
        temperature=0, max_tokens=60, structured=StructuredOutput.json_schema(call_schema(functions, "get_weather"))))[0]
    assert call.function.arguments == ref.text

    chunks = list(client.chat.completions.create(model="tiny", messages=messages, tools=TOOLS, tool_choice=named,
                                                 temperature=0, max_tokens=60, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant" and chunks[0].choices[0].delta.content is None
    deltas = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert deltas[0].id and deltas[0].function.name == "get_weather"
    assert "".join(d.function.arguments or "" for d in deltas) == call.function.arguments
    assert chunks[-1].choices[0].finish_reason == "stop"

    resp = client.chat.completions.create(model="tiny", messages=messages, tools=TOOLS, tool_choice="required",
                                          temperature=0, max_tokens=80, parallel_tool_calls=False)
    [call] = resp.choices[0].message.tool_calls
    assert resp.choices[0].finish_reason == "tool_calls" and call.function.name in ("get_weather", "add")
    assert isinstance(json.loads(call.function.arguments), dict)
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, tools=TOOLS, tool_choice="required",
                                                 temperature=0, max_tokens=80, parallel_tool_calls=False, stream=True))
    [streamed] = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert (streamed.function.name, streamed.function.arguments) == (call.function.name, call.function.arguments)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"

    # cut by max_tokens: a named call returns its arguments so far, a list of calls the raw text
    resp = client.chat.completions.create(model="tiny", messages=messages, tools=TOOLS, tool_choice="required",
                                          temperature=0, max_tokens=3)
    assert resp.choices[0].finish_reason == "length" and resp.choices[0].message.content.startswith("[")

    # a conversation that carries the call and its result continues
    history = messages + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": call.id, "type": "function", "function": {"name": call.function.name,
                                                         "arguments": call.function.arguments}}]},
        {"role": "tool", "tool_call_id": call.id, "content": "21 degrees"}]
    resp = client.chat.completions.create(model="tiny", messages=history, tools=TOOLS, tool_choice="none",
                                          temperature=0, max_tokens=8)
    assert resp.choices[0].message.content is not None and resp.choices[0].message.tool_calls is None


def test_sse_wire_format(server):
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 4, "temperature": 0, "stream": True}
    with httpx.stream("POST", server["url"] + "/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [line for line in r.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines)
    assert lines[-1] == "data: [DONE]"
    assert json.loads(lines[0][6:])["object"] == "text_completion"


def test_sampled_request_runs(client, local_engine):
    """A seeded sampled request with top_k/top_p and a per-request draft cap samples what the
    in-process engine samples with the same seed."""
    resp = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=0.8, top_p=0.9,
                                     seed=3, extra_body={"top_k": 20, "num_speculative_tokens": 2})
    ref = local_engine.generate([PROMPT], SamplingParams(temperature=0.8, top_p=0.9, top_k=20, seed=3, max_tokens=8,
                                                         num_speculative_tokens=2))[0]
    assert resp.choices[0].text == ref.text and resp.usage.completion_tokens == ref.num_output_tokens


@pytest.mark.parametrize("path,body,status,param", [
    ("/v1/completions", {"model": "nope", "prompt": "hi"}, 404, "model"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "n": 65}, 400, "n"),
    ("/v1/completions", {"model": "tiny", "prompt": ["hi"] * 20, "n": 4}, 400, "n"),
    ("/v1/completions", {"model": "tiny", "prompt": ["hi", ""]}, 400, "prompt"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "logprobs": 21}, 400, "logprobs"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "stop_token_ids": [10**9]}, 400, None),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "guided_json": "{not json"}, 400, "guided_json"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "guided_json": {"type": "wat"}}, 400, "guided_json"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "guided_choice": [1, 2]}, 400, "guided_choice"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "logit_bias": {"1": "x"}}, 400, "logit_bias"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "min_tokens": -1}, 400, "min_tokens"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "x"}],
                              "response_format": "json"}, 400, "response_format"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 3, "min_tokens": 4}, 400, "min_tokens"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "guided_regex": "[a-"}, 400, "guided_regex"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "guided_choice": []}, 400, "guided_choice"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "guided_regex": "a", "guided_choice": ["b"]}, 400,
     "guided_choice"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "x"}],
                              "response_format": {"type": "xml"}}, 400, "response_format"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "x"}],
                              "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, 400,
     "response_format"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "presence_penalty": 3}, 400, "presence_penalty"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "repetition_penalty": 0}, 400, "repetition_penalty"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "logit_bias": {"abc": 1}}, 400, "logit_bias"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "logit_bias": {"5": 200}}, 400, "logit_bias"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "logit_bias": {"99999999": 1}}, 400, None),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "top_k": -5}, 400, "top_k"),
    ("/v1/completions", {"model": "tiny"}, 400, "prompt"),
    ("/v1/completions", {"model": "tiny", "prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"model": "tiny", "prompt": [1, 2, 10**9]}, 400, None),
    ("/v1/completions", {"model": "tiny", "prompt": "hi " * 2000}, 400, None),
    ("/v1/completions", {"model": "tiny", "prompt": "hi " * 2000, "stream": True}, 400, None),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "max_tokens": 5000}, 400, None),
    ("/v1/chat/completions", {"model": "tiny", "messages": []}, 400, "messages"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "n": 0}, 400, "n"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "x"}],
                              "tool_choice": "auto"}, 400, "tool_choice"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "tools": TOOLS,
                              "tool_choice": "auto", "structured_outputs": {"regex": "a", "bogus": 1}}, 400,
     "structured_outputs"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "tools": TOOLS,
                              "tool_choice": {"type": "function", "function": {"name": "nope"}}}, 400, "tool_choice"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "tools": TOOLS,
                              "tool_choice": "sometimes"}, 400, "tool_choice"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "x"}],
                              "tool_choice": "required"}, 400, "tool_choice"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "tools": TOOLS,
                              "tool_choice": "required", "response_format": {"type": "json_object"}}, 400,
     "tool_choice"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "x"}],
                              "tools": [{"type": "function", "function": {"name": "bad name!"}}],
                              "tool_choice": "required"}, 400, "tools"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "x"}],
                              "tools": [{"type": "retrieval"}], "tool_choice": "required"}, 400, "tools"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "x"}],
                              "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "wat"}}}],
                              "tool_choice": "required"}, 400, "tools"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "x"},
                                                            {"role": "assistant", "tool_calls": [{"id": "1"}]}]},
     400, "tool_calls"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "x"}],
                              "functions": [{"name": "f"}]}, 400, "functions"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "x"}],
                              "top_logprobs": 2}, 400, "top_logprobs"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "x"}],
                              "logprobs": True, "top_logprobs": 30}, 400, "top_logprobs"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "wizard", "content": "x"}]}, 400, None),
    ("/v1/chat/completions", {"model": "other", "messages": [{"role": "user", "content": "x"}]}, 404, "model"),
    # per-request limits (deployments.frontend.openai_limits.LIMITS; tests/unit/test_request_limits.py has each one's edge)
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "stop": ["s"] * 10_000}, 400, "stop"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "stop": "x" * 1001}, 400, "stop"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "stop_token_ids": list(range(129))}, 400, "stop_token_ids"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "logit_bias": {str(i): 1 for i in range(301)}}, 400,
     "logit_bias"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "seed": -1}, 400, "seed"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "seed": 2**64}, 400, "seed"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "seed": 2**63 - 1, "n": 2}, 400, "seed"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "n": 64, "max_tokens": 2049}, 400, "max_tokens"),
    ("/v1/completions", {"model": "tiny", "prompt": "x" * (32 * 1024 + 1)}, 400, "prompt"),
    ("/v1/completions", {"model": "tiny", "prompt": [5] * 1025}, 400, "prompt"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "guided_regex": "a" * 65_537}, 400, "guided_regex"),
    ("/v1/completions", {"model": "tiny", "prompt": "hi", "guided_choice": [f"c{i}" for i in range(1025)]}, 400,
     "guided_choice"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "x"}] * 2049}, 400,
     "messages"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "x" * 40_000}]}, 400,
     "messages"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "x"}],
                              "min_tokens": 1025}, 400, "min_tokens"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "x"}], "tool_choice": "none",
                              "tools": [{"type": "function", "function": {"name": f"f{i}"}} for i in range(129)]},
     400, "tools"),
    ("/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "x"}],
                              "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": {
                                  "type": "object", "description": "x" * 70_000}}}}, 400, "response_format"),
])
def test_errors_are_openai_json(server, path, body, status, param):
    r = httpx.post(server["url"] + path, json=body, timeout=60)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if param is not None:
        assert param in (err["param"] or "")


def test_malformed_json_is_400(server):
    r = httpx.post(server["url"] + "/v1/completions", content=b"{not json", timeout=30,
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and "error" in r.json()


def test_bodies_are_read_only_where_a_route_takes_one_and_within_their_deadline(server, tiny_model_dir):
    """Over Serve (issue #51): POST /health is a 405 without its body read, a body past the limit a
    413, and a body trickling in past its deadline a 408 (the ingress's copy of the app, whose routes
    Serve adds at start, is the one asked which routes take a body). The 408 comes from Serve's proxy
    itself (deployments/frontend/proxy_guard.py; the shared cluster gives it a 10 s deadline, the
    ingress has 30 s): the proxy holds no body past its deadline."""
    import socket

    r = httpx.post(server["url"] + "/health", content=b"x" * 10, timeout=30)
    assert r.status_code == 405, r.text
    r = httpx.post(server["url"] + "/v1/completions", content=b"x" * (17 << 20), timeout=60,
                   headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    host, port = server["url"].removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=60) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 100\r\n\r\n{")  # then nothing: the rest never comes
        started = time.monotonic()
        head = b""
        while b"}}" not in head and (part := sock.recv(4096)):  # the status line, then the error JSON
            head += part
    assert head.startswith(b"HTTP/1.1 408"), head[:200]
    assert b"within 10 s" in head, head  # the proxy's deadline (tests/ray_utils.py), not the ingress's 30 s
    assert time.monotonic() - started < 10 + 15  # and a margin for a busy machine
    with socket.create_connection((host, int(port)), timeout=60) as sock:  # no length: counted as it comes
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nTransfer-Encoding: chunked\r\n\r\n")
        chunk = b"%x\r\n" % (1 << 20) + b"x" * (1 << 20) + b"\r\n"
        try:
            for _ in range(17):
                sock.sendall(chunk)
        except OSError:  # refused and closed before the last chunk: what the guard is for
            pass
        head = sock.recv(4096)
    assert head.startswith(b"HTTP/1.1 413"), head[:200]


def test_openai_client_raises_bad_request(client):
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="tiny", prompt="hi", n=100)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="missing", messages=[{"role": "user", "content": "x"}])


def test_disconnect_aborts_and_frees_slot(server):
    before = verifier_stats()
    assert before["num_running"] == before["num_waiting"] == 0  # idle: every KV slot free
    assert before["num_free_slots"] == before["num_slots"] >= 1
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 1000, "temperature": 0.9, "ignore_eos": True,
            "stream": True, "num_speculative_tokens": 0}
    with httpx.stream("POST", server["url"] + "/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        for _ in range(3):
            next(lines)
        # mid-stream the request holds one KV slot
        during = verifier_stats()
        assert during["num_running"] == 1 and during["num_free_slots"] == before["num_slots"] - 1, during
    # the response is closed after a few chunks (1000 tokens would take seconds): the verifier
    # aborts the request, which gives its slot back
    after = wait_for(lambda: (s := verifier_stats())["num_aborted"] > before["num_aborted"] and s["num_running"] == 0
                     and s, timeout=30)
    assert after["num_aborted"] == before["num_aborted"] + 1
    assert after["num_finished"] == before["num_finished"]  # aborted, not run to its end
    assert after["num_free_slots"] == after["num_slots"] == before["num_slots"] and after["num_waiting"] == 0


def test_a_request_past_its_deadline_times_out_and_is_aborted(server):
    """A request that cannot meet its deadline (a handle request's own GenerateRequest.timeout_s; the
    app's is request_timeout_s) ends with RequestTimeoutError (HTTP: a 504), and the engine frees its slot."""
    before = verifier_stats()
    req = GenerateRequest(prompt=PROMPT, max_tokens=1000, temperature=0.9, ignore_eos=True, num_speculative_tokens=0,
                          timeout_s=0.5)  # 1000 tokens take seconds
    with pytest.raises(RequestTimeoutError, match="deadline"):
        serve.get_app_handle("rayspec").generate.remote(req).result()
    after = wait_for(lambda: (s := verifier_stats())["num_timed_out"] == before["num_timed_out"] + 1
                     and s["num_running"] == 0 and s, timeout=30)
    assert after["num_finished"] == before["num_finished"] and after["num_free_slots"] == after["num_slots"]


def test_python_handle_api(server):
    handle = serve.get_app_handle("rayspec")
    req = GenerateRequest(prompt=PROMPT, max_tokens=12, temperature=0)
    resp = handle.generate.remote(req).result()
    streamed = list(handle.options(stream=True).generate_stream.remote(req))
    assert "".join(c.delta_text for c in streamed) == resp.text
    assert sum(len(c.delta_token_ids) for c in streamed) == resp.num_output_tokens
    assert streamed[-1].finished


def test_handle_from_second_app(server):
    from deployments.operations.handle_example import HandleClient

    client_handle = serve.run(HandleClient.options(ray_actor_options={"num_cpus": 0}).bind("rayspec"),
                              name="client", route_prefix="/client")
    req = {"prompt": PROMPT, "max_tokens": 10, "temperature": 0}
    direct = serve.get_app_handle("rayspec").generate.remote(GenerateRequest(**req)).result()
    assert client_handle.complete.remote(req).result()["text"] == direct.text
    assert client_handle.complete_streamed.remote(req).result()["text"] == direct.text
    r = httpx.post(server["url"] + "/client", json=req, timeout=60)
    assert r.status_code == 200 and r.json()["text"] == direct.text
    serve.delete("client")


def test_engine_stats(server, client, local_engine):
    """/v1/stats: the engine's counters move by exactly what one request of this test drafted."""
    def stats():
        r = httpx.get(server["url"] + "/v1/stats", timeout=30)
        assert r.status_code == 200, r.text
        return r.json()

    before = stats()
    ref_before = (local_engine.stats.num_drafts, local_engine.stats.num_draft_tokens)
    ref = local_engine.generate([PROMPT], SamplingParams(temperature=0, max_tokens=24))[0]
    ref_drafts = local_engine.stats.num_drafts - ref_before[0]
    assert local_engine.stats.num_draft_tokens - ref_before[1] == ref.num_draft_tokens
    resp = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=24, temperature=0)
    assert resp.choices[0].text == ref.text
    # the snapshot is taken after the step that finished the request: wait for it
    after = wait_for(lambda: (s := stats())["num_finished"] > before["num_finished"] and s, timeout=30)
    for key in ("num_drafts", "num_draft_tokens", "num_accepted_tokens", "num_accepted_tokens_per_pos",
                "acceptance_rate", "num_running", "num_waiting", "num_slots", "num_free_slots", "num_failovers"):
        assert key in after
    assert after["method"] == "ngram" and after["num_finished"] == before["num_finished"] + 1
    assert ref.num_accepted_tokens > 0 and ref_drafts > 0
    assert after["num_draft_tokens"] - before["num_draft_tokens"] == ref.num_draft_tokens
    assert after["num_accepted_tokens"] - before["num_accepted_tokens"] == ref.num_accepted_tokens
    assert after["num_drafts"] - before["num_drafts"] == ref_drafts
    assert sum(after["num_accepted_tokens_per_pos"]) - sum(before["num_accepted_tokens_per_pos"]) == \
        ref.num_accepted_tokens
    details = resp.usage.completion_tokens_details
    assert details.accepted_prediction_tokens == ref.num_accepted_tokens
    assert details.rejected_prediction_tokens == ref.num_draft_tokens - ref.num_accepted_tokens
    assert after["num_failovers"] == before["num_failovers"] == 0  # no verifier replica was lost here


def _metric_values(text: str, name: str) -> list[tuple[str, float]]:
    """(labels, value) of every sample of the series `name` in a Prometheus text scrape."""
    out = []
    for line in text.splitlines():
        if line.startswith(name) and line[len(name):len(name) + 1] in ("{", " "):
            labels, value = line.rsplit(" ", 1)
            out.append((labels[len(name):], float(value)))
    return out


def test_prometheus_metrics(server, client):
    """One greedy request moves the exported metrics (deployments/README.md, "Metrics") by exactly
    its own counts: tokens as in its usage, drafts and acceptances as the engine's own stats, one
    observation in each per-request histogram."""
    import re
    import time

    from deployments.replicas.metrics import METRICS, scraped_names

    def scrape() -> str:
        try:
            return httpx.get(server["metrics_url"], timeout=30).text
        except httpx.HTTPError:
            return ""

    def total(text: str, series: str, label: str = "") -> float:
        return sum(v for labels, v in _metric_values(text, series) if label in labels)

    def counts(text: str) -> dict:
        names = ["ray_rayspec_prompt_tokens_total", "ray_rayspec_generation_tokens_total",
                 "ray_rayspec_prefix_cache_queries_total", "ray_rayspec_request_success_total",
                 "ray_rayspec_spec_decode_num_drafts_total", "ray_rayspec_spec_decode_num_draft_tokens_total",
                 "ray_rayspec_spec_decode_num_accepted_tokens_total",
                 "ray_rayspec_spec_decode_num_accepted_tokens_per_pos_total",
                 "ray_rayspec_time_to_first_token_seconds_count", "ray_rayspec_inter_token_latency_seconds_count",
                 "ray_rayspec_e2e_request_latency_seconds_count", "ray_rayspec_request_queue_time_seconds_count",
                 "ray_rayspec_request_time_per_output_token_seconds_count",
                 "ray_rayspec_request_prompt_tokens_count", "ray_rayspec_request_generation_tokens_count"]
        found = {name: total(text, name) for name in names}
        found["length"] = total(text, "ray_rayspec_request_success_total", 'finished_reason="length"')
        for name in ("request_prompt_tokens", "request_generation_tokens"):  # bucket upper bound -> count
            for labels, value in _metric_values(text, f"ray_rayspec_{name}_bucket"):
                le = float(re.search(r'le="([^"]+)"', labels).group(1))
                found[(name, le)] = found.get((name, le), 0.0) + value
        return found

    # the metrics are exported about every second: wait until three scrapes agree (the earlier
    # tests' counts are all out) before this test's request
    seen, deadline = [], time.monotonic() + 60
    while len(seen) < 3 or any(c != seen[-1] for c in seen[-3:]):
        assert time.monotonic() < deadline, seen[-3:]
        seen.append(counts(scrape()))
        time.sleep(1.0)
    before, stats_before = seen[-1], verifier_stats()
    resp = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=24, temperature=0)
    stats_after = verifier_stats()
    details = resp.usage.completion_tokens_details
    assert details.accepted_prediction_tokens > 0 and resp.choices[0].finish_reason == "length"

    def moved():
        text = scrape()
        now = counts(text)
        done = now["ray_rayspec_request_success_total"] > before["ray_rayspec_request_success_total"]
        return (text, now) if done and now["ray_rayspec_generation_tokens_total"] >= \
            before["ray_rayspec_generation_tokens_total"] + resp.usage.completion_tokens else None

    text, after = wait_for(moved, timeout=60, interval=1.0)
    time.sleep(2.0)  # a second export: nothing of this request comes late
    text = scrape()
    after = counts(text)
    delta = {key: after[key] - before.get(key, 0.0) for key in after}
    usage = resp.usage
    assert delta["ray_rayspec_prompt_tokens_total"] == usage.prompt_tokens
    assert delta["ray_rayspec_prefix_cache_queries_total"] == usage.prompt_tokens
    assert delta["ray_rayspec_generation_tokens_total"] == usage.completion_tokens
    # Ray's exporter rebuilds a histogram's _sum from bucket midpoints: the buckets are exact
    for name, tokens in (("request_prompt_tokens", usage.prompt_tokens),
                         ("request_generation_tokens", usage.completion_tokens)):
        bounds = sorted(le for key, le in (k for k in delta if isinstance(k, tuple)) if key == name)
        assert bounds, name
        assert all(delta[(name, le)] == (1 if le >= tokens else 0) for le in bounds), name
    assert delta["ray_rayspec_request_success_total"] == delta["length"] == 1
    for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds",
                 "request_time_per_output_token_seconds", "request_prompt_tokens", "request_generation_tokens"):
        assert delta[f"ray_rayspec_{name}_count"] == 1, name
    # one inter-token latency per step after the first that gave the request tokens
    assert 1 <= delta["ray_rayspec_inter_token_latency_seconds_count"] <= usage.completion_tokens - 1
    # the acceptance counters equal the engine's own (and this request's usage details)
    for key in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
        assert delta[f"ray_rayspec_spec_decode_{key}_total"] == stats_after[key] - stats_before[key], key
    assert delta["ray_rayspec_spec_decode_num_accepted_tokens_total"] == details.accepted_prediction_tokens
    assert delta["ray_rayspec_spec_decode_num_draft_tokens_total"] == \
        details.accepted_prediction_tokens + details.rejected_prediction_tokens
    assert delta["ray_rayspec_spec_decode_num_accepted_tokens_per_pos_total"] == details.accepted_prediction_tokens
    assert any('position="0"' in labels
               for labels, _ in _metric_values(text, "ray_rayspec_spec_decode_num_accepted_tokens_per_pos_total"))
    # every name is exported (a counter from its first increment: no prefix cache hits here yet, and
    # no speculation cache, which only an asynchronous disaggregated proposer has: test_serve_async)
    for name in METRICS:
        if name not in ("prefix_cache_hits", "speculation_cache_hits", "speculation_cache_misses"):
            assert all(_metric_values(text, series) for series in scraped_names(name)), name
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc"):
        samples = _metric_values(text, f"ray_rayspec_{name}")
        assert samples and all('model_name="tiny"' in labels for labels, _ in samples), name
        assert all('deployment="Verifier"' in labels for labels, _ in samples), name
    assert all(0.0 <= v <= 1.0 for _, v in _metric_values(text, "ray_rayspec_kv_cache_usage_perc"))
    assert not _metric_values(text, "ray_spec_decode_num_drafts_total")  # the old, unprefixed names are gone


# ---- logprobs, n, batched prompts ---------------------------------------------------------------

def test_completion_logprobs_match_engine(client, local_engine):
    ref = local_engine.generate([PROMPT], SamplingParams(temperature=0, max_tokens=16, logprobs=3))[0]
    resp = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=16, temperature=0, logprobs=3)
    lp = resp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == resp.usage.completion_tokens
    assert lp.tokens == [e.token for e in ref.logprobs]
    assert all(abs(a - e.logprob) < 1e-4 for a, e in zip(lp.token_logprobs, ref.logprobs))
    for top, e in zip(lp.top_logprobs, ref.logprobs):
        assert 3 <= len(top) <= 4 and top[e.token] == pytest.approx(e.logprob, abs=1e-4)
        assert max(top.values()) == pytest.approx(e.top[0][2], abs=1e-4)
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)

    chunks = list(client.completions.create(model="tiny", prompt=PROMPT, max_tokens=16, temperature=0, logprobs=3,
                                            stream=True))
    streamed = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
    assert sum((s.tokens for s in streamed), []) == lp.tokens
    assert sum((s.text_offset for s in streamed), []) == lp.text_offset
    assert sum((s.token_logprobs for s in streamed), []) == pytest.approx(lp.token_logprobs, abs=1e-5)


def test_chat_logprobs_streamed_and_not(client):
    messages = [{"role": "user", "content": "count: one two three"}]
    kw = dict(model="tiny", messages=messages, max_tokens=12, temperature=0, logprobs=True, top_logprobs=2)
    resp = client.chat.completions.create(**kw)
    content = resp.choices[0].logprobs.content
    assert len(content) == resp.usage.completion_tokens
    for e in content:
        assert len(e.top_logprobs) == 2 and e.top_logprobs[0].logprob >= e.top_logprobs[1].logprob
        assert e.bytes == list(e.token.encode())
    # greedy: the chosen token is the most likely one
    assert all(e.logprob == pytest.approx(e.top_logprobs[0].logprob, abs=1e-5) for e in content)
    chunks = list(client.chat.completions.create(stream=True, **kw))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in content]
    assert "".join(e.token for e in content).startswith(resp.choices[0].message.content[:5])
    plain = client.chat.completions.create(model="tiny", messages=messages, max_tokens=4, temperature=0)
    assert plain.choices[0].logprobs is None


def test_n_choices_and_batched_prompts(client, local_engine):
    greedy = {p: local_engine.generate([p], SamplingParams(temperature=0, max_tokens=10))[0] for p in (PROMPT, "Hello")}
    resp = client.completions.create(model="tiny", prompt=[PROMPT, "Hello"], n=2, max_tokens=10, temperature=0)
    assert [c.index for c in resp.choices] == [0, 1, 2, 3]
    assert [c.text for c in resp.choices] == [greedy[PROMPT].text] * 2 + [greedy["Hello"].text] * 2
    assert resp.usage.prompt_tokens == greedy[PROMPT].num_prompt_tokens + greedy["Hello"].num_prompt_tokens
    assert resp.usage.completion_tokens == 2 * (greedy[PROMPT].num_output_tokens + greedy["Hello"].num_output_tokens)

    sampled = client.completions.create(model="tiny", prompt=PROMPT, n=3, max_tokens=24, temperature=1.5, seed=5)
    again = client.completions.create(model="tiny", prompt=PROMPT, n=3, max_tokens=24, temperature=1.5, seed=5)
    assert len(sampled.choices) == 3 and len({c.text for c in sampled.choices}) > 1  # seed + i per sample
    assert [c.text for c in sampled.choices] == [c.text for c in again.choices]  # and reproducible

    messages = [{"role": "user", "content": "Say hello hello hello"}]
    full = client.chat.completions.create(model="tiny", messages=messages, n=2, max_tokens=12, temperature=0)
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, n=2, max_tokens=12, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    for i in range(2):
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == i]
        assert mine[0].delta.role == "assistant"
        assert "".join(ch.delta.content or "" for ch in mine) == full.choices[i].message.content
        assert mine[-1].finish_reason == full.choices[i].finish_reason
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens


def test_disconnect_aborts_every_choice(server):
    before = verifier_stats()
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 1000, "temperature": 0.9, "ignore_eos": True,
            "stream": True, "n": 3}
    with httpx.stream("POST", server["url"] + "/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        for _ in range(6):
            next(lines)
    after = wait_for(lambda: (s := verifier_stats())["num_aborted"] >= before["num_aborted"] + 3
                     and s["num_running"] == 0 and s, timeout=30)
    assert after["num_aborted"] == before["num_aborted"] + 3  # every choice, each once
    assert after["num_finished"] == before["num_finished"]  # none ran to its end
    assert after["num_free_slots"] == after["num_slots"]


def test_logit_bias_and_penalties(client, local_engine):
    forced = local_engine.encode(" cat")[-1]
    resp = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=5, temperature=0,
                                     logit_bias={str(forced): 100}, logprobs=0)
    assert resp.choices[0].logprobs.tokens == [" cat"] * 5
    params = SamplingParams(temperature=0, max_tokens=16, frequency_penalty=2.0, presence_penalty=1.0,
                            repetition_penalty=1.5)
    ref = local_engine.generate([PROMPT], params)[0]
    resp = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=16, temperature=0,
                                     frequency_penalty=2.0, presence_penalty=1.0,
                                     extra_body={"repetition_penalty": 1.5})
    assert resp.choices[0].text == ref.text
    assert ref.text != local_engine.generate([PROMPT], SamplingParams(temperature=0, max_tokens=16))[0].text


def test_echo_scores_prompts_like_lm_eval(client, local_engine):
    """lm-evaluation-harness' loglikelihood request: batched prompts, echo, max_tokens 0, logprobs 1."""
    prompts = [PROMPT, "Hello there, general"]
    resp = client.completions.create(model="tiny", prompt=prompts, echo=True, max_tokens=0, logprobs=1,
                                     temperature=0)
    assert resp.usage.completion_tokens == 0
    for choice, prompt in zip(resp.choices, prompts):
        ref = local_engine.generate([prompt], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1))[0]
        lp = choice.logprobs
        assert choice.text == prompt and choice.finish_reason == "length"
        assert lp.tokens == [e.token for e in ref.prompt_logprobs]
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        assert lp.token_logprobs[1:] == pytest.approx([e.logprob for e in ref.prompt_logprobs[1:]], abs=1e-4)
        assert lp.text_offset[0] == 0
    # echo with a completion, streamed and not: prompt text first, then the output
    full = client.completions.create(model="tiny", prompt=PROMPT, echo=True, max_tokens=6, logprobs=0, temperature=0)
    plain = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, temperature=0)
    assert full.choices[0].text == PROMPT + plain.choices[0].text
    ids = local_engine.encode(PROMPT)
    assert len(full.choices[0].logprobs.tokens) == len(ids) + full.usage.completion_tokens
    chunks = list(client.completions.create(model="tiny", prompt=PROMPT, echo=True, max_tokens=6, logprobs=0,
                                            temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
    assert sum((c.choices[0].logprobs.tokens for c in chunks if c.choices and c.choices[0].logprobs), []) == \
        full.choices[0].logprobs.tokens
    scored = list(client.completions.create(model="tiny", prompt=PROMPT, echo=True, max_tokens=0, logprobs=1,
                                            temperature=0, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in scored if c.choices) == PROMPT
    assert scored[-1].usage.completion_tokens == 0
    assert len(sum((c.choices[0].logprobs.tokens for c in scored if c.choices and c.choices[0].logprobs), [])) == len(ids)
    by_ids = client.completions.create(model="tiny", prompt=ids, echo=True, max_tokens=0, temperature=0)
    assert by_ids.choices[0].text == local_engine.tokenizer.decode(ids) and by_ids.choices[0].logprobs is None


SCHEMA = {"type": "object", "additionalProperties": False, "required": ["answer", "ok"],
          "properties": {"answer": {"enum": ["yes", "no", "maybe"]}, "ok": {"type": "boolean"}}}


def test_structured_output(client, local_engine):
    from rayspec.sampling.structured import StructuredOutput

    messages = [{"role": "user", "content": "Answer in JSON."}]
    fmt = {"type": "json_schema", "json_schema": {"name": "reply", "schema": SCHEMA}}
    resp = client.chat.completions.create(model="tiny", messages=messages, max_tokens=40, temperature=0,
                                          response_format=fmt)
    value = json.loads(resp.choices[0].message.content)
    assert value["answer"] in ("yes", "no", "maybe") and isinstance(value["ok"], bool)
    assert resp.choices[0].finish_reason == "stop"
    ref = local_engine.generate([local_engine.encode_chat(messages)], SamplingParams(
        temperature=0, max_tokens=40, structured=StructuredOutput.json_schema(SCHEMA)))[0]
    assert resp.choices[0].message.content == ref.text
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=40, temperature=0,
                                                 response_format=fmt, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ref.text
    # json_object, sampled with a seed: the served text is the in-process engine's under the same
    # constraint and seed (3: with most seeds this random model writes `{}` at once). Left alone it
    # writes one endless key (cut by max_tokens);
    # with quotes favoured (logit_bias) it closes keys, and the object closes and parses
    any_object = StructuredOutput.json_schema({"type": "object"})
    chat_ids = local_engine.encode_chat(messages)

    def json_object(max_tokens, **bias):
        obj = client.chat.completions.create(model="tiny", messages=messages, max_tokens=max_tokens, temperature=0.7,
                                             seed=3, response_format={"type": "json_object"}, **bias)
        ref = local_engine.generate([chat_ids], SamplingParams(
            temperature=0.7, seed=3, max_tokens=max_tokens, structured=any_object,
            logit_bias={int(t): b for t, b in bias.get("logit_bias", {}).items()}))[0]
        assert obj.choices[0].message.content == ref.text and obj.choices[0].finish_reason == ref.finish_reason
        return obj.choices[0].message.content, obj.choices[0].finish_reason

    cut, reason = json_object(8)
    assert reason == "length" and cut.startswith("{")
    with pytest.raises(json.JSONDecodeError):  # cut inside the object
        json.loads(cut)
    quotes = {str(local_engine.tokenizer.encode(s)[0]): 30 for s in ('"', '":"', '"}')}
    closed, reason = json_object(40, logit_bias=quotes)
    assert reason == "stop" and isinstance(json.loads(closed), dict) and len(json.loads(closed)) >= 1, closed

    choices = ["red", "green", "blue sky"]
    resp = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, temperature=1.0, n=4, seed=3,
                                     extra_body={"guided_choice": choices})
    assert all(c.text in choices and c.finish_reason == "stop" for c in resp.choices)
    resp = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0,
                                     extra_body={"guided_regex": "[0-9]{3}-[a-z]{2}"})
    import re
    assert re.fullmatch("[0-9]{3}-[a-z]{2}", resp.choices[0].text)


def test_min_tokens_and_stop_token_ids(client, local_engine):
    first = local_engine.generate([PROMPT], SamplingParams(temperature=0, max_tokens=12))[0].token_ids
    resp = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0,
                                     extra_body={"stop_token_ids": [first[0]]})
    assert resp.usage.completion_tokens == 1 and resp.choices[0].finish_reason == "stop"
    resp = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, temperature=0,
                                     extra_body={"stop_token_ids": [first[0]], "min_tokens": 6})
    assert resp.usage.completion_tokens >= 6


def test_mixed_concurrent_load_leaves_nothing_behind(server):
    """Many requests at once, every new field mixed in, some streams dropped half way: every
    finished request is a 200 of the right shape, and afterwards the engine holds nothing."""
    import concurrent.futures
    import random

    url = server["url"]
    rng = random.Random(7)
    bodies = []
    for i in range(24):
        body = {"model": "tiny", "prompt": [PROMPT, "Hello there"] if i % 5 == 0 else PROMPT,
                "max_tokens": rng.choice([4, 12, 24]), "temperature": rng.choice([0, 0.8]), "seed": i,
                "n": rng.choice([1, 1, 2, 3])}
        extras = [{"logprobs": 2}, {"frequency_penalty": 1.0, "logit_bias": {"5": -50}},
                  {"guided_regex": "[a-z]{3,6}"}, {"echo": True, "logprobs": 1}, {"min_tokens": 3}, {}]
        body.update(rng.choice(extras))
        body["stream"] = i % 3 == 0
        bodies.append((body, i % 6 == 0))  # every sixth: a stream the client drops after a few lines

    def send(item):
        body, drop = item
        if not body["stream"]:
            r = httpx.post(url + "/v1/completions", json=body, timeout=120)
            assert r.status_code == 200, r.text
            data = r.json()
            prompts = len(body["prompt"]) if isinstance(body["prompt"], list) else 1
            assert len(data["choices"]) == prompts * body["n"]
            return "whole"
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
            assert r.status_code == 200, (r.read(), verifier_stats())
            lines = r.iter_lines()
            seen = []
            for line in lines:
                if line:
                    seen.append(line)
                if drop and len(seen) >= 2:
                    return "dropped"
            assert seen[-1] == "data: [DONE]" and not any(is_error_event(s) for s in seen), seen[-3:]
            return "streamed"

    with concurrent.futures.ThreadPoolExecutor(12) as pool:
        outcomes = list(pool.map(send, bodies))
    assert {"whole", "streamed", "dropped"} <= set(outcomes) and len(outcomes) == len(bodies)
    after = wait_for(lambda: (s := verifier_stats())["num_running"] == 0 and s["num_waiting"] == 0 and s, timeout=60)
    assert after["num_free_slots"] == after["num_slots"]  # the dropped streams' slots came back too
    assert wait_for(lambda: verifier_stats()["work_in_flight_tokens"] == 0, timeout=30), verifier_stats()
