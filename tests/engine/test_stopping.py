"""When a request ends and what it returns: stop strings, stop token ids, EOS / ignore_eos,
exact max_tokens under speculation, seeded sampling, and incremental detokenization."""

from __future__ import annotations

import json
import shutil

import pytest

from engine_utils import cached_model, greedy_reference, make_engine, run_to_completion
from rayspec.engine.llm_engine import InvalidRequestError
from rayspec.engine.sequence import IncrementalDetokenizer
from rayspec.proposers.base import Draft, Proposer, ProposeRequest
from rayspec.sampling.sampler import SamplingParams

PROMPT = "The cat sat on the mat. The cat sat on the"
N = 24
SPECS = [  # every stop condition must hold whatever the proposer drafts
    ("none", dict(method="none")),
    ("ngram", dict(method="ngram", k=4, prompt_lookup_min=1)),
    ("draft_model", dict(method="draft_model", k=3, draft_num_layers=1)),
]
SPEC_IDS = [s[0] for s in SPECS]


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    return cached_model(str(tiny_model_dir))


@pytest.fixture(scope="module")
def baseline(tiny_model_dir, tiny):
    """Greedy target-only output, streamed token by token: (token ids, text, per-token text)."""
    engine = make_engine(tiny_model_dir, "none", loaded=tiny)
    engine.add_request(PROMPT, SamplingParams(temperature=0, max_tokens=N, ignore_eos=True))
    deltas, out = [], None
    while engine.has_unfinished_requests():
        (out,) = engine.step()
        assert len(out.token_ids) == len(deltas) + 1  # one token per step without speculation
        deltas.append(out.delta_text)
    assert "".join(deltas) == out.text
    return out.token_ids, out.text, deltas


def _engine(tiny_model_dir, tiny, spec, **kw):
    spec = dict(spec)
    return make_engine(tiny_model_dir, loaded=tiny, **spec, **kw)


def _boundary_stop(text: str, deltas: list[str]) -> tuple[str, int]:
    """A stop string made of the end of token j's text and the start of token j+1's, first
    occurring exactly there. Returns (stop, j + 1)."""
    offset = 0
    for j in range(len(deltas) - 1):
        offset += len(deltas[j])
        a, b = deltas[j], deltas[j + 1]
        if j >= 3 and len(a.strip()) >= 2 and len(b.strip()) >= 2:
            stop = a[-2:] + b[:2]
            if text.find(stop) == offset - 2:
                return stop, j + 1
    raise AssertionError("no usable token boundary in the baseline text")


@pytest.mark.parametrize("name,spec", SPECS, ids=SPEC_IDS)
def test_stop_string_across_token_boundary(tiny_model_dir, tiny, baseline, name, spec):
    tokens, text, deltas = baseline
    stop, last = _boundary_stop(text, deltas)
    engine = _engine(tiny_model_dir, tiny, spec)
    params = SamplingParams(temperature=0, max_tokens=N, ignore_eos=True, stop=["never-in-this-text", stop])
    rid = engine.add_request(PROMPT, params)
    streamed, final = "", None
    while engine.has_unfinished_requests():
        for out in engine.step():
            streamed += out.delta_text
            final = out
    assert final.request_id == rid and final.finished
    assert final.finish_reason == "stop"
    assert final.text == text[:text.find(stop)]  # the stop string itself is not returned
    assert stop not in final.text
    assert final.token_ids == tokens[:last + 1]  # generation ended at the token completing it
    assert streamed == final.text


@pytest.mark.parametrize("name,spec", SPECS, ids=SPEC_IDS)
def test_stop_token_ids(tiny_model_dir, tiny, baseline, name, spec):
    tokens = baseline[0]
    j = next(i for i in range(5, N) if tokens[i] not in tokens[:i])
    engine = _engine(tiny_model_dir, tiny, spec)
    (out,) = engine.generate([PROMPT], SamplingParams(temperature=0, max_tokens=N, stop_token_ids=[tokens[j]]))
    assert out.finish_reason == "stop"
    assert out.token_ids == tokens[:j + 1]


@pytest.fixture(scope="module")
def eos_model_dir(tmp_path_factory, tiny_model_dir, baseline):
    """The tiny model, but its config names a token the greedy output reaches at index 6 as EOS."""
    tokens = baseline[0]
    j = next(i for i in range(6, N) if tokens[i] not in tokens[:i])
    path = tmp_path_factory.mktemp("eos") / "model"
    shutil.copytree(tiny_model_dir, path)
    config = json.loads((path / "config.json").read_text())
    config["eos_token_id"] = tokens[j]
    (path / "config.json").write_text(json.dumps(config))
    return path, j


