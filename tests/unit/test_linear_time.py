"""No quadratic paths on the engine thread or the ingress for any output (issue #35): the
incremental detokenizer (rayspec.engine.sequence) and the streamed tool-call parser (rayspec.sampling.tool_parsers)
cost the same per token at the end of a long adversarial output as at its start.

Adversarial outputs: a special token again and again (a `logit_bias` on it with `ignore_eos`:
skipped in the text, so the text never grows), a byte token that never completes a UTF-8 character
(the text ends in U+FFFD forever), and for the parser text with no call in it, or only blanks (a call
may still come first). Per-token cost is the median of 100 timed calls, first 100 vs last 100 of a
few thousand, compared as a ratio (flat: about 1; quadratic: 6-33x here), best of three tries
against a loaded machine's noise.
"""

from __future__ import annotations

import statistics
import time

import pytest

from conftest import smollm2_dir
from rayspec.engine.sequence import IncrementalDetokenizer
from rayspec.sampling.tool_parsers import ToolCallStreamParser, get_parser

FLAT = 3.0  # last-100 / first-100 median cost; the quadratic code measured 6x to 33x here


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_dir())


def _growth(make, n: int) -> float:
    """make() -> feed(i); the ratio of the median cost of the last 100 calls to the first 100."""
    best = float("inf")
    for _ in range(3):
        feed, costs = make(), []
        for i in range(n):
            started = time.perf_counter()
            feed(i)
            costs.append(time.perf_counter() - started)
        best = min(best, statistics.median(costs[-100:]) / statistics.median(costs[:100]))
        if best < FLAT:
            break
    return best


def _incomplete_byte(tokenizer) -> int:
    return next(i for i in range(512) if tokenizer.decode([i]) == "\ufffd")  # a lone continuation byte


@pytest.mark.parametrize("kind", ["special", "incomplete"])
def test_detokenizer_cost_per_token_stays_flat(tokenizer, kind):
    token = tokenizer.all_special_ids[0] if kind == "special" else _incomplete_byte(tokenizer)

    def make():
        detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("Hello there"), skip_special_tokens=True)
        return lambda i: detok.add(token)

    assert _growth(make, 2000) < FLAT


def test_detokenizer_text_is_the_whole_decode(tokenizer):
    """Bounded windows change no text: special tokens among words, a character split over byte
    tokens, a run of invalid bytes; the pieces add up to decoding everything at once."""
    words = tokenizer.encode(" the quick brown fox, élan — 日本語 ok")
    special, bad = tokenizer.all_special_ids[0], _incomplete_byte(tokenizer)
    ids = words[:3] + [special] * 20 + words[3:] + [bad] * 15 + words[:2] + [special, bad, special] + words[2:5]
    prompt = tokenizer.encode("Say:")
    detok = IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens=True)
    text = "".join(detok.add(t) for t in ids) + detok.flush()
    assert text == tokenizer.decode(prompt[-4:] + ids, skip_special_tokens=True)[len(tokenizer.decode(prompt[-4:])):]


@pytest.mark.parametrize("name, delta", [("hermes", "no call here"), ("llama3_json", "          "),
                                         ("mistral", "x [TOOL_CALL")])  # a marker's head held back, then let go
def test_tool_call_stream_cost_per_delta_stays_flat(name, delta):
    def make():
        stream = ToolCallStreamParser(get_parser(name))
        return lambda i: stream.feed(delta, False)

    assert _growth(make, 5000) < FLAT


def test_streamed_detokenizer_text_is_the_whole_decode(tokenizer):
    """The DecodeStream path (tokenizers, one Rust call a token; SmolLM2's fast tokenizer takes it) on
    random valid text: words, accents, CJK, emoji with skin tones and flags (characters split over
    byte tokens), skipped special tokens among them, after random prompts: its deltas joined are
    the whole decode, as the windowed path's are. (On invalid UTF-8, stray bytes, where U+FFFD falls
    depends on the window in either path: of 300 random byte soups, the windowed path's text differed
    from one whole decode in 2, the stream's in 6; a model emits such bytes only where its output is
    not text.)"""
    import random

    assert IncrementalDetokenizer(tokenizer, [], True)._stream is not None
    rng = random.Random(0)
    pool = ["the", " quick", " fox", ",", " élan", " —", " 日本語", "世界", " 👋🏽", "🇫🇷", " ∑x²", "ещё…", " naïve",
            "\n", "  ", "🤖", "ok", " Ça", "😀😀"]
    special = tokenizer.all_special_ids
    for _ in range(200):
        ids = []
        for _ in range(rng.randint(1, 12)):
            ids += tokenizer.encode(rng.choice(pool), add_special_tokens=False)
            if rng.random() < 0.2:
                ids += [rng.choice(special)] * rng.randint(1, 3)
        prompt = [rng.randrange(tokenizer.vocab_size) for _ in range(rng.randint(0, 6))]
        context = tokenizer.decode(prompt[-4:], skip_special_tokens=True)
        whole = tokenizer.decode(prompt[-4:] + ids, skip_special_tokens=True)[len(context):]
        for stream in (True, False):
            detok = IncrementalDetokenizer(tokenizer, prompt, skip_special_tokens=True)
            if not stream:
                detok._stream = None
            deltas = [detok.add(t) for t in ids]
            assert "".join(deltas) + detok.flush() == whole, (stream, prompt, ids)
            assert not any("\ufffd" in d for d in deltas)
