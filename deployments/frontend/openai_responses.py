"""OpenAI response pieces: logprobs blocks, finish reasons, usage, ids, and the assistant messages
(whole or streamed as deltas) of outputs made under a tool-call constraint or tool_choice "auto"."""

from __future__ import annotations

import time
import uuid
from typing import Any

from deployments.frontend.openai_requests import ToolCallMode
from rayspec.sampling.logprobs import TokenLogprob
from rayspec.sampling.tool_parsers import ToolCallParser, ToolCallStreamParser
from rayspec.sampling.tools import parse_calls


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


def auto_tool_message(text: str, parser: ToolCallParser, reason: str | None) -> tuple[dict, str | None]:
    """The assistant message and finish_reason of an output made under tool_choice "auto": the calls
    the parser finds in it (content: the text before them, or null), else the text as it is."""
    parsed = parser.parse(text)
    if not parsed.calls:
        return {"role": "assistant", "content": text}, finish_reason(reason)
    return ({"role": "assistant", "content": parsed.content,
             "tool_calls": [{k: v for k, v in _call_entry(i, n, a).items() if k != "index"}
                            for i, (n, a) in enumerate(parsed.calls)]}, "tool_calls")


class AutoToolCallStream:
    """One streamed choice under tool_choice "auto" (the ToolCallStream interface): content deltas
    while no call can be starting, the calls (whole, each with its id) once the output ends."""

    def __init__(self, parser: ToolCallParser):
        self.stream = ToolCallStreamParser(parser)

    def delta(self, delta_text: str, finished: bool, reason: str | None) -> tuple[dict, str | None]:
        content, calls = self.stream.feed(delta_text, finished)
        delta: dict[str, Any] = {"content": content} if content else {}
        if calls:
            delta["tool_calls"] = [_call_entry(i, n, a) for i, (n, a) in enumerate(calls)]
        if not finished:
            return delta, None
        return delta, "tool_calls" if calls else finish_reason(reason)


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


def sum_usage(parts: list[tuple[int, ...]]) -> dict:
    """Usage over choices: parts of (prompt counted once per prompt, output, drafts, accepted[, prompt
    tokens found in the prefix cache, counted once per prompt])."""
    return usage(*(sum(col) for col in zip(*parts)))


def usage(num_prompt: int, num_output: int, num_draft: int, num_accepted: int, num_cached: int = 0) -> dict:
    return {"prompt_tokens": num_prompt, "completion_tokens": num_output, "total_tokens": num_prompt + num_output,
            "prompt_tokens_details": {"cached_tokens": num_cached},
            "completion_tokens_details": {"accepted_prediction_tokens": num_accepted,
                                          "rejected_prediction_tokens": num_draft - num_accepted}}


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())
