"""POST /v1/completions: the choices of a `text_completion`, whole or streamed. Echo puts each
prompt (its text and logprobs) ahead of the output; max_tokens 0 with echo scores the prompt only.

CompletionChoices is the route's ChoiceFormat (deployments.frontend.ingress): the ingress calls the
verifier, counts usage and writes the response or its SSE events around it.
"""

from __future__ import annotations

from deployments.frontend.openai_requests import CompletionRequest
from deployments.frontend.openai_responses import completion_logprobs, finish_reason
from deployments.transport.protocol import GenerateChunk, GenerateResponse


def without_output(result):
    """A GenerateResponse or chunk of a max_tokens 0 request: the engine's one token dropped."""
    return result.model_copy(update={"text" if hasattr(result, "text") else "delta_text": "",
                                     "token_ids" if hasattr(result, "token_ids") else "delta_token_ids": [],
                                     "logprobs": [] if result.logprobs is not None else None,
                                     "num_output_tokens": 0, "finish_reason": "length"})


def with_prompt(result):
    """echo: the prompt's text and logprobs (those that came with it) ahead of the output's."""
    key = "text" if hasattr(result, "text") else "delta_text"
    update = {key: (result.prompt_text or "") + getattr(result, key), "prompt_text": None, "prompt_logprobs": None}
    if result.prompt_logprobs is not None:
        update["logprobs"] = list(result.prompt_logprobs) + list(result.logprobs or [])
    return result.model_copy(update=update)


class CompletionChoices:
    """The choices of one completions request: {"index", "text", "logprobs", "finish_reason"} each."""

    id_prefix, object, chunk_object = "cmpl", "text_completion", "text_completion"

    def __init__(self, body: CompletionRequest):
        self.body = body
        self.text_offset: list[int] = []  # streamed logprobs: where each choice's next token starts

    def output(self, result):
        """The result as returned and counted in usage: max_tokens 0 makes no output."""
        return without_output(result) if self.body.prompt_only else result

    def choice(self, c: int, result: GenerateResponse) -> dict:
        if self.body.echo:
            result = with_prompt(result)
        logprobs = completion_logprobs(result.logprobs) if result.logprobs is not None else None
        return {"index": c, "text": result.text, "logprobs": logprobs,
                "finish_reason": finish_reason(result.finish_reason)}

    def start_stream(self, num_choices: int) -> list[dict]:
        """Nothing is sent ahead of a completion's first output."""
        self.text_offset = [0] * num_choices
        return []

    def delta(self, c: int, chunk: GenerateChunk) -> dict | None:
        if self.body.echo and (chunk.prompt_text is not None or chunk.prompt_logprobs):
            chunk = with_prompt(chunk)  # (the first chunk carries the prompt)
        reason = finish_reason(chunk.finish_reason) if chunk.finished else None
        logprobs = None
        if chunk.logprobs:
            logprobs = completion_logprobs(chunk.logprobs, self.text_offset[c])
            self.text_offset[c] += sum(len(e.token) for e in chunk.logprobs)
        if not (chunk.delta_text or reason or logprobs):
            return None
        return {"index": c, "text": chunk.delta_text, "logprobs": logprobs, "finish_reason": reason}