@pytest.mark.parametrize("name,spec", SPECS[:2], ids=SPEC_IDS[:2])
def test_eos_and_ignore_eos(eos_model_dir, baseline, name, spec):
    path, j = eos_model_dir
    tokens = baseline[0]
    engine = make_engine(path, **spec)
    assert tokens[j] in engine.eos_token_ids
    stopped, ignored = engine.generate([PROMPT, PROMPT], [
        SamplingParams(temperature=0, max_tokens=N),
        SamplingParams(temperature=0, max_tokens=N, ignore_eos=True)])
    assert stopped.finish_reason == "stop" and stopped.token_ids == tokens[:j + 1]
    assert ignored.finish_reason == "length" and ignored.token_ids == tokens


class OracleProposer(Proposer):
    """Drafts the target's own greedy continuation, so every draft is accepted and each step
    could emit k + 1 tokens: the engine alone must keep outputs at max_tokens."""

    name = "oracle"

    def __init__(self, prompt_len: int, continuation: list[int]):
        self.prompt_len, self.continuation = prompt_len, continuation
        self.asked: list[ProposeRequest] = []

    def propose(self, requests):
        self.asked += requests
        out = []
        for r in requests:
            done = len(r.token_ids) - self.prompt_len
            out.append(Draft(self.continuation[done:done + r.num_tokens]))
        return out


