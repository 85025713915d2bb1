"""OpenAI request models (the subset rayspec serves) and the error shape."""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from deployments.protocol import GenerateRequest
from rayspec.structured import StructuredOutput
from rayspec.logprobs import MAX_TOP_LOGPROBS, TokenLogprob
from rayspec.tools import call_schema, parse_calls

MAX_CHOICES = 64  # n times the number of prompts, per request


class OpenAIError(Exception):
    def __init__(self, message: str, status_code: int = 400, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.message, self.status_code, self.type, self.param, self.code = message, status_code, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Common(BaseModel):
    model_config = ConfigDict(extra="allow")  # unknown fields are ignored, like OpenAI-compatible servers do
    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = Field(1, ge=1, le=MAX_CHOICES)
    user: str | None = None
    presence_penalty: float | None = Field(0.0, ge=-2, le=2)
    frequency_penalty: float | None = Field(0.0, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None  # token id (as a string) -> bias in [-100, 100]
    # extensions
    top_k: int | None = Field(None, ge=-1)
    repetition_penalty: float | None = Field(None, gt=0)
    min_tokens: int = Field(0, ge=0)  # vLLM's: no EOS / stop token before this many (genai-perf sends it)
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    # structured output: OpenAI's response_format (json_object, json_schema), or one of vLLM's
    # guided_* extensions
    response_format: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None  # Lark
    num_speculative_tokens: int | None = Field(None, ge=0)
    ignore_eos: bool = False

    def check_supported(self) -> None:
        for key, bias in (self.logit_bias or {}).items():
            if not key.strip().isdigit():
                raise OpenAIError(f"logit_bias keys must be token ids; got {key!r}", param="logit_bias")
            if not -100 <= bias <= 100:
                raise OpenAIError("logit_bias values must be between -100 and 100", param="logit_bias")
        if self.stream_options is not None and not self.stream:
            raise OpenAIError("stream_options needs stream=true", param="stream_options")

    def structured(self) -> dict[str, str] | None:
        """The output constraint asked for, as GenerateRequest.structured (at most one)."""
        asked = []
        fmt = self.response_format
        if fmt is not None:
            kind = fmt.get("type") if isinstance(fmt, dict) else None
            if kind == "json_object":
                asked.append(("response_format", StructuredOutput.json_schema({"type": "object"})))
            elif kind == "json_schema":
                schema = (fmt.get("json_schema") or {}).get("schema")
                if not isinstance(schema, dict):
                    raise OpenAIError("response_format json_schema needs json_schema.schema (an object)",
                                      param="response_format")
                asked.append(("response_format", StructuredOutput.json_schema(schema)))
            elif kind != "text":
                raise OpenAIError("response_format type must be text, json_object or json_schema",
                                  param="response_format")
        if self.guided_json is not None:
            asked.append(("guided_json", StructuredOutput.json_schema(self.guided_json)))
        if self.guided_regex is not None:
            asked.append(("guided_regex", StructuredOutput("regex", self.guided_regex)))
        if self.guided_choice is not None:
            asked.append(("guided_choice", StructuredOutput.choice(self.guided_choice)))
        if self.guided_grammar is not None:
            asked.append(("guided_grammar", StructuredOutput("grammar", self.guided_grammar)))
        asked += self._tool_constraint()
        if len(asked) > 1:
            raise OpenAIError(f"give one output constraint, not {', '.join(name for name, _ in asked)}",
                              param=asked[1][0])
        if not asked:
            return None
        name, spec = asked[0]
        try:
            spec.grammar_text()  # a malformed schema, an empty choice list: 400 before any RPC
        except ValueError as err:
            raise OpenAIError(str(err), param=name) from None
        return {"kind": spec.kind, "value": spec.value}

    def _tool_constraint(self) -> list[tuple[str, StructuredOutput]]:
        return []

    def _generate(self, max_tokens: int | None, logprobs: int | None, **prompt_and_extra) -> GenerateRequest:
        return GenerateRequest(
            max_tokens=max_tokens, temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p, top_k=self.top_k or 0, stop=self.stop, seed=self.seed,
            ignore_eos=self.ignore_eos, num_speculative_tokens=self.num_speculative_tokens, logprobs=logprobs,
            min_tokens=self.min_tokens, stop_token_ids=list(self.stop_token_ids or []),
            include_stop_str_in_output=self.include_stop_str_in_output,
            presence_penalty=self.presence_penalty or 0.0, frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=self.repetition_penalty or 1.0,
            logit_bias={int(k): v for k, v in self.logit_bias.items()} if self.logit_bias else None,
            structured=self.structured(), **prompt_and_extra)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Common):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(16, ge=0)  # 0 with echo: score the prompt only
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    def to_generate(self) -> list[GenerateRequest]:
        """One request per prompt (a batched prompt list gives several; `n` is the caller's)."""
        self.check_supported()
        if self.max_tokens == 0 and not self.echo:
            raise OpenAIError("max_tokens 0 needs echo (scoring the prompt)", param="max_tokens")
        for name, bad in (("best_of", self.best_of not in (None, 1, self.n)),
                          ("suffix", self.suffix is not None)):
            if bad:
                raise OpenAIError(f"{name} is not supported", param=name)
        prompts = self.prompt
        if not (isinstance(prompts, list) and prompts and isinstance(prompts[0], (str, list))):
            prompts = [prompts]
        if len(prompts) * self.n > MAX_CHOICES:
            raise OpenAIError(f"at most {MAX_CHOICES} choices (prompts x n) per request", param="n")
        for i, prompt in enumerate(prompts):
            if not prompt:
                raise OpenAIError("the prompt is empty" if len(prompts) == 1 else f"prompt {i} is empty",
                                  param="prompt")
        # max_tokens 0: the engine makes one token (free: it comes out of the prefill), not returned
        max_tokens = None if self.max_tokens is None else max(1, self.max_tokens)
        prompt_logprobs = self.logprobs if self.echo else None
        return [self._generate(max_tokens, self.logprobs, prompt=p, prompt_logprobs=prompt_logprobs,
                               echo_prompt=self.echo) for p in prompts]

    @property
    def prompt_only(self) -> bool:
        return self.max_tokens == 0


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # tool_calls (assistant), tool_call_id (tool), name
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None


class FunctionDefinition(BaseModel):
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments
    strict: bool | None = None  # the output always follows `parameters` here


class ToolDefinition(BaseModel):
    type: Literal["function"]
    function: FunctionDefinition


@dataclass(frozen=True)
class ToolCallMode:
    """What a request's output must be: `name`'s arguments, or (name None) a list of calls to any tool."""

    name: str | None
    parallel: bool


AUTO_TOOLS = ("tool_choice 'auto' (the default when tools are given) needs a tool-call parser for the model's "
              "own call format, which rayspec does not have; send tool_choice 'required' or "
              "{\"type\": \"function\", \"function\": {\"name\": ...}} (the output is then constrained to a valid "
              "call), or 'none'")


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[ToolDefinition] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool = True
    functions: list[Any] | None = None

    def tool_call(self) -> ToolCallMode | None:
        """How the output must call a tool, or None for a plain message (400 for what is not served)."""
        if self.functions:
            raise OpenAIError("functions (deprecated) is not supported; send tools", param="functions")
        choice = self.tool_choice if self.tool_choice is not None else ("auto" if self.tools else "none")
        if choice == "none":
            return None
        if not self.tools:
            raise OpenAIError("tool_choice needs tools", param="tool_choice")
        if choice == "auto":
            raise OpenAIError(AUTO_TOOLS, param="tool_choice")
        if choice == "required":
            return ToolCallMode(None, self.parallel_tool_calls)
        name = (choice.get("function") or {}).get("name") if isinstance(choice, dict) else None
        if not (isinstance(choice, dict) and choice.get("type") == "function" and isinstance(name, str)):
            raise OpenAIError("tool_choice must be 'none', 'auto', 'required' or "
                              "{\"type\": \"function\", \"function\": {\"name\": ...}}", param="tool_choice")
        if name not in {t.function.name for t in self.tools}:
            raise OpenAIError(f"tool_choice names {name!r}, which is not among the tools", param="tool_choice")
        return ToolCallMode(name, False)

    def _tool_functions(self) -> list[dict]:
        return [t.function.model_dump(exclude_none=True, exclude={"strict"}) for t in self.tools or ()]

    def _tool_constraint(self) -> list[tuple[str, StructuredOutput]]:
        mode = self.tool_call()
        if mode is None:
            return []
        return [("tool_choice", StructuredOutput.json_schema(call_schema(self._tool_functions(), mode.name,
                                                                          mode.parallel)))]

    def to_generate(self) -> list[GenerateRequest]:
        self.check_supported()
        if self.top_logprobs and not self.logprobs:
            raise OpenAIError("top_logprobs needs logprobs=true", param="top_logprobs")
        messages = []
        for i, m in enumerate(self.messages):
            content = m.content
            if isinstance(content, list):
                if any(part.get("type") != "text" for part in content):
                    raise OpenAIError("only text content parts are supported", param=f"messages[{i}].content")
                content = "".join(str(part.get("text", "")) for part in content)
            message = {"role": "system" if m.role == "developer" else m.role, "content": content or ""}
            extra = m.model_extra or {}
            if m.role == "assistant" and extra.get("tool_calls"):
                calls = extra["tool_calls"]
                if not (isinstance(calls, list) and all(isinstance(c, dict) and isinstance(c.get("function"), dict)
                                                        and "name" in c["function"] for c in calls)):
                    raise OpenAIError("tool_calls entries need function.name and function.arguments",
                                      param=f"messages[{i}].tool_calls")
                message["tool_calls"] = calls
            if m.role == "tool":
                message.update({k: extra[k] for k in ("tool_call_id", "name") if k in extra})
            messages.append(message)
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        tools = self._tool_functions() if self.tool_call() is not None else None  # 'none': the model is not told
        return [self._generate(self.max_completion_tokens or self.max_tokens, logprobs, messages=messages,
                               tools=tools)]


def _call_entry(index: int, name: str, arguments: str) -> dict:
    return {"index": index, "id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
            "function": {"name": name, "arguments": arguments}}


def tool_call_message(text: str, mode: ToolCallMode, reason: str | None) -> tuple[dict, str | None]:
    """The assistant message and finish_reason of an output made under a tool-call constraint."""
    calls = parse_calls(text, mode.name)
    if calls is None:
        if mode.name is None:  # cut short by max_tokens: no whole call to return
            return {"role": "assistant", "content": text}, finish_reason(reason)
        calls = [(mode.name, text)]  # a named call's arguments so far, as OpenAI returns them
    message = {"role": "assistant", "content": None,
               "tool_calls": [{k: v for k, v in _call_entry(i, n, a).items() if k != "index"}
                              for i, (n, a) in enumerate(calls)]}
    # OpenAI: a forced named call ends with "stop"; calls the model chose end with "tool_calls"
    return message, finish_reason(reason) if mode.name is not None or reason == "length" else "tool_calls"


class ToolCallStream:
    """Turns one choice's streamed text into tool-call deltas: a named call streams its arguments
    as they come; a list of calls is sent whole once it is complete (it is parsed then)."""

    def __init__(self, mode: ToolCallMode):
        self.mode, self.text, self.started = mode, "", False

    def delta(self, delta_text: str, finished: bool, reason: str | None) -> tuple[dict, str | None]:
        self.text += delta_text
        if self.mode.name is not None:
            entry = {"index": 0, "function": {"arguments": delta_text}}
            if not self.started:
                entry = _call_entry(0, self.mode.name, delta_text)
                self.started = True
            delta = {"tool_calls": [entry]} if delta_text or entry.get("id") else {}
            return delta, finish_reason(reason) if finished else None
        if not finished:
            return {}, None
        message, reason = tool_call_message(self.text, self.mode, reason)
        if message["content"] is not None:
            return {"content": message["content"]}, reason
        calls = parse_calls(self.text, None)
        return {"tool_calls": [_call_entry(i, n, a) for i, (n, a) in enumerate(calls)]}, reason


def completion_logprobs(entries: list[TokenLogprob | None], text_offset: int = 0) -> dict:
    """The legacy completions `logprobs` block for these tokens, text offsets from `text_offset`."""
    out: dict[str, list] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for e in entries:
        if e is None:  # a token generated before a failover, reported then
            continue
        out["tokens"].append(e.token)
        out["token_logprobs"].append(e.logprob)
        if e.logprob is None:  # an echoed prompt's first token
            out["top_logprobs"].append(None)
        else:
            top = {text: lp for _, text, lp in e.top}
            top.setdefault(e.token, e.logprob)  # OpenAI: the sampled token is always there
            out["top_logprobs"].append(top)
        out["text_offset"].append(text_offset)
        text_offset += len(e.token)
    return out


def _chat_entry(token: str, logprob: float) -> dict:
    return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}


def chat_logprobs(entries: list[TokenLogprob | None]) -> dict:
    """The chat `logprobs` block: one content entry per token with its top alternatives."""
    return {"content": [dict(_chat_entry(e.token, e.logprob), top_logprobs=[_chat_entry(t, lp) for _, t, lp in e.top])
                        for e in entries if e is not None],
            "refusal": None}


def finish_reason(reason: str | None) -> str | None:
    if reason is None:
        return None
    return "length" if reason == "length" else "stop"


def sum_usage(parts: list[tuple[int, int, int, int]]) -> dict:
    """Usage over choices: parts of (prompt counted once per prompt, output, drafts, accepted)."""
    return usage(*(sum(col) for col in zip(*parts)))


def usage(num_prompt: int, num_output: int, num_draft: int, num_accepted: int) -> dict:
    return {"prompt_tokens": num_prompt, "completion_tokens": num_output, "total_tokens": num_prompt + num_output,
            "completion_tokens_details": {"accepted_prediction_tokens": num_accepted,
                                          "rejected_prediction_tokens": num_draft - num_accepted}}


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())
