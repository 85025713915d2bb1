"""OpenAI request models, the subset rayspec serves: completions, chat completions (messages, tools,
output constraints), vLLM's tokenize and detokenize; each validated against LIMITS and turned into
the verifier's GenerateRequests."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from deployments.frontend.openai_limits import LIMITS, MAX_CHOICES, OpenAIError, at_most
from deployments.transport.protocol import GenerateRequest
from rayspec.sampling.logprobs import MAX_TOP_LOGPROBS
from rayspec.sampling.structured import StructuredOutput
from rayspec.sampling.tools import call_schema


class StreamOptions(BaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: every chunk carries the usage so far


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs`: one output constraint, mapped onto the same StructuredOutput as
    response_format and the guided_* fields. Unknown keys are a 400 (nothing is silently ignored)."""

    model_config = ConfigDict(extra="forbid")
    json_schema: dict[str, Any] | str | None = Field(None, alias="json")  # a JSON schema
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # Lark, as guided_grammar
    json_object: bool | None = None

    def constraint(self) -> StructuredOutput:
        given = [k for k in ("json_schema", "regex", "choice", "grammar") if getattr(self, k) is not None]
        if self.json_object:
            given.append("json_object")
        if len(given) != 1:
            names = ", ".join("json" if k == "json_schema" else k for k in given) or "none"
            raise OpenAIError("structured_outputs takes exactly one of json, regex, choice, grammar, json_object: "
                              f"true; got {names}", param="structured_outputs")
        kind = given[0]
        if kind == "json_object":
            return StructuredOutput.json_schema({"type": "object"})
        if kind == "json_schema":
            return StructuredOutput.json_schema(self.json_schema)
        if kind == "choice":
            at_most(len(self.choice), LIMITS.max_guided_choices, "structured_outputs.choice options",
                     "structured_outputs")
            return StructuredOutput.choice(self.choice)
        return StructuredOutput(kind, getattr(self, kind))


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
    structured_outputs: StructuredOutputs | None = None  # vLLM's current field (one of the above)
    num_speculative_tokens: int | None = Field(None, ge=0)
    ignore_eos: bool = False
    # vLLM's: each choice also carries the token ids of its output (`token_ids`; streamed: each
    # chunk's), which its text alone may not give back (a token's bytes can split a character)
    return_token_ids: bool = False
    # vLLM's: prompt blocks are cached and found again only among requests with the same salt
    cache_salt: str | None = Field(None, min_length=1, max_length=1024)

    def check_limits(self, num_prompts: int, max_model_len: int | None) -> None:
        """The per-request limits (LIMITS) of the fields both routes share; max_model_len None: the
        limits stated in terms of it are not checked."""
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        at_most(len(stop), LIMITS.max_stop, "stop sequences", "stop")
        for i, text in enumerate(stop):
            if len(text) > LIMITS.max_stop_chars:
                raise OpenAIError(f"a stop sequence may have at most {LIMITS.max_stop_chars} characters; "
                                  f"stop[{i}] has {len(text)}", param="stop")
        at_most(len(self.stop_token_ids or ()), LIMITS.max_stop_token_ids, "stop_token_ids", "stop_token_ids")
        at_most(len(self.logit_bias or {}), LIMITS.max_logit_bias, "logit_bias entries", "logit_bias")
        if self.seed is not None:
            if not 0 <= self.seed <= LIMITS.max_seed:
                raise OpenAIError(f"seed must be between 0 and {LIMITS.max_seed} (2**63 - 1), got {self.seed}",
                                  param="seed")
            if self.seed + self.n - 1 > LIMITS.max_seed:  # choice i samples with seed + i
                raise OpenAIError(f"with n={self.n} the choices use seeds {self.seed} to {self.seed} + {self.n - 1}, "
                                  f"past {LIMITS.max_seed} (2**63 - 1); the seed may be at most "
                                  f"{LIMITS.max_seed - self.n + 1}", param="seed")
        max_tokens, param = self._max_tokens()
        per_choice = max_tokens if max_tokens is not None else max_model_len
        choices = num_prompts * self.n
        if per_choice is not None and choices * per_choice > LIMITS.max_output_tokens:
            each = f"{param} {per_choice}" if max_tokens is not None else \
                f"{param} unset (up to max_model_len, {per_choice}; set {param})"
            raise OpenAIError(f"at most {LIMITS.max_output_tokens} output tokens are allowed per request "
                              f"(choices x {param}), got {choices} choice(s) x {each} = {choices * per_choice}",
                              param=param)
        if max_tokens is not None and self.min_tokens > max_tokens:
            raise OpenAIError(f"min_tokens ({self.min_tokens}) may be at most {param} ({max_tokens})",
                              param="min_tokens")
        if max_tokens is None and max_model_len is not None and self.min_tokens > max_model_len:
            raise OpenAIError(f"min_tokens ({self.min_tokens}) may be at most max_model_len ({max_model_len})",
                              param="min_tokens")

    def _max_tokens(self) -> tuple[int | None, str]:
        """Each choice's max_tokens as sent to the engine (None: until max_model_len), and its field."""
        return self.max_tokens, "max_tokens"

    def _prompt_chars_limit(self, max_model_len: int | None) -> int | None:
        return None if max_model_len is None else LIMITS.prompt_chars_per_token * max_model_len

    def check_supported(self) -> None:
        for key, bias in (self.logit_bias or {}).items():
            # ("²".isdigit(), but not an int; past ~4,300 digits int() raises; no vocabulary has 10**12 ids)
            if not (key.strip().isascii() and key.strip().isdigit() and len(key.strip()) <= 12):
                raise OpenAIError(f"logit_bias keys must be token ids; got {key[:40]!r}", param="logit_bias")
            if not -100 <= bias <= 100:
                raise OpenAIError("logit_bias values must be between -100 and 100", param="logit_bias")
        if self.stream_options is not None and not self.stream:
            raise OpenAIError("stream_options needs stream=true", param="stream_options")

    def structured(self) -> dict[str, str] | None:
        """The output constraint asked for, as GenerateRequest.structured (at most one)."""
        asked = []
        if self.guided_choice is not None:
            at_most(len(self.guided_choice), LIMITS.max_guided_choices, "guided_choice options", "guided_choice")
        fmt = self.response_format
        if fmt is not None:
            kind = fmt.get("type") if isinstance(fmt, dict) else None
            if kind == "json_object":
                asked.append(("response_format", StructuredOutput.json_schema({"type": "object"})))
            elif kind == "json_schema":
                spec = fmt.get("json_schema")
                schema = spec.get("schema") if isinstance(spec, dict) else None
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
        if self.structured_outputs is not None:
            asked.append(("structured_outputs", self.structured_outputs.constraint()))
        asked += self._tool_constraint()
        if len(asked) > 1:
            raise OpenAIError(f"give one output constraint, not {', '.join(name for name, _ in asked)}",
                              param=asked[1][0])
        if not asked:
            return None
        name, spec = asked[0]
        if len(spec.value) > LIMITS.max_constraint_chars:  # before anything parses or compiles it
            what = {"json": f"{name}'s schema as JSON", "choice": f"{name} as JSON (the options together)"
                    }.get(spec.kind, name)
            if name == "tool_choice":
                what = "the output constraint made from the tools (their parameter schemas, as JSON)"
            raise OpenAIError(f"{what} may have at most {LIMITS.max_constraint_chars} characters, "
                              f"got {len(spec.value)}", param="tools" if name == "tool_choice" else name)
        try:
            spec.grammar_text()  # a malformed schema, an empty choice list: 400 before any RPC
        except ValueError as err:
            raise OpenAIError(str(err), param=name) from None
        return {"kind": spec.kind, "value": spec.value}

    def constraint_field(self) -> str | None:
        """The field the output constraint comes from (None: unconstrained): the `param` of a 400 for
        a grammar the verifier cannot compile. to_generate checks there is at most one."""
        fmt = self.response_format
        if isinstance(fmt, dict) and fmt.get("type") in ("json_object", "json_schema"):
            return "response_format"
        return next((name for name in ("guided_json", "guided_regex", "guided_choice", "guided_grammar",
                                       "structured_outputs") if getattr(self, name) is not None), None)

    def _tool_constraint(self) -> list[tuple[str, StructuredOutput]]:
        return []

    def _generate(self, max_tokens: int | None, logprobs: int | None, structured: dict | None,
                  **prompt_and_extra) -> GenerateRequest:
        return GenerateRequest(
            max_tokens=max_tokens, temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p, top_k=self.top_k or 0, stop=self.stop, seed=self.seed,
            ignore_eos=self.ignore_eos, num_speculative_tokens=self.num_speculative_tokens, logprobs=logprobs,
            cache_salt=self.cache_salt,
            min_tokens=self.min_tokens, stop_token_ids=list(self.stop_token_ids or []),
            include_stop_str_in_output=self.include_stop_str_in_output,
            presence_penalty=self.presence_penalty or 0.0, frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=self.repetition_penalty or 1.0,
            logit_bias={int(k): v for k, v in self.logit_bias.items()} if self.logit_bias else None,
            structured=structured, **prompt_and_extra)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.continuous_usage_stats)


