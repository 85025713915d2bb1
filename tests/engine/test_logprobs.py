"""Output logprobs are the target's, whichever proposer drafted the tokens: every emitted token
(accepted draft, recovered or bonus token) reports the raw target log-probability given all the
tokens before it, greedy and sampled, alone and batched, and across a stop."""

from __future__ import annotations

import pytest

from engine_utils import assert_target_logprobs, cached_model, make_engine, run_to_completion
from rayspec.sampling.sampler import SamplingParams

PROMPTS = [
    "The cat sat on the mat. The cat sat on the mat. The cat",
    "one two three one two three one two three one",
    "Hello, world!",
]
METHODS = [
    ("none", dict(method="none")),
    ("ngram", dict(method="ngram", k=4, prompt_lookup_min=1, prompt_lookup_max=3)),
    # adaptive off: the test needs logprobs of accepted drafts, and with the planner on the one-layer
    # self-draft's first drafts were all rejected and the planner stopped drafting (greedy)
    ("draft-self-1layer", dict(method="draft_model", k=3, draft_num_layers=1, adaptive=False)),
]


@pytest.fixture(scope="module")
def tiny_loaded(tiny_model_dir):
    return cached_model(str(tiny_model_dir))


@pytest.mark.parametrize("temperature", [0.0, 0.8], ids=["greedy", "sampled"])
@pytest.mark.parametrize("name,spec", METHODS, ids=[m[0] for m in METHODS])
def test_logprobs_are_the_targets(tiny_model_dir, tiny_loaded, name, spec, temperature):
    engine = make_engine(tiny_model_dir, loaded=tiny_loaded, **spec)
    num_top = [0, 3, 5, 2]
    # the random model's sampled text never repeats itself within 24 tokens, so the n-gram proposer
    # would draft nothing; a fourth request is made to repeat one token (a logit_bias, which its
    # logprobs, the target's raw ones, do not show): its drafts are accepted, sampled too
    params = [SamplingParams(temperature=temperature, seed=i, max_tokens=24, logprobs=num_top[i]) for i in range(3)]
    params.append(SamplingParams(temperature=temperature, seed=3, max_tokens=24, logprobs=num_top[3],
                                 logit_bias={engine.encode(" mat")[0]: 100}))
    prompts = PROMPTS + PROMPTS[:1]
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
    done = run_to_completion(engine)
    for rid, prompt, k in zip(ids, prompts, num_top):
        assert_target_logprobs(tiny_model_dir, engine.encode(prompt), done[rid], k)
    assert done[ids[3]].text == " mat" * 24
    # every speculative case has logprobs of accepted drafts among them (seeded: the same every run)
    assert (engine.stats.num_accepted_tokens > 0) == (name != "none")
    assert (engine.stats.num_draft_tokens > 0) == (name != "none")


def test_logprobs_off_and_across_a_stop(tiny_model_dir, tiny_loaded):
    engine = make_engine(tiny_model_dir, loaded=tiny_loaded, method="ngram", k=4, prompt_lookup_min=1,
                         prompt_lookup_max=3)
    off = engine.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=16))[0]
    assert off.logprobs is None
    # a stop token inside an accepted draft: the tokens after it are dropped, and their logprobs
    stop_at = off.token_ids[5]
    out = engine.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=16, logprobs=2,
                                                       stop_token_ids=[stop_at]))[0]
    assert out.token_ids == off.token_ids[: off.token_ids.index(stop_at) + 1]
    assert_target_logprobs(tiny_model_dir, engine.encode(PROMPTS[0]), out, 2)


def test_resumed_request_reports_only_its_new_tokens(tiny_model_dir, tiny_loaded):
    engine = make_engine(tiny_model_dir, loaded=tiny_loaded, method="ngram", k=4, prompt_lookup_min=1,
                         prompt_lookup_max=3)
    full = engine.generate([PROMPTS[1]], SamplingParams(temperature=0, max_tokens=12, logprobs=1))[0]
    rid = engine.add_request(PROMPTS[1], SamplingParams(temperature=0, max_tokens=12, logprobs=1),
                             resume_output_ids=full.token_ids[:5])
    out = run_to_completion(engine)[rid]
    assert out.token_ids == full.token_ids
    assert out.logprobs[:5] == [None] * 5
    for a, b in zip(out.logprobs[5:], full.logprobs[5:]):
        assert a.token_id == b.token_id and abs(a.logprob - b.logprob) < 1e-4


def test_bad_logprobs_count():
    with pytest.raises(ValueError):
        SamplingParams(logprobs=21)
    with pytest.raises(ValueError):
        SamplingParams(logprobs=-1)


def test_prompt_logprobs_are_the_targets(tiny_model_dir, tiny_loaded):
    """Scoring a prompt (echo): one entry per prompt token, the first without a logprob, the rest the
    target's, across the chunks a long prompt's logits are computed in."""
    from engine_utils import _hf_model
    import torch

    engine = make_engine(tiny_model_dir, loaded=tiny_loaded, max_model_len=1024, method="ngram", k=4,
                         prompt_lookup_min=1, prompt_lookup_max=3)
    prompts = [engine.encode(PROMPTS[0] * 40)[:600], engine.encode(PROMPTS[2])]
    assert len(prompts[0]) == 600  # > 2 chunks of 256 rows
    outs = engine.generate(prompts, [SamplingParams(temperature=0, max_tokens=4, prompt_logprobs=k) for k in (2, 0)])
    for prompt, out, k in zip(prompts, outs, (2, 0)):
        entries = out.prompt_logprobs
        assert [e.token_id for e in entries] == prompt and entries[0].logprob is None
        with torch.no_grad():
            expected = _hf_model(str(tiny_model_dir))(torch.tensor([prompt])).logits[0, :-1].float().log_softmax(-1)
        got = torch.tensor([e.logprob for e in entries[1:]])
        assert torch.allclose(got, expected[torch.arange(len(prompt) - 1), torch.tensor(prompt[1:])], atol=1e-3)
        assert all(len(e.top) == k for e in entries[1:])
        if k:
            assert all(abs(e.top[0][2] - float(expected[j].max())) < 1e-3 for j, e in enumerate(entries[1:]))
        assert out.logprobs is None  # output logprobs were not asked for
