"""What the engine hands out: a request's output after each step, and the errors that refuse a request."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from rayspec.sampling.logprobs import TokenLogprob

if TYPE_CHECKING:
    from rayspec.engine.sequence import Sequence


class InvalidRequestError(ValueError):
    """The request cannot be served as asked (too long, bad token ids, duplicate id, ...)."""


class EngineOverloadedError(RuntimeError):
    """The waiting queue is full (EngineConfig.max_num_waiting): the request was not taken; try later."""


class GrammarCompilerBusyError(EngineOverloadedError):
    """Every place to compile an output constraint is taken (rayspec.sampling.structured.MAX_COMPILES):
    the request was not taken; try later."""

    @property
    def reason(self) -> str:  # what the server's 429 says
        return "every place to compile an output constraint is taken"


class InvalidGrammarError(InvalidRequestError):
    """The request's output constraint cannot be compiled (malformed, past llguidance's limits, or
    slower to compile than rayspec.sampling.structured.COMPILE_TIMEOUT_S)."""


@dataclass
class RequestOutput:
    request_id: str
    text: str  # all output text so far
    delta_text: str  # text added by this step
    token_ids: list[int]  # all output tokens so far
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_draft_tokens: int
    num_accepted_tokens: int
    num_steps: int
    # with SamplingParams.logprobs: one entry per token of token_ids (None for a resumed request's earlier ones)
    logprobs: list[TokenLogprob | None] | None = None
    # with SamplingParams.prompt_logprobs: one per prompt token (the first has logprob None)
    prompt_logprobs: list[TokenLogprob] | None = None
    error: str | None = None  # finish_reason "error": what failed (the engine went on with the others)
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache (OpenAI's cached_tokens)
    # what this output adds to the request's previous one: its tokens, and their logprobs (with
    # SamplingParams.logprobs). A server streams these; with `LLMEngine.delta_outputs` they are all
    # an unfinished output holds (text "", token_ids [], logprobs None): no copy of what came before
    delta_token_ids: list[int] = field(default_factory=list)
    delta_logprobs: list[TokenLogprob | None] | None = None
    num_output_tokens: int = -1  # all output tokens so far (-1: len(token_ids))

    def __post_init__(self):
        if self.num_output_tokens < 0:
            self.num_output_tokens = len(self.token_ids)


def request_output(seq: Sequence, whole: bool) -> RequestOutput:
    """What a step hands out for seq. whole: the output so far (text, token_ids, logprobs), else
    only what this output adds (the delta_* fields; an unfinished streamed request's)."""
    delta = seq.take_new_text()  # text keeps back a possible stop-string start, like delta
    n, start = seq.num_output_tokens, seq.num_reported_tokens
    seq.num_reported_tokens = n
    return RequestOutput(
        request_id=seq.request_id, text=seq.sent_text if whole else "", delta_text=delta,
        token_ids=seq.output_token_ids if whole else [], finished=seq.finished, finish_reason=seq.finish_reason,
        num_prompt_tokens=seq.num_prompt_tokens, num_draft_tokens=seq.num_draft_tokens,
        num_accepted_tokens=seq.num_accepted_tokens, num_steps=seq.num_steps,
        logprobs=list(seq.logprobs) if seq.logprobs is not None and whole else None,
        prompt_logprobs=seq.prompt_logprobs, error=seq.error, num_cached_tokens=seq.num_cached_tokens or 0,
        delta_token_ids=seq.token_ids[len(seq.token_ids) - (n - start):] if n > start else [],
        delta_logprobs=seq.logprobs[start:n] if seq.logprobs is not None else None, num_output_tokens=n)
