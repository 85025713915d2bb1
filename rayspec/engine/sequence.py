"""Request state: tokens, incremental text, stop conditions and per-request speculation stats."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from rayspec.engine.drafting import SeqDraftState
from rayspec.sampling.params import SamplingParams

if TYPE_CHECKING:
    import torch


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class IncrementalDetokenizer:
    """Decodes tokens as they come without splitting multi-byte characters.

    Text is emitted only once the decoded tail no longer ends in U+FFFD (an incomplete UTF-8
    sequence); a few prompt tokens seed the window so leading-space rules decode correctly.
    Each token costs the same whatever came before (no window grows without bound): a token that
    decodes to nothing (a special token, skipped) leaves the window, as a whole-sequence decode
    drops it too, and a tail that stays U+FFFD past MAX_PENDING tokens (no UTF-8 character takes
    more than 4 bytes, a token at least one) is emitted as it decodes.

    With a fast tokenizer whose decode adds no clean-up of its own (clean_up_tokenization_spaces
    off), each token is one call of tokenizers' DecodeStream (the same windowed rule, in Rust):
    ~1.2 us a token against ~10 us for the two or three `tokenizer.decode` calls of the windowed
    path here (SmolLM2's tokenizer, 1,841 tokens of mixed text, AMD EPYC; at batch 32 and 5 tokens a
    step, ~1.4 ms of host time per step less). The flush at the end goes through the windowed path,
    and so does the rest of a sequence once MAX_PENDING tokens were held back.
    """

    _CONTEXT = 4
    MAX_PENDING = 8  # tokens held back waiting for a character to complete

    def __init__(self, tokenizer, prompt_ids: list[int], skip_special_tokens: bool):
        self.tokenizer = tokenizer
        self.skip_special = skip_special_tokens
        self.tokens = list(prompt_ids[-self._CONTEXT:])
        self.prefix_offset = 0
        self.read_offset = len(self.tokens)
        self._backend = _stream_backend(tokenizer)
        # (a prompt ending in part of a character: the stream would count that context as new text)
        self._stream = (self._new_stream() if self._backend is not None
                        and "\ufffd" not in self._decode(self.tokens) else None)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special)

    def _new_stream(self):
        from tokenizers.decoders import DecodeStream

        # the tokens decoded so far as its context (their text is out already)
        return DecodeStream(ids=self.tokens[-self._CONTEXT:], skip_special_tokens=self.skip_special)

    def add(self, token_id: int) -> str:
        if self._stream is not None:
            return self._add_streamed(token_id)
        self.tokens.append(token_id)
        prefix = self._decode(self.tokens[self.prefix_offset:self.read_offset])
        full = self._decode(self.tokens[self.prefix_offset:])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            return self._advance(prefix, full)
        if not full.endswith("\ufffd") and full == self._decode(self.tokens[self.prefix_offset:-1]):
            self.tokens.pop()  # this token added nothing (not even bytes of a character to come)
        elif len(self.tokens) - self.read_offset > self.MAX_PENDING:  # not a character to wait for
            return self._advance(prefix, full)
        return ""

    def _advance(self, prefix: str | None = None, full: str | None = None) -> str:
        """The text of the tokens past read_offset (their window decoded, less its prefix), now out."""
        if prefix is None:
            prefix = self._decode(self.tokens[self.prefix_offset:self.read_offset])
            full = self._decode(self.tokens[self.prefix_offset:])
        self.prefix_offset, self.read_offset = self.read_offset, len(self.tokens)
        return full[len(prefix):]

    def _add_streamed(self, token_id: int) -> str:
        self.tokens.append(token_id)
        chunk = self._stream.step(self._backend, token_id)
        if chunk is not None:
            self.prefix_offset, self.read_offset = self.read_offset, len(self.tokens)
            return chunk
        if len(self.tokens) - self.read_offset > self.MAX_PENDING:
            # held back too long (skipped tokens, or bytes that never complete a character): the
            # windowed path's text, and that path from now on (the stream's buffer would grow on,
            # and a fresh stream seeded with stray bytes counts U+FFFD otherwise than one decode)
            self._stream = None
            return self._advance()
        return ""

    def flush(self) -> str:
        """At the end, whatever is still held back (an incomplete character shows as U+FFFD)."""
        if self.read_offset == len(self.tokens):
            return ""
        text = self._advance()
        self.prefix_offset = self.read_offset
        return text


def _stream_backend(tokenizer):
    """The Rust tokenizer for DecodeStream, where its text is what tokenizer.decode gives (a fast
    tokenizer that adds no clean-up of its own); else None (the windowed path)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return None
    try:
        from tokenizers.decoders import DecodeStream  # noqa: F401 (tokenizers >= 0.21)
    except ImportError:
        return None
    return backend


