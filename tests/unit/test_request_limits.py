"""Per-request limits of the OpenAI routes (deployments.frontend.openai_limits.LIMITS, the table in
deployments/README.md): past each one a 400 whose `param` names the field and whose message names
the limit; just at it, the request is accepted. No Ray: an ingress instance is built without Serve
(as tests/serve/test_serve_openai.py's health test does) and its own request building (`_to_generate`),
error responses and validation handler are called directly; grammar compiles run the real
GrammarCompiler behind a fake verifier."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import time
from types import SimpleNamespace

import pytest
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

import deployments.frontend.ingress as ingress_module
from deployments.frontend.openai_limits import LIMITS, OpenAIError
from deployments.frontend.openai_requests import ChatCompletionRequest, CompletionRequest
from deployments.transport.protocol import GenerateRequest
from rayspec.engine.llm_engine import InvalidRequestError, LLMEngine
from rayspec.sampling.sampler import MAX_SEED, SamplingParams
from rayspec.sampling.structured import GrammarCompiler, GrammarState, StructuredOutput
from serve_utils import tiny_args

MAX_MODEL_LEN = 1024  # tiny_args's
CHARS = LIMITS.prompt_chars_per_token * MAX_MODEL_LEN
USER = [{"role": "user", "content": "x"}]


def make_ingress(verifier=None, max_model_len: int = MAX_MODEL_LEN):
    ours = ingress_module.OpenAIIngress.func_or_class.__bases__[0]  # our class under serve.ingress's wrapper
    ingress = object.__new__(ours)
    ours.__init__(ingress, tiny_args("/unused/model", engine={"max_model_len": max_model_len}), verifier)
    return ingress


def _error(resp) -> tuple[int, dict]:
    return resp.status_code, json.loads(resp.body)["error"]


def build(route: str, body: dict, max_model_len: int = MAX_MODEL_LEN):
    """What the ingress makes of a body before any RPC: (200, GenerateRequests) or (status, error)."""
    cls = CompletionRequest if route == "completions" else ChatCompletionRequest
    try:
        request = cls.model_validate({"model": "tiny", **body})  # FastAPI's step
        return 200, make_ingress(max_model_len=max_model_len)._to_generate(request)
    except ValidationError as err:  # FastAPI raises it as a RequestValidationError
        return _error(asyncio.run(ingress_module._validation_error(None, RequestValidationError(err.errors()))))
    except OpenAIError as err:
        return _error(ingress_module._error_response(err))


def tool(name: str, description: str | None = None) -> dict:
    return {"type": "function", "function": {"name": name, **({"description": description} if description else {})}}


def padded_tool(size: int) -> dict:
    """A tool whose definition is `size` characters as JSON."""
    bare = len(json.dumps({"name": "f", "description": ""}))
    return tool("f", "x" * (size - bare))


def padded_schema(size: int) -> dict:
    bare = len(json.dumps({"type": "object", "description": ""}))
    return {"type": "object", "description": "x" * (size - bare)}


def padded_choices(size: int) -> list[str]:
    """Two options whose JSON list is `size` characters."""
    bare = len(json.dumps(["", ""]))
    half = (size - bare) // 2
    return ["a" * half, "b" * (size - bare - half)]


def json_schema_format(size: int) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "s", "schema": padded_schema(size)}}


def options(count: int) -> list[str]:
    return [f"c{i}" for i in range(count)]


def split_messages(chars: int) -> list[dict]:
    """A system message and a user message of text parts, `chars` characters of content together."""
    return [{"role": "system", "content": "s" * (chars // 2)},
            {"role": "user", "content": [{"type": "text", "text": "u" * (chars - chars // 2)}]}]


def lark(size: int) -> str:
    bare = len('start: ""')
    return 'start: "' + "x" * (size - bare) + '"'


N_SEED = 4
C, X = LIMITS.max_constraint_chars, LIMITS.max_tool_chars
# (route, body over the limit, the same body at the limit, param, what the message says)
CASES = {
    "stop count": ("completions", {"prompt": "hi", "stop": [f"s{i}" for i in range(LIMITS.max_stop + 1)]},
                   {"prompt": "hi", "stop": [f"s{i}" for i in range(LIMITS.max_stop)]}, "stop",
                   f"at most {LIMITS.max_stop} stop sequences are allowed, got {LIMITS.max_stop + 1}"),
    "stop length": ("chat", {"messages": USER, "stop": "x" * (LIMITS.max_stop_chars + 1)},
                    {"messages": USER, "stop": "x" * LIMITS.max_stop_chars}, "stop",
                    f"at most {LIMITS.max_stop_chars} characters; stop[0] has {LIMITS.max_stop_chars + 1}"),
    "stop_token_ids": ("completions", {"prompt": "hi", "stop_token_ids": list(range(LIMITS.max_stop_token_ids + 1))},
                       {"prompt": "hi", "stop_token_ids": list(range(LIMITS.max_stop_token_ids))}, "stop_token_ids",
                       f"at most {LIMITS.max_stop_token_ids} stop_token_ids"),
    "logit_bias": ("chat", {"messages": USER, "logit_bias": {str(i): 1 for i in range(LIMITS.max_logit_bias + 1)}},
                   {"messages": USER, "logit_bias": {str(i): 1 for i in range(LIMITS.max_logit_bias)}}, "logit_bias",
                   f"at most {LIMITS.max_logit_bias} logit_bias entries are allowed, got {LIMITS.max_logit_bias + 1}"),
    "seed too large": ("completions", {"prompt": "hi", "seed": MAX_SEED + 1}, {"prompt": "hi", "seed": MAX_SEED},
                       "seed", f"between 0 and {MAX_SEED} (2**63 - 1), got {MAX_SEED + 1}"),
    "seed negative": ("chat", {"messages": USER, "seed": -1}, {"messages": USER, "seed": 0}, "seed",
                      "between 0 and"),
    "seed + n - 1": ("completions", {"prompt": "hi", "n": N_SEED, "seed": MAX_SEED - N_SEED + 2},
                     {"prompt": "hi", "n": N_SEED, "seed": MAX_SEED - N_SEED + 1}, "seed",
                     f"the seed may be at most {MAX_SEED - N_SEED + 1}"),
    "n x max_tokens": ("completions", {"prompt": "hi", "n": 64, "max_tokens": LIMITS.max_output_tokens // 64 + 1},
                       {"prompt": "hi", "n": 64, "max_tokens": LIMITS.max_output_tokens // 64}, "max_tokens",
                       f"at most {LIMITS.max_output_tokens} output tokens"),
    "prompts x max_tokens": ("completions", {"prompt": ["a", "b"], "n": 8, "max_tokens": 8193},
                             {"prompt": ["a", "b"], "n": 8, "max_tokens": 8192}, "max_tokens",
                             f"at most {LIMITS.max_output_tokens} output tokens"),
    "n x max_completion_tokens": ("chat", {"messages": USER, "n": 32, "max_completion_tokens": 4097},
                                  {"messages": USER, "n": 32, "max_completion_tokens": 4096}, "max_completion_tokens",
                                  f"= {32 * 4097}"),
    "prompt count": ("completions", {"prompt": ["a"] * (LIMITS.max_choices + 1)},
                     {"prompt": ["a"] * LIMITS.max_choices}, "n", f"at most {LIMITS.max_choices} choices"),
    "prompt characters": ("completions", {"prompt": "x" * (CHARS + 1)}, {"prompt": "x" * CHARS}, "prompt",
                          f"at most {CHARS} are allowed ({LIMITS.prompt_chars_per_token} per token"),
    "prompt tokens": ("completions", {"prompt": [5] * (MAX_MODEL_LEN + 1), "max_tokens": 1},
                      {"prompt": [5] * MAX_MODEL_LEN, "max_tokens": 1}, "prompt", f"at most {MAX_MODEL_LEN}"),
    "message count": ("chat", {"messages": USER * (LIMITS.max_messages + 1)}, {"messages": USER * LIMITS.max_messages},
                      "messages", f"at most {LIMITS.max_messages} messages are allowed"),
    "message characters": ("chat", {"messages": split_messages(CHARS + 1)}, {"messages": split_messages(CHARS)},
                           "messages", f"have {CHARS + 1} characters; at most {CHARS}"),
    "tool count": ("chat", {"messages": USER, "tools": [tool(f"f{i}") for i in range(LIMITS.max_tools + 1)],
                            "tool_choice": "none"},
                   {"messages": USER, "tools": [tool(f"f{i}") for i in range(LIMITS.max_tools)],
                    "tool_choice": "none"},
                   "tools", f"at most {LIMITS.max_tools} tools are allowed, got {LIMITS.max_tools + 1}"),
    "tool size": ("chat", {"messages": USER, "tools": [tool("g"), padded_tool(X + 1)], "tool_choice": "none"},
                  {"messages": USER, "tools": [tool("g"), padded_tool(X)], "tool_choice": "none"}, "tools[1]",
                  f"at most {X} characters as JSON; tools[1] has {X + 1}"),
    "response_format schema": ("chat", {"messages": USER, "response_format": json_schema_format(C + 1)},
                               {"messages": USER, "response_format": json_schema_format(C)},
                               "response_format", f"schema as JSON may have at most {C} characters, got {C + 1}"),
    "guided_json": ("completions", {"prompt": "hi", "guided_json": padded_schema(C + 1)},
                    {"prompt": "hi", "guided_json": json.dumps(padded_schema(C))}, "guided_json",
                    f"at most {C} characters"),
    "guided_regex": ("completions", {"prompt": "hi", "guided_regex": "a" * (C + 1)},
                     {"prompt": "hi", "guided_regex": "a" * C}, "guided_regex",
                     f"guided_regex may have at most {C} characters, got {C + 1}"),
    "guided_grammar": ("chat", {"messages": USER, "guided_grammar": lark(C + 1)},
                       {"messages": USER, "guided_grammar": lark(C)}, "guided_grammar", f"at most {C} characters"),
    "guided_choice count": ("completions", {"prompt": "hi", "guided_choice": options(LIMITS.max_guided_choices + 1)},
                            {"prompt": "hi", "guided_choice": options(LIMITS.max_guided_choices)},
                            "guided_choice", f"at most {LIMITS.max_guided_choices} guided_choice options"),
    "guided_choice characters": ("completions", {"prompt": "hi", "guided_choice": padded_choices(C + 1)},
                                 {"prompt": "hi", "guided_choice": padded_choices(C)}, "guided_choice",
                                 f"(the options together) may have at most {C} characters"),
    "min_tokens over max_model_len": ("chat", {"messages": USER, "min_tokens": MAX_MODEL_LEN + 1},
                                      {"messages": USER, "min_tokens": MAX_MODEL_LEN}, "min_tokens",
                                      f"at most max_model_len ({MAX_MODEL_LEN})"),
    "min_tokens over max_tokens": ("completions", {"prompt": "hi", "max_tokens": 8, "min_tokens": 9},
                                   {"prompt": "hi", "max_tokens": 8, "min_tokens": 8}, "min_tokens",
                                   "at most max_tokens (8)"),
    "logprobs": ("completions", {"prompt": "hi", "logprobs": LIMITS.max_top_logprobs + 1},
                 {"prompt": "hi", "logprobs": LIMITS.max_top_logprobs}, "logprobs",
                 f"less than or equal to {LIMITS.max_top_logprobs}"),
    "top_logprobs": ("chat", {"messages": USER, "logprobs": True, "top_logprobs": LIMITS.max_top_logprobs + 1},
                     {"messages": USER, "logprobs": True, "top_logprobs": LIMITS.max_top_logprobs}, "top_logprobs",
                     f"less than or equal to {LIMITS.max_top_logprobs}"),
    "n": ("chat", {"messages": USER, "n": LIMITS.max_choices + 1, "max_tokens": 1},
          {"messages": USER, "n": LIMITS.max_choices, "max_tokens": 1}, "n",
          f"less than or equal to {LIMITS.max_choices}"),
}


@pytest.mark.parametrize("name", CASES)
def test_past_a_limit_is_a_400_naming_the_field_and_the_limit(name):
    route, over, _, param, needle = CASES[name]
    status, error = build(route, over)
    assert status == 400, error
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    assert error["param"] == param, error
    assert needle in error["message"], error["message"]


@pytest.mark.parametrize("name", CASES)
def test_at_a_limit_is_accepted(name):
    route, _, at, _, _ = CASES[name]
    status, requests = build(route, at)
    assert status == 200, requests
    assert requests and all(isinstance(r, GenerateRequest) for r in requests)


def test_unset_max_tokens_counts_as_max_model_len():
    """Chat without max_tokens can run each choice to max_model_len: that is what the budget counts."""
    long = 4 * LIMITS.max_output_tokens // LIMITS.max_choices  # 64 choices x this: 4x the budget
    status, error = build("chat", {"messages": USER, "n": LIMITS.max_choices}, max_model_len=long)
    assert status == 400 and error["param"] == "max_tokens"
    assert f"max_tokens unset (up to max_model_len, {long}; set max_tokens)" in error["message"]
    status, _ = build("chat", {"messages": USER, "n": LIMITS.max_choices // 4}, max_model_len=long)
    assert status == 200
    status, _ = build("chat", {"messages": USER, "n": LIMITS.max_choices, "max_tokens": long // 4},
                      max_model_len=long)
    assert status == 200


def test_tools_count_toward_the_prompt_and_the_output_constraint():
    """Tools shown to the model count against the prompt's characters; under tool_choice 'required'
    their parameter schemas together are the output constraint, limited like any other."""
    tools = [padded_tool(X // 2) for _ in range(3)]
    for i, t in enumerate(tools):
        t["function"]["name"] = f"f{i}"
    body = {"messages": USER, "tools": tools, "tool_choice": "required"}
    status, error = build("chat", body)  # ~3 x 32K characters of tools: past 32 x 1024
    assert status == 400 and error["param"] == "messages" and "contents, tool calls and tools" in error["message"]
    status, error = build("chat", {**body, "tool_choice": "none"})  # not shown to the model: not counted
    assert status == 200
    big = [tool(f"f{i}") for i in range(4)]
    for t in big:
        t["function"]["parameters"] = padded_schema(C // 4 + 100)
    status, error = build("chat", {"messages": USER, "tools": big, "tool_choice": "required"}, max_model_len=8192)
    assert status == 400 and error["param"] == "tools"
    assert f"the output constraint made from the tools (their parameter schemas, as JSON) may have at most {C}" \
        in error["message"]
    status, _ = build("chat", {"messages": USER, "tools": big[:3], "tool_choice": "required"}, max_model_len=8192)
    assert status == 200


def test_without_max_model_len_its_limits_are_not_checked():
    """The request models alone (no server) check every limit but those stated in max_model_len."""
    assert CompletionRequest(model="m", prompt="x" * (CHARS + 1)).to_generate()
    with pytest.raises(OpenAIError, match="at most 16 stop sequences are allowed, got 10000") as err:
        CompletionRequest(model="m", prompt="hi", stop=["s"] * 10_000).to_generate()
    assert err.value.param == "stop" and err.value.status_code == 400


def test_seeds_are_checked_by_the_engine_too():
    """The handle API and offline engine use skip the OpenAI models: SamplingParams checks the range."""
    for seed in (-1, MAX_SEED + 1, 2**64):
        with pytest.raises(ValueError, match=r"between 0 and 9223372036854775807 \(2\*\*63 - 1\)"):
            SamplingParams(seed=seed)
        with pytest.raises(InvalidRequestError, match="2\\*\\*63 - 1"):
            GenerateRequest(prompt="hi", seed=seed).sampling_params()
    assert SamplingParams(seed=MAX_SEED).seed == MAX_SEED and SamplingParams(seed=0).seed == 0


# ---- grammar compiles ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def hf_tokenizer(smollm2):
    from transformers import AutoTokenizer

    from rayspec.model.weights.hub import resolve_model_dir

    return AutoTokenizer.from_pretrained(str(resolve_model_dir(smollm2)))


def compiler(tokenizer, **kwargs) -> GrammarCompiler:
    return GrammarCompiler(tokenizer, len(tokenizer), {tokenizer.eos_token_id}, **kwargs)


# within every size limit, ~30 ms to compile here: 30x the deadline the tests below give
SLOW = [f"option number {i:04d} of a long list, padded {'z' * 16}" for i in range(LIMITS.max_guided_choices)]
DEADLINE_S = 0.001


def test_a_grammar_past_the_compile_deadline_is_refused(hf_tokenizer):
    assert len(json.dumps(SLOW)) <= LIMITS.max_constraint_chars
    grammars = compiler(hf_tokenizer, compile_timeout_s=DEADLINE_S)
    with pytest.raises(ValueError, match=r"the choice output constraint took longer than 0.001 s to compile"):
        grammars.state(StructuredOutput.choice(SLOW))  # the tokenizer, built first, is not part of the deadline
    grammars.compile_timeout_s = 5.0
    assert isinstance(grammars.state(StructuredOutput.choice(SLOW)), GrammarState)  # in time: compiled


class _GrammarVerifier:
    """A verifier that builds the request's grammar as Verifier._stream does (off its loop, through
    LLMEngine.prepare_grammar) and answers nothing else."""

    def __init__(self, grammars: GrammarCompiler):
        self.engine = SimpleNamespace(_grammars=grammars)
        verifier = self

        class _Generate:
            async def remote(self, request):
                params = request.sampling_params()
                await asyncio.to_thread(LLMEngine.prepare_grammar, verifier.engine, params.structured)
                raise AssertionError("the grammar should have been refused")

        class _Chunks:  # what a streaming handle call returns: an async iterator that can be cancelled
            def __init__(self, request):
                self.request = request

            async def __anext__(self):
                await _Generate().remote(self.request)

            def cancel(self):
                pass

        class _Stream:
            def remote(self, request):
                return _Chunks(request)

        self.generate, self.generate_stream = _Generate(), _Stream()

    def options(self, **_):
        return self


@pytest.mark.parametrize("stream", [False, True])
def test_a_slow_grammar_is_a_400_naming_its_field(hf_tokenizer, stream):
    ingress = make_ingress(_GrammarVerifier(compiler(hf_tokenizer, compile_timeout_s=DEADLINE_S)))
    body = CompletionRequest(model="tiny", prompt="hi", stream=stream, guided_choice=SLOW)
    with pytest.raises(OpenAIError) as err:
        asyncio.run(ingress.completions(body))
    assert err.value.status_code == 400 and err.value.param == "guided_choice"
    assert "took longer than 0.001 s to compile" in err.value.message
    # a tool-call constraint the verifier cannot compile names the tools
    chat = ChatCompletionRequest(model="tiny", messages=USER, tool_choice="required", stream=stream,
                                 tools=[{"type": "function", "function": {"name": "f", "parameters": {"type": "wat"}}}])
    ingress = make_ingress(_GrammarVerifier(compiler(hf_tokenizer)))
    with pytest.raises(OpenAIError) as err:
        asyncio.run(ingress.chat_completions(chat))
    assert err.value.status_code == 400 and err.value.param == "tools" and "invalid json" in err.value.message


def test_deeply_nested_grammar_within_the_size_limit_compiles(hf_tokenizer):
    """A chain of rules nests llguidance's grammar build one stack frame per rule; ~3,000 overflowed a
    default 8 MiB thread stack and killed the process (a segfault). Compiles get a thread with a
    large stack: a chain as deep as the size limit allows compiles (or fails cleanly)."""
    depth = 3_900
    text = "start: a0\n" + "".join(f'a{i}: a{i + 1} "x"\n' for i in range(depth)) + f'a{depth}: "z"'
    assert len(text) <= LIMITS.max_constraint_chars
    state = compiler(hf_tokenizer).state(StructuredOutput("grammar", text))
    assert isinstance(state, GrammarState) and not state.matcher.is_error()


# ---- hardening, third round (issue #51): inputs that raised where they should be a 400 -----------

def test_a_logit_bias_key_of_thousands_of_digits_is_a_400():
    """int() refuses strings of more than ~4,300 digits (ValueError, a 500 before): no token id has
    more than a dozen, so the key is refused as not a token id, and not echoed whole."""
    status, error = build("completions", {"prompt": "hi", "logit_bias": {"9" * 5000: 1}})
    assert status == 400 and error["param"] == "logit_bias", error
    assert len(error["message"]) < 200
    assert build("completions", {"prompt": "hi", "logit_bias": {"123": 1}})[0] == 200


@pytest.mark.parametrize("field", ["guided_json", "structured_outputs", "response_format"])
def test_a_schema_nested_past_the_parser_is_a_400(field):
    """A JSON schema sent as a string of a thousand '[' made json.loads raise RecursionError (a 500). Nested
    past this process's recursion limit, whatever it is: importing torch._dynamo raises it (to 2,000+), and
    with the engine tests' compiles run first in the worker a thousand '[' parsed to a JSONDecodeError."""
    import sys

    text = "[" * (sys.getrecursionlimit() + 1000)
    body = {"guided_json": text, "structured_outputs": {"json": text},
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": text}}}
    status, error = build("completions" if field != "response_format" else "chat",
                          {"prompt": "hi", field: body[field]} if field != "response_format"
                          else {"messages": USER, field: body[field]})
    assert status == 400, error
    if field != "response_format":  # (a schema string is refused there by its type already)
        assert "nested too deeply" in error["message"], error


def test_a_tool_messages_id_and_name_count_toward_the_prompt():
    """The chat template writes a tool message's tool_call_id and name into the prompt: they count."""
    long = "x" * (MAX_MODEL_LEN * LIMITS.prompt_chars_per_token)
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    messages = USER + [{"role": "assistant", "content": "", "tool_calls": [call]},
                       {"role": "tool", "tool_call_id": long, "name": "f", "content": "ok"}]
    status, error = build("chat", {"messages": messages})
    assert status == 400 and error["param"] == "messages", error
    messages[-1]["tool_call_id"] = "c1"
    assert build("chat", {"messages": messages})[0] == 200
    messages[-1]["tool_call_id"] = {"nested": "object"}
    assert build("chat", {"messages": messages})[0] == 400


def test_abandoned_grammar_compiles_are_capped(hf_tokenizer, monkeypatch):
    """A compile past its deadline is abandoned but runs on (issue #51: uncapped): at most
    MAX_COMPILES run at once, abandoned ones included; past that a new grammar is refused as busy
    (a 429 through LLMEngine.prepare_grammar), and once they end compiles are taken again. (The
    compiles are held by the test, so the count does not depend on how fast this machine is.)"""
    import threading
    import time

    import rayspec.sampling.structured as structured
    from rayspec.engine.outputs import EngineOverloadedError
    from rayspec.sampling.structured import MAX_COMPILES, GrammarCompilerBusy

    release, real = threading.Event(), structured._compile

    def held(tokenizer, grammar, kind):
        release.wait(60)
        return real(tokenizer, grammar, kind)

    monkeypatch.setattr(structured, "_compile", held)
    grammars = compiler(hf_tokenizer, compile_timeout_s=DEADLINE_S)
    for i in range(MAX_COMPILES):
        with pytest.raises(ValueError, match="took longer than"):
            grammars.state(StructuredOutput.choice(["yes", f"variant {i}"]))
    with pytest.raises(GrammarCompilerBusy):
        grammars.state(StructuredOutput.choice(["yes", "no"]))
    with pytest.raises(EngineOverloadedError) as busy:
        LLMEngine.prepare_grammar(SimpleNamespace(_grammars=grammars), StructuredOutput.choice(["yes", "no"]))
    error = ingress_module._as_openai_error(busy.value, retry_after_s=2)  # says why, not "the queue is full"
    assert error.status_code == 429 and "compile an output constraint" in error.message, error.message
    release.set()
    grammars.compile_timeout_s = 30.0
    deadline = time.monotonic() + 30
    while True:  # the abandoned ones end on their own threads
        try:
            assert isinstance(grammars.state(StructuredOutput.choice(["yes", "no"])), GrammarState)
            break
        except GrammarCompilerBusy:
            assert time.monotonic() < deadline, "the abandoned compiles never ended"
            time.sleep(0.01)


def test_tenants_never_share_cached_prefixes():
    """With tenant_header, each tenant's requests salt their prefix cache apart (a cached prompt's
    timing would tell one tenant another's prompts), whatever cache_salt they send; without it
    nothing changes."""
    from starlette.requests import Request

    def http(tenant: str | None) -> Request:
        headers = [(b"x-tenant-id", tenant.encode())] if tenant is not None else []
        return Request({"type": "http", "method": "POST", "path": "/v1/completions", "headers": headers})

    ingress = make_ingress()
    body = CompletionRequest.model_validate({"model": "tiny", "prompt": "hi"})
    assert ingress._choice_requests(body, http("a"))[0].cache_salt is None  # no tenant_header: as before
    ingress.cfg = ingress.cfg.model_copy(update={"tenant_header": "x-tenant-id"})
    salts = {t: ingress._choice_requests(body, http(t))[0].cache_salt for t in ("a", "b", None)}
    assert len(set(salts.values())) == 3 and all(s.startswith("tenant:") for s in salts.values())
    assert ingress._choice_requests(body, http("a"))[0].cache_salt == salts["a"]  # stable per tenant
    forged = CompletionRequest.model_validate({"model": "tiny", "prompt": "hi", "cache_salt": salts["a"]})
    assert ingress._choice_requests(forged, http("b"))[0].cache_salt not in (salts["a"], salts["b"])


def test_identical_grammars_compile_once_and_share_no_state(hf_tokenizer, monkeypatch):
    """An n>1 request fans out one verifier call per choice, each building the same grammar at once:
    with a compile per call, n > MAX_COMPILES was refused as busy (a 429 on an idle server, seen in
    CI as test_mixed_concurrent_load's flake). Calls for a grammar that is compiling wait for that
    compile; later ones copy the kept result. Each caller's state is its own."""
    import threading

    import rayspec.sampling.structured as structured
    from rayspec.sampling.structured import MAX_COMPILES

    release, real, calls = threading.Event(), structured._compile, []

    def held(tokenizer, grammar, kind):
        calls.append(grammar)
        release.wait(60)
        return real(tokenizer, grammar, kind)

    monkeypatch.setattr(structured, "_compile", held)
    grammars = compiler(hf_tokenizer, compile_timeout_s=30.0)
    spec = StructuredOutput("regex", "[a-z]{3,6}")
    with concurrent.futures.ThreadPoolExecutor(2 * MAX_COMPILES + 1) as pool:
        futures = [pool.submit(grammars.state, spec) for _ in range(2 * MAX_COMPILES)]
        other = pool.submit(grammars.state, StructuredOutput.choice(["yes", "no"]))  # a place is still free
        wait_until = time.monotonic() + 30
        while len(calls) < 2 and time.monotonic() < wait_until:
            time.sleep(0.01)
        release.set()
        states = [f.result(timeout=60) for f in futures]
        assert isinstance(other.result(timeout=60), GrammarState)
    assert len(calls) == 2 and grammars.num_compiled == 2, calls
    # (a pooled call that reached the compiler only after the compile ended copied the kept result too: on a
    # loaded machine one did, in CI)
    reused = grammars.num_reused
    states.append(grammars.state(spec))  # kept: copied, not compiled again
    assert len(calls) == 2 and grammars.num_reused == reused + 1
    assert len({id(s.matcher) for s in states}) == len(states)
    token = hf_tokenizer.encode("abc", add_special_tokens=False)[0]
    fresh = states[1].matcher.compute_bitmask()
    assert states[0].accept(token)  # one caller advances ...
    assert states[0].matcher.compute_bitmask() != fresh
    assert states[1].matcher.compute_bitmask() == fresh  # ... the others do not move
    assert states[-1].matcher.compute_bitmask() == fresh


def test_kept_grammars_are_bounded(hf_tokenizer):
    grammars = compiler(hf_tokenizer, cache_size=2)
    specs = [StructuredOutput.choice(["yes", f"no {i}"]) for i in range(3)]
    for spec in specs:
        grammars.state(spec)
    grammars.state(specs[2])
    grammars.state(specs[1])
    assert (grammars.num_compiled, grammars.num_reused) == (3, 2)
    grammars.state(specs[0])  # the least recently used was dropped: compiled again
    assert (grammars.num_compiled, grammars.num_reused) == (4, 2)
