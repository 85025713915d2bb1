"""Tool calls the model chose to make (tool_choice "auto"), read out of its own text.

Under "auto" generation is not constrained: the output tokens are exactly the model's, and only how
they are presented changes. A parser per model family finds the calls in the text, in the format
the family's chat template teaches it:

- `hermes` (Hermes, Qwen2/2.5/3): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, one
  block per call;
- `llama3_json` (Llama 3.1/3.2/3.3): `{"name": ..., "parameters": {...}}` as the whole answer,
  optionally after `<|python_tag|>`; several calls separated by `;`;
- `mistral`: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`;
- `json_list` (rayspec's own, for templates with no place for tools, e.g. SmolLM2's: the tools
  are described in the system message, rayspec.sampling.tools.describe_tools, which asks for this):
  `[{"name": ..., "arguments": {...}}, ...]` as the whole answer.

`<|python_tag|>` and `[TOOL_CALLS]` are special tokens in those tokenizers, and output text is
decoded without special tokens, so the Llama and Mistral parsers also take the call without its
marker when it is the whole answer (the first thing in it is `{` or `[`).

Text before the first call is the message's content; a marker followed by anything that is not a
well-formed call (malformed JSON, a cut-off call, no "name") leaves the whole text plain content.
Streaming (ToolCallStreamParser) sends content until a call could be starting, holding back a tail
that may be the beginning of a marker; from a call's start on it holds the text until the output
ends, then sends the calls (or, when they do not parse, the held text as content).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

TOOL_CALL_PARSERS = ("llama3_json", "hermes", "mistral")  # what the app arg `tool_call_parser` takes


@dataclass
class ParsedOutput:
    content: str | None  # None: no text besides the calls
    calls: list[tuple[str, str]] = field(default_factory=list)  # (function name, arguments as JSON text)


def _arguments(value) -> str | None:
    """A call's arguments as JSON text (an object), or None when they are not one."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except (json.JSONDecodeError, RecursionError):  # (nested past the parser's depth: not a call)
            return None
    if not isinstance(value, dict):
        return None
    return json.dumps(value, ensure_ascii=False)


def _call(obj, argument_keys=("arguments", "parameters")) -> tuple[str, str] | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    raw = next((obj[k] for k in argument_keys if k in obj), {})
    arguments = _arguments(raw)
    return None if arguments is None else (obj["name"], arguments)


class ToolCallParser:
    """One family's call format. `markers`: text that starts a call anywhere; `leading`: first
    characters (after blanks) that start a call when it is the whole answer."""

    name = ""
    markers: tuple[str, ...] = ()
    leading: tuple[str, ...] = ()

    def call_start(self, text: str) -> int | None:
        """Where a call would start in `text`, or None when none does (so far)."""
        found = [text.find(m) for m in self.markers if m in text]
        body = text.lstrip()
        if body and body[0] in self.leading:
            found.append(len(text) - len(body))
        return min(found) if found else None

    def split(self, text: str) -> tuple[int, list[tuple[str, str]], str] | None:
        """(where the calls start, the calls, text after or between them) for a complete output, or
        None when it holds no well-formed calls."""
        start = self.call_start(text)
        if start is None:
            return None
        parsed = self._calls(text[start:])
        if not parsed or not parsed[0]:
            return None
        calls, after = parsed
        return start, calls, after

    def _calls(self, text: str) -> tuple[list[tuple[str, str]], str] | None:
        raise NotImplementedError

    def parse(self, text: str) -> ParsedOutput:
        """The content and calls of a complete output."""
        found = self.split(text)
        if found is None:
            return ParsedOutput(text, [])
        start, calls, after = found
        content = text[:start] + after
        return ParsedOutput(content if content.strip() else None, calls)

    def safe_prefix(self, text: str) -> int:
        """For an output still being generated: how many of its first characters are content for
        sure (before any call, and before a tail that may be the beginning of a marker)."""
        start = self.call_start(text)
        if start is not None:
            return start
        if self.leading and not text.strip():
            return 0  # blanks so far: the answer may still begin with a call
        hold = 0
        for marker in self.markers:
            for k in range(min(len(marker) - 1, len(text)), 0, -1):
                if text.endswith(marker[:k]):
                    hold = max(hold, k)
                    break
        return len(text) - hold


def _json_values(text: str, separators: str) -> list | None:
    """The JSON values `text` consists of, separated by blanks and `separators`; None otherwise."""
    decoder, values, pos = json.JSONDecoder(), [], 0
    while True:
        while pos < len(text) and (text[pos].isspace() or text[pos] in separators):
            pos += 1
        if pos == len(text):
            return values
        try:
            value, pos = decoder.raw_decode(text, pos)
        except (json.JSONDecodeError, RecursionError):  # (nested past the parser's depth: not a call)
            return None
        values.append(value)


class HermesParser(ToolCallParser):
    name = "hermes"
    OPEN, CLOSE = "<tool_call>", "</tool_call>"
    markers = (OPEN,)

    def _calls(self, text):
        calls, outside, pos = [], [], 0
        while True:
            i = text.find(self.OPEN, pos)
            if i < 0:
                outside.append(text[pos:])
                break
            outside.append(text[pos:i])
            j = text.find(self.CLOSE, i)
            body = text[i + len(self.OPEN): j if j >= 0 else len(text)].strip()
            try:
                call = _call(json.loads(body))
            except (json.JSONDecodeError, RecursionError):  # (nested past the parser's depth: not a call)
                return None
            if call is None:
                return None
            calls.append(call)
            if j < 0:  # the output ended (EOS) before the closing tag
                break
            pos = j + len(self.CLOSE)
        after = "".join(outside)
        return calls, after if after.strip() else ""


