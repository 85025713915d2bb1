"""POST /v1/chat/completions: the choices of a `chat.completion`, whole or streamed as deltas. Under
a tool-call constraint (tool_choice "required" or a named function) the output is the calls; under
tool_choice "auto" a tool-call parser reads calls out of the model's text.

ChatChoices is the route's ChoiceFormat (deployments.frontend.ingress): the ingress calls the
verifier, counts usage and writes the response or its SSE events around it.
"""

from __future__ import annotations

from deployments.frontend.openai_requests import ToolCallMode
from deployments.frontend.openai_responses import (AutoToolCallStream, ToolCallStream, auto_tool_message,
                                                   chat_logprobs, finish_reason, tool_call_message)
from deployments.transport.protocol import GenerateChunk, GenerateResponse
from rayspec.sampling.tool_parsers import ToolCallParser


class ChatChoices:
    """The choices of one chat request: {"index", "message" (or "delta"), "logprobs", "finish_reason"}
    each. mode: the request's tool call (None: a plain message); parser: tool_choice "auto"'s."""

    id_prefix, object, chunk_object = "chatcmpl", "chat.completion", "chat.completion.chunk"

    def __init__(self, mode: ToolCallMode | None, parser: ToolCallParser | None = None):
        self.mode, self.parser = mode, parser
        self.tool_streams: list[ToolCallStream | AutoToolCallStream] | None = None  # per choice, while streaming

    def output(self, result):
        return result

    def choice(self, c: int, result: GenerateResponse) -> dict:
        logprobs = chat_logprobs(result.logprobs) if result.logprobs is not None else None
        if self.parser is not None:
            message, reason = auto_tool_message(result.text, self.parser, result.finish_reason)
        elif self.mode is not None:
            message, reason = tool_call_message(result.text, self.mode, result.finish_reason)
        else:
            message, reason = {"role": "assistant", "content": result.text}, finish_reason(result.finish_reason)
        return {"index": c, "message": message, "logprobs": logprobs, "finish_reason": reason}

    def start_stream(self, num_choices: int) -> list[dict]:
        """Each choice's first delta, its role, ahead of any output."""
        if self.parser is not None:
            self.tool_streams = [AutoToolCallStream(self.parser) for _ in range(num_choices)]
        elif self.mode is not None:
            self.tool_streams = [ToolCallStream(self.mode) for _ in range(num_choices)]
        # OpenAI: null ahead of tool calls ("auto": text may come first)
        content = None if self.mode is not None and self.parser is None else ""
        return [{"index": c, "delta": {"role": "assistant", "content": content}, "logprobs": None,
                 "finish_reason": None} for c in range(num_choices)]

    def delta(self, c: int, chunk: GenerateChunk) -> dict | None:
        reason = finish_reason(chunk.finish_reason) if chunk.finished else None
        logprobs = chat_logprobs(chunk.logprobs) if chunk.logprobs else None
        delta = {"content": chunk.delta_text} if chunk.delta_text else {}
        if self.tool_streams is not None:  # arguments (or whole calls) instead of content
            delta, reason = self.tool_streams[c].delta(chunk.delta_text, chunk.finished, chunk.finish_reason)
        if not (delta or reason or logprobs):
            return None
        return {"index": c, "delta": delta, "logprobs": logprobs, "finish_reason": reason}
