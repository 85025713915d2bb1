"""Penalties and logit bias keep speculation lossless: each verification row is processed in its
own path's context, so greedy output equals target-only decoding with the same parameters, which
in turn equals a step-by-step reference written here from the definitions (HF forward)."""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from engine_utils import OracleProposer, _hf_model, cached_model, make_engine, run_to_completion
from rayspec.sampling.logits_processing import verification_row_extra
from rayspec.sampling.sampler import SamplingParams

PROMPTS = [
    "The cat sat on the mat. The cat sat on the mat. The cat",
    "one two three one two three one two three one",
    "a b c d a b c d a b c d a b",
]
# per prompt; "ban-4th": a -100 bias on the 4th token of its plain greedy output (the tiny model's
# outputs of the first prompt never repeat, so only a bias changes them)
PENALTIES = [
    dict(frequency_penalty=-2.0, logit_bias="ban-4th"),
    dict(frequency_penalty=2.0),
    dict(presence_penalty=2.0, repetition_penalty=3.0),
]
METHODS = [
    ("none", dict(method="none")),
    ("ngram", dict(method="ngram", k=4, prompt_lookup_min=1, prompt_lookup_max=3)),
    ("draft-self-1layer", dict(method="draft_model", k=3, draft_num_layers=1)),
]


def naive_processed(logits: torch.Tensor, prompt: list[int], output: list[int], params: SamplingParams):
    """One row, from the definitions: bias, then HF repetition penalty over prompt and output,
    then OpenAI frequency and presence penalties over the output."""
    x = logits.clone().float()
    for t, b in (params.logit_bias or {}).items():
        x[t] += b
    for t in set(prompt) | set(output):
        if params.repetition_penalty != 1.0:
            x[t] = x[t] / params.repetition_penalty if x[t] > 0 else x[t] * params.repetition_penalty
    for t, c in Counter(output).items():
        x[t] -= params.frequency_penalty * c + params.presence_penalty
    return x


def naive_greedy(model_dir, prompt: list[int], params: SamplingParams) -> list[int]:
    hf, out = _hf_model(str(model_dir)), []
    for _ in range(params.max_tokens):
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + out])).logits[0, -1]
        out.append(int(naive_processed(logits, prompt, out, params).argmax()))
    return out


@pytest.fixture(scope="module")
def tiny_loaded(tiny_model_dir):
    return cached_model(str(tiny_model_dir))


@pytest.fixture(scope="module")
def reference(tiny_model_dir, tiny_loaded):
    engine = make_engine(tiny_model_dir, "none", loaded=tiny_loaded)
    out = []
    for prompt, pen in zip(PROMPTS, PENALTIES):
        ids = engine.encode(prompt)
        plain = naive_greedy(tiny_model_dir, ids, SamplingParams(temperature=0, max_tokens=20))
        if pen.get("logit_bias") == "ban-4th":
            pen = dict(pen, logit_bias={plain[3]: -100.0, plain[0]: 0.5})
        params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, **pen)
        expected = naive_greedy(tiny_model_dir, ids, params)
        assert expected != plain, "the penalties changed nothing: this case tests nothing"
        out.append((params, expected))
    return out


@pytest.mark.parametrize("name,spec", METHODS, ids=[m[0] for m in METHODS])
def test_greedy_with_penalties_matches_reference(tiny_model_dir, tiny_loaded, reference, name, spec):
    engine = make_engine(tiny_model_dir, loaded=tiny_loaded, **spec)
    ids = [engine.add_request(p, params) for p, (params, _) in zip(PROMPTS, reference)]
    plain = engine.add_request(PROMPTS[0], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))
    done = run_to_completion(engine)  # batched: processed and plain rows in the same forwards
    for i, (rid, (_, expected)) in enumerate(zip(ids, reference)):
        assert done[rid].token_ids == expected, f"{name}: prompt {i}"
    assert done[plain].token_ids == naive_greedy(tiny_model_dir, engine.encode(PROMPTS[0]),
                                                 SamplingParams(temperature=0, max_tokens=20))
    if name != "none":
        assert engine.stats.num_accepted_tokens > 0


