"""Pydantic request/response models of the verifier (and of the ingress' Python handle API)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator

from rayspec.engine.outputs import EngineOverloadedError, InvalidRequestError
from rayspec.sampling.logprobs import TokenLogprob
from rayspec.sampling.params import SamplingParams
from rayspec.sampling.structured import StructuredOutput


class RequestTimeoutError(RuntimeError):
    """The request passed its deadline (GenerateRequest.timeout_s, app arg request_timeout_s) and was
    aborted, its engine resources freed. The ingress answers 504 (code request_timeout)."""


class NotStartedInTime(EngineOverloadedError):
    """The request had not started (no output yet) by its start_by (app arg queue_timeout_s): refused
    as overloaded, its place in the engine and its work freed. The ingress answers 429 with Retry-After."""

    @property
    def reason(self) -> str:  # what the ingress's 429 says
        return str(self)


class GenerateRequest(BaseModel):
    """One generation: `prompt` (text or token ids) or chat `messages` (the model's chat template)."""

    model_config = ConfigDict(extra="forbid")
    prompt: str | list[int] | None = None
    messages: list[dict] | None = None
    tools: list[dict] | None = None  # function definitions for the chat template (rayspec.sampling.tools)
    max_tokens: int | None = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] = Field(default_factory=list)
    include_stop_str_in_output: bool = False
    min_tokens: int = Field(0, ge=0)
    seed: int | None = None
    ignore_eos: bool = False
    cache_salt: str | None = Field(None, min_length=1, max_length=1024)  # prefix caching per tenant (vLLM's)
    num_speculative_tokens: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    # structured output: {"kind": "json" | "regex" | "grammar" | "choice", "value": ...} (rayspec.sampling.structured)
    structured: dict[str, str] | None = None
    logprobs: int | None = None  # each output token's logprob under the target, plus this many alternatives
    prompt_logprobs: int | None = None  # the same for the prompt's tokens
    echo_prompt: bool = False  # return the prompt's text (`prompt_text`)
    request_id: str | None = None  # optional tag echoed back (the engine id is replica-unique)
    # continue a generation another verifier replica started (the ingress' failover): the output
    # token ids so far, and how many characters of their text the caller already has
    resume_output_ids: list[int] = Field(default_factory=list)
    resume_sent_chars: int = Field(0, ge=0)
    # the Serve actor name of the ingress replica that sends this request: if that actor dies (and
    # with it the client's connection), the verifier aborts the request instead of decoding for no one
    caller: str | None = None
    # the OpenAI request this is one choice of (the ingress's id for it) and how many choices it has:
    # a verifier replica lets a request's choices in together, by their work (deployments.replicas.work_budget)
    group: str | None = Field(None, max_length=64)
    group_size: int = Field(1, ge=1)
    # seconds this request may take from when the verifier takes it; past it the verifier aborts it
    # with RequestTimeoutError. The ingress sets its app's request_timeout_s, and a failover the time
    # left. None: the verifier's own request_timeout_s
    timeout_s: float | None = Field(None, gt=0)
    # when (wall clock, time.time()) this request must have started (its first output, after its
    # prefill) or be refused as overloaded (429 with Retry-After): a request queued behind more work than
    # a replica serves in time is told so instead of waiting. The ingress sets its app's
    # queue_timeout_s from when it takes the request (so the wait in Serve's queue for a verifier place
    # counts too). A failover (resume_output_ids) has started: never refused by it. None: no deadline
    start_by: float | None = None

    @model_validator(mode="after")
    def _one_prompt(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt or messages")
        return self

    def sampling_params(self) -> SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        try:
            structured = StructuredOutput(**self.structured) if self.structured else None
            return SamplingParams(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                                  max_tokens=self.max_tokens, stop=stop, stop_token_ids=list(self.stop_token_ids),
                                  include_stop_str_in_output=self.include_stop_str_in_output,
                                  min_tokens=self.min_tokens,
                                  seed=self.seed, ignore_eos=self.ignore_eos,
                                  num_speculative_tokens=self.num_speculative_tokens, logprobs=self.logprobs,
                                  prompt_logprobs=self.prompt_logprobs,
                                  presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
                                  repetition_penalty=self.repetition_penalty, logit_bias=self.logit_bias,
                                  structured=structured, cache_salt=self.cache_salt)
        except (ValueError, TypeError) as err:
            raise InvalidRequestError(str(err)) from None


class GenerateChunk(BaseModel):
    """One streamed increment."""

    request_id: str
    delta_text: str
    delta_token_ids: list[int]
    finished: bool
    finish_reason: str | None = None
    num_prompt_tokens: int
    num_output_tokens: int
    num_draft_tokens: int
    num_accepted_tokens: int
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache
    logprobs: list[TokenLogprob] | None = None  # one per delta token, with logprobs requested
    # in the first chunk only: with prompt_logprobs / echo_prompt
    prompt_logprobs: list[TokenLogprob] | None = None
    prompt_text: str | None = None


class GenerateResponse(BaseModel):
    request_id: str
    text: str
    token_ids: list[int]
    finish_reason: str | None
    num_prompt_tokens: int
    num_output_tokens: int
    num_draft_tokens: int
    num_accepted_tokens: int
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache
    logprobs: list[TokenLogprob | None] | None = None  # one per token, with logprobs requested
    prompt_logprobs: list[TokenLogprob] | None = None
    prompt_text: str | None = None  # with echo_prompt
    time_to_first_token_s: float | None = None
    latency_s: float | None = None