@dataclass(eq=False)  # identity: `seq in running` must not compare every field
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int  # resolved: params.max_tokens or what fits in max_model_len
    eos_token_ids: set[int]
    detokenizer: IncrementalDetokenizer | None
    generator: torch.Generator | None  # a sampled request's own stream (None: greedy, or seeded: coupled draws)
    stream_seed: int | None = None  # that stream's seed, when the engine has one (EngineConfig.seed)
    token_ids: list[int] = field(default_factory=list)
    output_text: str = ""
    status: Status = Status.WAITING
    finish_reason: str | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    first_token_time: float | None = None
    # speculation
    num_steps: int = 0  # verification steps
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    drafting: SeqDraftState = field(default_factory=SeqDraftState)  # its acceptance, for the draft planner
    # target hidden features not yet handed to an EAGLE proposer: tensors for positions
    # features_start, features_start + 1, ...
    features: list = field(default_factory=list)
    features_start: int = 0
    # with params.logprobs: one TokenLogprob per output token (None for tokens of a resumed request)
    logprobs: list | None = None
    prompt_logprobs: list | None = None  # with params.prompt_logprobs: one per prompt token, after the prefill
    grammar: object = None  # with params.structured: a rayspec.sampling.structured.GrammarState, advanced by each token
    # chunked prefill: True once the whole prompt (and a resumed request's earlier output) is in the
    # target's KV cache and the first token is sampled; until then each step prefills a chunk
    prefilled: bool = False
    error: str | None = None  # why the engine failed this request (finish_reason "error")
    num_cached_tokens: int | None = None  # prompt tokens found in the prefix cache at its first admission
    num_preemptions: int = 0  # times its KV cache was freed to make room (recomputed when admitted again)
    prefill_start: int = 0  # where its prefill started at its last admission (its cached prefix)
    _sent: int = 0  # characters of output_text already handed out by take_new_text
    num_reported_tokens: int = 0  # output tokens already in a RequestOutput (their delta_token_ids)

    def __post_init__(self):
        self.token_ids = list(self.prompt_token_ids)
        if self.params.logprobs is not None:
            self.logprobs = []

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def remaining_tokens(self) -> int:
        return self.max_tokens - self.num_output_tokens

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED

    def append_tokens(self, tokens: list[int]) -> int:
        """Append emitted tokens one by one until a stop condition; returns how many were kept."""
        if self.first_token_time is None and tokens:
            self.first_token_time = time.monotonic()
        kept = 0
        for tok in tokens:
            self.token_ids.append(tok)
            kept += 1
            if self._check_stop(tok):
                break
        return kept

    def _check_stop(self, tok: int) -> bool:
        if self.detokenizer is not None:
            self._append_text(self.detokenizer.add(tok))
            if self.finished:
                return True
        if self.grammar is not None and (not self.grammar.accept(tok) or self.grammar.done):
            self.finish("stop")  # the grammar is complete (or failed: nothing valid can follow)
            return True
        if (tok in self.eos_token_ids and not self.params.ignore_eos) or tok in self.params.stop_token_ids:
            self.finish("stop")
        elif self.num_output_tokens >= self.max_tokens:
            self.finish("length")
        return self.finished

    def _append_text(self, delta: str) -> None:
        if not delta:
            return
        old_len = len(self.output_text)
        self.output_text += delta
        for stop in self.params.stop:
            # a stop string may straddle tokens: search from just before the new text
            pos = self.output_text.find(stop, max(0, old_len - len(stop) + 1))
            if pos != -1:
                self.output_text = self.output_text[:pos + (len(stop) if self.params.include_stop_str_in_output else 0)]
                self.finish("stop", flush=False)
                return

    def finish(self, reason: str, flush: bool = True) -> None:
        if self.finished:
            return
        if flush and self.detokenizer is not None:
            self.output_text += self.detokenizer.flush()
        self.status = Status.FINISHED
        self.finish_reason = reason

    def take_new_text(self) -> str:
        """Text not handed out yet. While running, the last len(longest stop string) - 1
        characters stay back: they may begin a stop string, which is never returned."""
        end = len(self.output_text)
        if not self.finished and self.params.stop:
            end -= max(len(s) for s in self.params.stop) - 1
        end = max(end, self._sent)
        text, self._sent = self.output_text[self._sent:end], end
        return text

    def mark_sent(self, chars: int) -> None:
        """The first `chars` characters of the output text were handed out already (elsewhere)."""
        self._sent = max(self._sent, min(chars, len(self.output_text)))

    @property
    def sent_text(self) -> str:
        """All text handed out so far (the concatenation of take_new_text results)."""
        return self.output_text[:self._sent]