class CompletionRequest(_Common):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(16, ge=0)  # 0 with echo: score the prompt only
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    def _max_tokens(self) -> tuple[int | None, str]:
        # max_tokens 0: the engine makes one token (free: it comes out of the prefill), not returned
        return (None if self.max_tokens is None else max(1, self.max_tokens)), "max_tokens"

    def to_generate(self, max_model_len: int | None = None) -> list[GenerateRequest]:
        """One request per prompt (a batched prompt list gives several; `n` is the caller's).
        max_model_len: the server's, for the limits stated in terms of it (LIMITS)."""
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
            raise OpenAIError(f"at most {MAX_CHOICES} choices (prompts x n) per request, got {len(prompts)} "
                              f"prompt(s) x n={self.n}", param="n")
        self.check_limits(len(prompts), max_model_len)
        self.check_supported()
        chars_limit = self._prompt_chars_limit(max_model_len)
        for i, prompt in enumerate(prompts):
            which = "the prompt" if len(prompts) == 1 else f"prompt {i}"
            if not prompt:
                raise OpenAIError(f"{which} is empty", param="prompt")
            if isinstance(prompt, str) and chars_limit is not None and len(prompt) > chars_limit:
                raise OpenAIError(f"{which} has {len(prompt)} characters; at most {chars_limit} are allowed "
                                  f"({LIMITS.prompt_chars_per_token} per token of max_model_len {max_model_len})",
                                  param="prompt")
            if isinstance(prompt, list) and max_model_len is not None and len(prompt) > max_model_len:
                raise OpenAIError(f"{which} has {len(prompt)} tokens; this model serves at most {max_model_len} "
                                  "in all", param="prompt")
        max_tokens, _ = self._max_tokens()
        prompt_logprobs = self.logprobs if self.echo else None
        structured = self.structured()  # once for all prompts
        return [self._generate(max_tokens, self.logprobs, structured, prompt=p, prompt_logprobs=prompt_logprobs,
                               echo_prompt=self.echo) for p in prompts]

    @property
    def prompt_only(self) -> bool:
        return self.max_tokens == 0


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")  # tool_calls (assistant), tool_call_id (tool), name
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None


