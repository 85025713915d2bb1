"""What one request may ask for on the OpenAI routes (Limits) and the OpenAI error shape (OpenAIError)
every refused request gets: a status code and {"error": {message, type, param, code}}."""

from __future__ import annotations

import math
from dataclasses import dataclass

from rayspec.sampling.logprobs import MAX_TOP_LOGPROBS
from rayspec.sampling.params import MAX_SEED


@dataclass(frozen=True)
class Limits:
    """What one request may ask for on the OpenAI routes. Past a limit: a 400 whose `param` names the
    field and whose message names the limit. The table in deployments/README.md gives the reasons.
    Limits in terms of max_model_len use the configured one (`engine.max_model_len`)."""

    max_choices: int = 64  # prompts x n
    max_output_tokens: int = 131_072  # prompts x n x max_tokens (unset: max_model_len); 64 x 2048
    max_stop: int = 16  # stop strings (OpenAI: 4)
    max_stop_chars: int = 1_000  # characters of each stop string
    max_stop_token_ids: int = 128
    max_logit_bias: int = 300  # entries (OpenAI's figure)
    max_seed: int = MAX_SEED  # seeds are 0 ... 2**63 - 1 (choice i of n uses seed + i)
    max_top_logprobs: int = MAX_TOP_LOGPROBS  # logprobs / top_logprobs
    # a prompt's characters (chat: contents, tool calls, tools) per token of max_model_len
    prompt_chars_per_token: int = 32
    max_messages: int = 2_048
    max_tools: int = 128  # OpenAI's
    max_tool_chars: int = 65_536  # one tool's definition (name, description, parameters) as JSON
    # an output constraint: a schema as JSON, a regex, a Lark grammar, the choices as JSON
    max_constraint_chars: int = 65_536
    max_guided_choices: int = 1_024


LIMITS = Limits()
MAX_CHOICES = LIMITS.max_choices  # n times the number of prompts, per request


def at_most(count: int, limit: int, what: str, param: str) -> None:
    if count > limit:
        raise OpenAIError(f"at most {limit} {what} are allowed, got {count}", param=param)


class OpenAIError(Exception):
    def __init__(self, message: str, status_code: int = 400, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, retry_after_s: float | None = None):
        super().__init__(message)
        self.message, self.status_code, self.type, self.param, self.code = message, status_code, type, param, code
        self.retry_after_s = retry_after_s  # a Retry-After header (whole seconds, rounded up) when set

    def headers(self) -> dict[str, str] | None:
        if self.retry_after_s is None:
            return None
        return {"Retry-After": str(max(0, math.ceil(self.retry_after_s)))}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}