@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_accepted_drafts_are_processed_in_their_paths_context(tiny_model_dir, tiny_loaded, reference, tree):
    """Every draft is the right token, so each step accepts several and every later row must see
    the drafts before it on its path (a repeated token is penalized already inside one step)."""
    probe = make_engine(tiny_model_dir, "none", loaded=tiny_loaded)
    expected = {tuple(probe.encode(p)): out for p, (_, out) in zip(PROMPTS, reference)}
    wrong = min(set(range(100)) - {t for out in expected.values() for t in out})
    engine = make_engine(tiny_model_dir, "ngram", k=6, loaded=tiny_loaded, eagle_topk=2 if tree else 1,
                         tree_max_batch=8, proposer=OracleProposer(expected, 6, wrong))
    ids = [engine.add_request(p, params) for p, (params, _) in zip(PROMPTS, reference)]
    done = run_to_completion(engine)
    for i, (rid, (_, out)) in enumerate(zip(ids, reference)):
        assert done[rid].token_ids == out, f"prompt {i}"
    assert engine.stats.num_accepted_tokens >= 30


def test_row_extra_follows_chain_and_tree_paths():
    assert verification_row_extra(1, [5, 6, 7], None) == [[], [5], [5, 6], [5, 6, 7]]
    assert verification_row_extra(2, [5, 6], None) == [[], [], [5], [5, 6]]
    # tree: 0 and 1 children of the root, 2 child of 0, 3 child of 2
    assert verification_row_extra(1, [5, 6, 7, 8], [-1, -1, 0, 2]) == [[], [5], [6], [5, 7], [5, 7, 8]]


def test_bad_penalty_values(tiny_model_dir, tiny_loaded):
    # 5e-324 (a denormal > 0, found by tests/serve/test_fuzz_routes.py) divided logits into inf: a 500
    for bad in (dict(presence_penalty=2.5), dict(frequency_penalty=-3), dict(repetition_penalty=0),
                dict(repetition_penalty=5e-324), dict(repetition_penalty=1e300), dict(logit_bias={1: 101.0}),
                dict(temperature=float("nan"))):
        with pytest.raises(ValueError):
            SamplingParams(**bad)
    assert SamplingParams(temperature=1e-300).greedy and not SamplingParams(temperature=1e-5).greedy
    engine = make_engine(tiny_model_dir, loaded=tiny_loaded)
    from rayspec.engine.llm_engine import InvalidRequestError
    with pytest.raises(InvalidRequestError):
        engine.add_request("hi", SamplingParams(logit_bias={10**6: 1.0}))


@pytest.mark.parametrize("name,spec", METHODS, ids=[m[0] for m in METHODS])
def test_min_tokens_holds_back_the_end(tiny_model_dir, tiny_loaded, name, spec):
    """No stop token before min_tokens, also inside a step that accepts several drafts; the output
    equals target-only decoding with the same min_tokens."""
    base = make_engine(tiny_model_dir, "none", loaded=tiny_loaded)
    first = base.generate([PROMPTS[1]], SamplingParams(temperature=0, max_tokens=20))[0].token_ids
    enders = sorted(set(first[:6]))  # tokens the unconstrained output would stop at early
    params = SamplingParams(temperature=0, max_tokens=20, min_tokens=8, stop_token_ids=enders)
    expected = base.generate([PROMPTS[1]], params)[0]
    assert len(expected.token_ids) >= 8 and not set(expected.token_ids[:7]) & set(enders)
    assert base.generate([PROMPTS[1]], SamplingParams(temperature=0, max_tokens=20, stop_token_ids=enders))[0] \
        .token_ids == first[:1]  # without min_tokens it stops at once
    engine = make_engine(tiny_model_dir, loaded=tiny_loaded, **spec)
    assert engine.generate([PROMPTS[1]], params)[0].token_ids == expected.token_ids
    with pytest.raises(ValueError):
        SamplingParams(max_tokens=4, min_tokens=5)


def test_include_stop_str_in_output(tiny_model_dir, tiny_loaded):
    engine = make_engine(tiny_model_dir, "ngram", k=4, loaded=tiny_loaded, prompt_lookup_min=1, prompt_lookup_max=3)
    text = engine.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=20))[0].text
    stop = text[3:6]
    cut = engine.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=20, stop=[stop]))[0]
    kept = engine.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=20, stop=[stop],
                                                        include_stop_str_in_output=True))[0]
    assert cut.text == text[:text.index(stop)] and kept.text == cut.text + stop
    assert kept.finish_reason == cut.finish_reason == "stop"