@pytest.mark.parametrize("max_tokens", [1, 2, 3, 5, 6, 7, 11, N])
def test_exact_max_tokens_when_every_draft_is_accepted(tiny_model_dir, tiny, baseline, max_tokens):
    tokens = baseline[0]
    k = 5
    prompt_ids = tiny[1].encode(PROMPT)
    proposer = OracleProposer(len(prompt_ids), tokens + [0] * 10)
    # adaptive off: counts the steps of a fixed budget of k (the planner ramps its budget up first)
    engine = make_engine(tiny_model_dir, "ngram", k=k, loaded=tiny, proposer=proposer, adaptive=False)
    (out,) = engine.generate([prompt_ids], SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
    assert out.finish_reason == "length"
    assert out.token_ids == tokens[:max_tokens]
    # every draft accepted, but never one more than fits: the last step lands exactly on max_tokens
    assert engine.stats.num_accepted_tokens == engine.stats.num_draft_tokens
    assert all(r.num_tokens <= k for r in proposer.asked)
    assert out.num_steps == -(-(max_tokens - 1) // (k + 1))


@pytest.mark.parametrize("adaptive", [False, True], ids=["fixed-k", "adaptive-k"])
@pytest.mark.parametrize("name,spec", SPECS, ids=SPEC_IDS)
def test_seed_reproduces_sampled_output(tiny_model_dir, tiny, name, spec, adaptive):
    """A seeded sampled request repeats its output, alone and in a batch, and each request of a batch
    draws from its own random streams (target and draft): two copies of one seeded request in one
    batch come out equal (a shared stream would interleave their draws), beside other requests.
    Alone and in a batch the outputs may differ: a sequence's logits differ in their last bits with
    the batch's row count (the CPU kernels' blocking: 1.9e-6 in the draft's logits here), and over a
    flat 38,000-token row that can move a draw, as in any engine without batch-invariant kernels."""
    def sampled(seed: int, batch: bool) -> list[int]:
        engine = _engine(tiny_model_dir, tiny, spec, adaptive=adaptive)
        params = SamplingParams(temperature=1.5, top_p=0.95, max_tokens=N, ignore_eos=True, seed=seed)
        if not batch:
            return engine.generate([PROMPT], params)[0].token_ids
        other = SamplingParams(temperature=1.0, max_tokens=10, seed=seed + 100)
        outs = engine.generate(["Hello", PROMPT, PROMPT], [other, params, params])
        assert outs[1].token_ids == outs[2].token_ids
        return outs[1].token_ids

    first = sampled(42, batch=False)
    assert len(first) == N
    assert sampled(42, batch=False) == first
    batched = sampled(42, batch=True)
    assert len(batched) == N and sampled(42, batch=True) == batched
    assert sampled(43, batch=False) != first


# ---- incremental detokenization -------------------------------------------------------------

TRICKY = "Hi 👋🏽 世界! Ça va? 🤖 ещё… naïve café 🇫🇷 ∑x² — done"


@pytest.mark.parametrize("prompt", ["", "Say: ", "日本"])
def test_incremental_detokenizer_never_splits_characters(tiny, prompt):
    tok = tiny[1]
    ids = tok.encode(TRICKY, add_special_tokens=False)
    # the test is only meaningful if some character really spans several tokens
    assert any("\ufffd" in tok.decode([t]) for t in ids)
    detok = IncrementalDetokenizer(tok, tok.encode(prompt, add_special_tokens=False), skip_special_tokens=True)
    chunks = [detok.add(t) for t in ids]
    assert not any("\ufffd" in c for c in chunks), chunks
    assert "".join(chunks) + detok.flush() == tok.decode(ids) == TRICKY


def test_streamed_text_of_random_tokens(tiny_model_dir, tiny):
    """Sampled output of a random model (byte-level pieces included): the streamed deltas add up
    to the final text, which equals decoding all output tokens at once."""
    engine = make_engine(tiny_model_dir, "ngram", loaded=tiny, prompt_lookup_min=1)
    for i in range(4):
        engine.add_request("你好, 世界 🙂", SamplingParams(temperature=2.0, max_tokens=32, ignore_eos=True, seed=i))
    streamed: dict[str, str] = {}
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            streamed[out.request_id] = streamed.get(out.request_id, "") + out.delta_text
            if out.finished:
                done[out.request_id] = out
    for rid, out in done.items():
        assert streamed[rid] == out.text
        assert out.text == tiny[1].decode(out.token_ids, skip_special_tokens=True)


# ---- the same on SmolLM2, where n-gram drafts are accepted several tokens at a time ----------

SMOL_PROMPT = "List the colors: red, green, blue, red, green, blue, red, green,"
SMOL_N = 32  # as in test_greedy_equivalence, so the cached reference is shared


@pytest.mark.slow
def test_smollm2_stops_inside_accepted_drafts(smollm2):
    model, tok = cached_model(smollm2)
    ref = list(greedy_reference(smollm2, SMOL_PROMPT, SMOL_N))
    ref_text = tok.decode(ref, skip_special_tokens=True)
    stop = "green, blue"
    assert stop in ref_text
    j = next(i for i in range(4, SMOL_N) if ref[i] not in ref[:i])
    engine = make_engine(smollm2, "ngram", k=4, loaded=(model, tok))
    params = [SamplingParams(temperature=0, max_tokens=SMOL_N, stop=[stop]),
              SamplingParams(temperature=0, max_tokens=SMOL_N, stop_token_ids=[ref[j]]),
              SamplingParams(temperature=0, max_tokens=13),
              SamplingParams(temperature=0, max_tokens=SMOL_N)]
    by_stop, by_token, by_length, full = engine.generate([SMOL_PROMPT] * 4, params)
    assert full.token_ids == ref and full.text == ref_text
    assert by_stop.finish_reason == "stop" and by_stop.text == ref_text[:ref_text.find(stop)]
    assert ref[:len(by_stop.token_ids)] == by_stop.token_ids
    assert by_token.finish_reason == "stop" and by_token.token_ids == ref[:j + 1]
    assert by_length.finish_reason == "length" and by_length.token_ids == ref[:13]
    # drafts were accepted several at a time: stop conditions were checked inside multi-token steps
    assert full.num_steps < SMOL_N - 4 and by_length.num_steps < 12
    assert engine.stats.mean_acceptance_length > 2


@pytest.mark.parametrize("name,spec", SPECS, ids=SPEC_IDS)
@pytest.mark.parametrize("cut", [1, 9])
def test_resumed_request_continues_the_same_output(tiny_model_dir, tiny, baseline, name, spec, cut):
    """A request resumed from the first `cut` output tokens (a replica died, another takes over):
    the output token ids are the uninterrupted ones, the text not yet handed out follows on
    exactly, and a stop string that straddles the resume point still stops it."""
    tokens, text, deltas = baseline
    sent = len("".join(deltas[:cut]))
    engine = _engine(tiny_model_dir, tiny, spec)
    rid = engine.add_request(PROMPT, SamplingParams(temperature=0, max_tokens=N, ignore_eos=True),
                             resume_output_ids=tokens[:cut], resume_sent_chars=sent)
    outs = []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.request_id == rid]
    assert outs[-1].token_ids == tokens and outs[-1].finish_reason == "length"
    assert "".join(o.delta_text for o in outs) == text[sent:]

    stop, j = _boundary_stop(text, deltas)  # resumed right after the stop string's first half
    engine.add_request(PROMPT, SamplingParams(temperature=0, max_tokens=N, ignore_eos=True, stop=[stop]),
                       resume_output_ids=tokens[:j], resume_sent_chars=0)
    (out,) = run_to_completion(engine).values()
    assert out.finish_reason == "stop" and out.text == text[: text.find(stop)]


def test_resume_refuses_what_cannot_continue(tiny_model_dir, tiny, baseline):
    tokens, _, _ = baseline
    engine = _engine(tiny_model_dir, tiny, dict(method="none"))
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    with pytest.raises(InvalidRequestError, match="no token"):
        engine.add_request(PROMPT, params, resume_output_ids=tokens[:4])
    with pytest.raises(InvalidRequestError, match="must be in"):
        engine.add_request(PROMPT, params, resume_output_ids=[10**9])