def chat_template_messages(chat: list[ChatMessage]) -> tuple[list[dict], int]:
    """The messages as the chat template takes them (validated: a 400 otherwise), and their
    characters (contents and earlier tool calls)."""
    messages = []
    chars = 0
    for i, m in enumerate(chat):
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
            chars += len(json.dumps(calls))
        if m.role == "tool":
            fields = {k: extra[k] for k in ("tool_call_id", "name") if k in extra}
            if any(not isinstance(v, str) for v in fields.values()):
                raise OpenAIError("a tool message's tool_call_id and name must be strings", param=f"messages[{i}]")
            message.update(fields)
            chars += sum(len(v) for v in fields.values())  # (the template writes them into the prompt)
        chars += len(message["content"])
        messages.append(message)
    return messages, chars


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
    """What a request's output must be: `name`'s arguments, or (name None) a list of calls to any tool;
    auto: whatever the model writes, calls read out of it by a tool-call parser (rayspec.sampling.tool_parsers)."""

    name: str | None
    parallel: bool
    auto: bool = False


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
            return ToolCallMode(None, self.parallel_tool_calls, auto=True)
        if choice == "required":
            return ToolCallMode(None, self.parallel_tool_calls)
        function = choice.get("function") if isinstance(choice, dict) else None
        name = function.get("name") if isinstance(function, dict) else None
        if not (isinstance(choice, dict) and choice.get("type") == "function" and isinstance(name, str)):
            raise OpenAIError("tool_choice must be 'none', 'auto', 'required' or "
                              "{\"type\": \"function\", \"function\": {\"name\": ...}}", param="tool_choice")
        if name not in {t.function.name for t in self.tools}:
            raise OpenAIError(f"tool_choice names {name!r}, which is not among the tools", param="tool_choice")
        return ToolCallMode(name, False)

    def constraint_field(self) -> str | None:
        mode = self.tool_call()
        if mode is not None and not mode.auto:
            return "tools"  # the constraint is made from the tools' parameter schemas
        return super().constraint_field()

    def _tool_functions(self) -> list[dict]:
        return [t.function.model_dump(exclude_none=True, exclude={"strict"}) for t in self.tools or ()]

    def _tool_constraint(self) -> list[tuple[str, StructuredOutput]]:
        mode = self.tool_call()
        if mode is None or mode.auto:  # auto: generation is not constrained
            return []
        return [("tool_choice", StructuredOutput.json_schema(call_schema(self._tool_functions(), mode.name,
                                                                          mode.parallel)))]

    def _max_tokens(self) -> tuple[int | None, str]:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens, "max_completion_tokens"
        return self.max_tokens, "max_tokens"

    def check_limits(self, num_prompts: int, max_model_len: int | None) -> None:
        super().check_limits(num_prompts, max_model_len)
        at_most(len(self.messages), LIMITS.max_messages, "messages", "messages")
        if self.tools is not None:
            at_most(len(self.tools), LIMITS.max_tools, "tools", "tools")
            for i, tool in enumerate(self.tools):
                size = len(json.dumps(tool.function.model_dump(exclude_none=True, exclude={"strict"})))
                if size > LIMITS.max_tool_chars:
                    raise OpenAIError(f"a tool's definition may have at most {LIMITS.max_tool_chars} characters "
                                      f"as JSON; tools[{i}] has {size}", param=f"tools[{i}]")

    def to_generate(self, max_model_len: int | None = None) -> list[GenerateRequest]:
        """max_model_len: the server's, for the limits stated in terms of it (LIMITS)."""
        self.check_limits(1, max_model_len)
        self.check_supported()
        if self.top_logprobs and not self.logprobs:
            raise OpenAIError("top_logprobs needs logprobs=true", param="top_logprobs")
        messages, chars = chat_template_messages(self.messages)  # chars: what reaches the chat template
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        tools = self._tool_functions() if self.tool_call() is not None else None  # 'none': the model is not told
        chars += len(json.dumps(tools)) if tools else 0
        chars_limit = self._prompt_chars_limit(max_model_len)
        if chars_limit is not None and chars > chars_limit:
            raise OpenAIError(f"the messages (contents, tool calls and tools) have {chars} characters; at most "
                              f"{chars_limit} are allowed ({LIMITS.prompt_chars_per_token} per token of "
                              f"max_model_len {max_model_len})", param="messages")
        max_tokens, _ = self._max_tokens()
        return [self._generate(max_tokens, logprobs, self.structured(), messages=messages, tools=tools)]


