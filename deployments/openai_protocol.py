"""OpenAI request models (the subset rayspec serves) and the error shape."""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from deployments.protocol import GenerateRequest


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
    n: int = 1
    user: str | None = None
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    # extensions
    top_k: int | None = Field(None, ge=-1)
    num_speculative_tokens: int | None = Field(None, ge=0)
    ignore_eos: bool = False

    def check_supported(self) -> None:
        if self.n != 1:
            raise OpenAIError("only n=1 is supported", param="n")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                raise OpenAIError(f"{name} is not supported", param=name)
        if self.stream_options is not None and not self.stream:
            raise OpenAIError("stream_options needs stream=true", param="stream_options")

    def _generate(self, max_tokens: int | None, **prompt) -> GenerateRequest:
        return GenerateRequest(
            max_tokens=max_tokens, temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p, top_k=self.top_k or 0, stop=self.stop, seed=self.seed,
            ignore_eos=self.ignore_eos, num_speculative_tokens=self.num_speculative_tokens, **prompt)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(_Common):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    def to_generate(self) -> GenerateRequest:
        self.check_supported()
        for name, bad in (("logprobs", self.logprobs is not None), ("echo", self.echo),
                          ("best_of", self.best_of not in (None, 1)), ("suffix", self.suffix is not None)):
            if bad:
                raise OpenAIError(f"{name} is not supported", param=name)
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise OpenAIError("batched prompts are not supported; send one prompt per request", param="prompt")
            prompt = prompt[0]
        if not prompt:
            raise OpenAIError("the prompt is empty", param="prompt")
        return self._generate(self.max_tokens, prompt=prompt)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None
    response_format: dict[str, Any] | None = None

    def to_generate(self) -> GenerateRequest:
        self.check_supported()
        for name, bad in (("logprobs", self.logprobs), ("top_logprobs", self.top_logprobs is not None),
                          ("tools", bool(self.tools)), ("functions", bool(self.functions)),
                          ("tool_choice", self.tool_choice not in (None, "none")),
                          ("response_format", bool(self.response_format)
                           and self.response_format.get("type") != "text")):
            if bad:
                raise OpenAIError(f"{name} is not supported", param=name)
        messages = []
        for i, m in enumerate(self.messages):
            content = m.content
            if isinstance(content, list):
                if any(part.get("type") != "text" for part in content):
                    raise OpenAIError("only text content parts are supported", param=f"messages[{i}].content")
                content = "".join(str(part.get("text", "")) for part in content)
            messages.append({"role": "system" if m.role == "developer" else m.role, "content": content or ""})
        return self._generate(self.max_completion_tokens or self.max_tokens, messages=messages)


def finish_reason(reason: str | None) -> str | None:
    if reason is None:
        return None
    return "length" if reason == "length" else "stop"


def usage(num_prompt: int, num_output: int, num_draft: int, num_accepted: int) -> dict:
    return {"prompt_tokens": num_prompt, "completion_tokens": num_output, "total_tokens": num_prompt + num_output,
            "completion_tokens_details": {"accepted_prediction_tokens": num_accepted,
                                          "rejected_prediction_tokens": num_draft - num_accepted}}


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())