class Llama3JsonParser(ToolCallParser):
    name = "llama3_json"
    TAG = "<|python_tag|>"
    markers = (TAG,)
    leading = ("{",)

    def _calls(self, text):
        if text.startswith(self.TAG):
            text = text[len(self.TAG):]
        values = _json_values(text, ";")
        if not values:
            return None
        calls = [_call(v, ("parameters", "arguments")) for v in values]
        return None if None in calls else (calls, "")


class MistralParser(ToolCallParser):
    name = "mistral"
    TAG = "[TOOL_CALLS]"
    markers = (TAG,)
    leading = ("[",)

    def _calls(self, text):
        if text.startswith(self.TAG):
            text = text[len(self.TAG):]
        values = _json_values(text, "")
        if not values or len(values) != 1:
            return None
        items = values[0] if isinstance(values[0], list) else [values[0]]
        calls = [_call(v) for v in items]
        return None if not calls or None in calls else (calls, "")


class JsonListParser(MistralParser):
    name = "json_list"
    markers = ()


PARSERS = {cls.name: cls for cls in (HermesParser, Llama3JsonParser, MistralParser, JsonListParser)}


def get_parser(name: str) -> ToolCallParser:
    if name not in PARSERS:
        raise ValueError(f"unknown tool-call parser {name!r}; known: {sorted(PARSERS)}")
    return PARSERS[name]()


def parser_for_template(template) -> str | None:
    """The call format a chat template teaches its model, from the markers in its text; `json_list`
    for a template with no place for tools (they go into the system message, rayspec.sampling.tools); None
    when it renders tools in a format none of the parsers knows."""
    if not template:
        return None
    text = template if isinstance(template, str) else json.dumps(template)
    if "<tool_call>" in text:
        return "hermes"
    if "[TOOL_CALLS]" in text:
        return "mistral"
    if "<|python_tag|>" in text or ("<|start_header_id|>" in text and "tools" in text):
        return "llama3_json"
    if "tools" not in text:  # the engine's test for inlining the tools (LLMEngine.encode_chat)
        return "json_list"
    return None


_NON_BLANK = re.compile(r"\S")


class ToolCallStreamParser:
    """One streamed choice under tool_choice "auto": feed it the text deltas, get back the content
    to send now and, at the end, the calls.

    Linear in the output whatever it holds: each delta is searched once, together with the few
    characters before it a marker could straddle; the text is kept as pieces, joined once at the end
    (and the unsent content when it goes out), so no delta costs in proportion to the text so far."""

    def __init__(self, parser: ToolCallParser):
        self.parser = parser
        self._pieces: list[str] = []  # all of the text so far
        self.size = 0  # its characters
        self._unsent: list[str] = []  # the text from `sent` on, in pieces
        self.sent = 0  # characters sent as content
        self.in_call = False
        self._keep = max((len(m) for m in parser.markers), default=1) - 1  # a straddling marker's head
        self._tail = ""  # the last _keep characters
        self._first: int | None = None  # where the first non-blank character is (None: blanks so far)

    @property
    def text(self) -> str:
        return "".join(self._pieces)

    def feed(self, delta: str, finished: bool) -> tuple[str, list[tuple[str, str]]]:
        """(content to send now, calls: only at the end, when the output made some)."""
        before = self.size
        if delta:
            self._pieces.append(delta)
            self._unsent.append(delta)
            self.size += len(delta)
        if finished:
            text = self.text
            found = self.parser.split(text)
            if found is None:
                content, self.sent = text[self.sent:], len(text)
                return content, []
            start, calls, after = found
            content, self.sent = text[self.sent:start] + after, len(text)
            return content, calls
        if self.in_call:
            return "", []
        window = self._tail + delta  # starts at character before - len(self._tail)
        base = before - len(self._tail)
        starts = [base + window.find(m) for m in self.parser.markers if m in window]
        if self._first is None and (blank := _NON_BLANK.search(delta)) is not None:
            self._first = before + blank.start()
            if delta[blank.start()] in self.parser.leading:
                starts.append(self._first)
        self._tail = window[-self._keep:] if self._keep else ""
        if starts:  # as ToolCallParser.safe_prefix, on the window
            self.in_call, safe = True, min(starts)
        elif self.parser.leading and self._first is None:
            safe = 0  # blanks so far: the answer may still begin with a call
        else:
            hold = 0
            for marker in self.parser.markers:
                for k in range(min(len(marker) - 1, len(window)), 0, -1):
                    if window.endswith(marker[:k]):
                        hold = max(hold, k)
                        break
            safe = self.size - hold
        if safe <= self.sent:
            return "", []
        unsent = "".join(self._unsent)
        content, rest = unsent[:safe - self.sent], unsent[safe - self.sent:]
        self._unsent, self.sent = [rest] if rest else [], safe
        return content, []