class TokenizeRequest(BaseModel):
    """vLLM's /tokenize: a prompt, or chat messages through the chat template."""

    model_config = ConfigDict(extra="allow")  # as the other routes: unknown fields are ignored
    model: str
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True
    add_special_tokens: bool = True  # a prompt's (BOS); a chat template writes its own
    tools: list[ToolDefinition] | None = None

    def to_verifier(self, max_model_len: int) -> dict:
        """What the verifier's `tokenize` takes, validated (a 400 otherwise)."""
        if (self.prompt is None) == (self.messages is None):
            raise OpenAIError("give exactly one of prompt or messages", param="prompt")
        limit = LIMITS.prompt_chars_per_token * max_model_len
        if self.prompt is not None:
            if not self.prompt:
                raise OpenAIError("the prompt is empty", param="prompt")
            if len(self.prompt) > limit:
                raise OpenAIError(f"the prompt has {len(self.prompt)} characters; at most {limit} are allowed "
                                  f"({LIMITS.prompt_chars_per_token} per token of max_model_len {max_model_len})",
                                  param="prompt")
            return {"prompt": self.prompt, "add_special_tokens": self.add_special_tokens}
        if not self.messages:
            raise OpenAIError("messages is empty", param="messages")
        at_most(len(self.messages), LIMITS.max_messages, "messages", "messages")
        messages, chars = chat_template_messages(self.messages)
        tools = [t.function.model_dump(exclude_none=True, exclude={"strict"}) for t in self.tools or ()] or None
        at_most(len(tools or ()), LIMITS.max_tools, "tools", "tools")
        chars += len(json.dumps(tools)) if tools else 0
        if chars > limit:
            raise OpenAIError(f"the messages (contents, tool calls and tools) have {chars} characters; at most "
                              f"{limit} are allowed", param="messages")
        return {"messages": messages, "tools": tools, "add_generation_prompt": self.add_generation_prompt}


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="allow")
    model: str
    tokens: list[int]

    def check(self, max_model_len: int) -> None:
        if not self.tokens:
            raise OpenAIError("tokens is empty", param="tokens")
        at_most(len(self.tokens), LIMITS.prompt_chars_per_token * max_model_len, "tokens", "tokens")
