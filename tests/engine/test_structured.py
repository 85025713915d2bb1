"""Structured output (JSON schema, regex, Lark grammar, choices) stays lossless under speculation:
each verification row is masked with the grammar state after the drafts before it on its path.

Greedy: speculative output == target-only output with the same grammar == a step-by-step
reference (HF forward, its own llguidance matcher). Sampled: the choice frequencies match the
exact probabilities of the masked target (summed over every tokenization of each choice)."""

from __future__ import annotations

import json
import math

import pytest
import torch

from engine_utils import OracleProposer, _hf_model, binomial_interval, cached_model, make_engine, run_to_completion
from reference import processed_probs
from rayspec.engine.llm_engine import InvalidRequestError
from rayspec.proposers.base import Draft, Proposer
from rayspec.sampling.sampler import SamplingParams
from rayspec.sampling.structured import StructuredOutput

import llguidance

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["answer", "ok", "tag"],
          "properties": {"answer": {"enum": ["yes", "no", "maybe"]}, "ok": {"type": "boolean"},
                         "tag": {"type": "string", "pattern": "^[a-z]{2,5}$"}}}
CASES = [  # (prompt, structured output)
    ("The cat sat on the mat. The cat sat on the mat. The cat", StructuredOutput.json_schema(SCHEMA)),
    ("one two three one two three one two three one", StructuredOutput("regex", r"[0-9]{3}-[a-z]{2,4} (one|two){1,3}")),
    ("a b c d a b c d a b c d a b", StructuredOutput.choice(["alpha beta", "gamma", "delta epsilon zeta"])),
    ("Hello, world!", StructuredOutput("grammar", 'start: "[" item ("," item)? ("," item)? "]"\nitem: /[a-c]{1,3}/')),
]
METHODS = [
    ("none", dict(method="none")),
    ("ngram", dict(method="ngram", k=4, prompt_lookup_min=1, prompt_lookup_max=3)),
    ("draft-self-1layer", dict(method="draft_model", k=3, draft_num_layers=1)),
]
MAX_TOKENS = 40


def grammar_matcher(engine, spec: StructuredOutput):
    import llguidance.hf

    tok = llguidance.hf.from_tokenizer(engine.tokenizer, n_vocab=engine.model.args.vocab_size,
                                       eos_token=sorted(engine.eos_token_ids))
    return llguidance.LLMatcher(tok, spec.grammar_text(), log_level=0)


def allowed(matcher, vocab: int) -> torch.Tensor:
    import llguidance.torch

    mask = torch.full((1, (vocab + 31) // 32), -1, dtype=torch.int32)
    llguidance.torch.fill_next_token_bitmask(matcher, mask, 0)
    return torch.tensor([(int(mask[0, t // 32]) >> (t % 32)) & 1 for t in range(vocab)], dtype=torch.bool)


def naive_greedy(model_dir, engine, prompt: str, spec: StructuredOutput) -> list[int]:
    """Target-only, one token at a time: mask, argmax, consume; stop when the grammar is complete."""
    hf, matcher, ids, out = _hf_model(str(model_dir)), grammar_matcher(engine, spec), engine.encode(prompt), []
    vocab = engine.model.args.vocab_size
    while len(out) < MAX_TOKENS and not matcher.is_stopped():
        with torch.no_grad():
            logits = hf(torch.tensor([ids + out])).logits[0, -1].float()
        tok = int(logits.masked_fill(~allowed(matcher, vocab), float("-inf")).argmax())
        assert matcher.consume_token(tok)
        out.append(tok)
        if tok in engine.eos_token_ids:
            break
    return out


@pytest.fixture(scope="module")
def tiny_loaded(tiny_model_dir):
    return cached_model(str(tiny_model_dir))


@pytest.fixture(scope="module")
def reference(tiny_model_dir, tiny_loaded):
    engine = make_engine(tiny_model_dir, "none", loaded=tiny_loaded)
    return [naive_greedy(tiny_model_dir, engine, prompt, spec) for prompt, spec in CASES]


def _check_output(engine, spec: StructuredOutput, out) -> None:
    text = out.text
    assert out.finish_reason == "stop", (spec.kind, text)  # the grammar completed within MAX_TOKENS
    if spec.kind == "json":
        value = json.loads(text)
        assert value["answer"] in ("yes", "no", "maybe") and isinstance(value["ok"], bool)
        assert 2 <= len(value["tag"]) <= 5
    elif spec.kind == "choice":
        assert text in json.loads(spec.value)


@pytest.mark.parametrize("name,spec", METHODS, ids=[m[0] for m in METHODS])
def test_greedy_structured_matches_reference(tiny_model_dir, tiny_loaded, reference, name, spec):
    engine = make_engine(tiny_model_dir, loaded=tiny_loaded, max_model_len=512, **spec)
    params = [SamplingParams(temperature=0, max_tokens=MAX_TOKENS, structured=s) for _, s in CASES]
    ids = [engine.add_request(p, sp) for (p, _), sp in zip(CASES, params)]
    plain = engine.add_request(CASES[0][0], SamplingParams(temperature=0, max_tokens=12))  # unconstrained, batched
    done = run_to_completion(engine)
    for i, (rid, (_, s), expected) in enumerate(zip(ids, CASES, reference)):
        assert done[rid].token_ids == expected, f"{name}: case {i} ({s.kind})"
        _check_output(engine, s, done[rid])
    assert done[plain].finish_reason == "length" and len(done[plain].token_ids) == 12
    assert engine.kv.num_free_slots == engine.num_slots


@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_accepted_drafts_are_masked_in_their_paths_state(tiny_model_dir, tiny_loaded, reference, tree):
    """Drafts are the right tokens (plus wrong siblings in a tree): each later row must be masked
    with the grammar state after the drafts before it, or the right token would be masked out."""
    probe = make_engine(tiny_model_dir, "none", loaded=tiny_loaded)
    expected = {tuple(probe.encode(p)): out for (p, _), out in zip(CASES, reference)}
    wrong = min(set(range(100)) - {t for out in expected.values() for t in out})
    engine = make_engine(tiny_model_dir, "ngram", k=6, loaded=tiny_loaded, eagle_topk=2 if tree else 1,
                         tree_max_batch=8, proposer=OracleProposer(expected, 6, wrong, force_tree=tree),
                         max_model_len=512)
    ids = [engine.add_request(p, SamplingParams(temperature=0, max_tokens=MAX_TOKENS, structured=s)) for p, s in CASES]
    done = run_to_completion(engine)
    for i, (rid, out) in enumerate(zip(ids, reference)):
        assert done[rid].token_ids == out, f"case {i}"
    assert engine.stats.num_accepted_tokens >= 20


class WrongProposer(Proposer):
    """Always drafts the same useless token."""

    def __init__(self, token: int, tree: bool = False):
        self.token, self.tree = token, tree

    def propose(self, requests):
        if self.tree:  # two wrong children of the root, a wrong grandchild
            return [Draft([self.token, self.token + 1, self.token], parents=[-1, -1, 0]) for r in requests]
        return [Draft([self.token] * r.num_tokens) for r in requests]


@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
def test_forced_tokens_are_drafted(tiny_model_dir, tiny_loaded, reference, tree):
    """Under a grammar the engine drafts what the grammar forces (JSON keys and punctuation here)
    in place of the proposer's tokens, and stops a draft at a token the grammar forbids: a proposer
    that is always wrong still gets tokens accepted, and the output stays the target's."""
    prompt, spec = CASES[0]
    engine = make_engine(tiny_model_dir, "ngram", k=8, loaded=tiny_loaded, proposer=WrongProposer(0, tree),
                         eagle_topk=2 if tree else 1, tree_max_batch=8)
    out = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=MAX_TOKENS, structured=spec))[0]
    assert out.token_ids == reference[0]
    stats = engine.stats
    assert stats.num_accepted_tokens >= 5 and stats.num_accepted_tokens > 0.5 * stats.num_draft_tokens
    sampled = engine.generate([prompt], SamplingParams(temperature=1.0, seed=0, max_tokens=MAX_TOKENS,
                                                       structured=spec))[0]
    _check_output(engine, spec, sampled)


def _exact_choice_probs(model_dir, engine, prompt: str, spec: StructuredOutput, temperature: float) -> dict:
    """P(each choice) under the masked target at `temperature`, summed over every token path."""
    hf, vocab, ids = _hf_model(str(model_dir)), engine.model.args.vocab_size, engine.encode(prompt)
    probs: dict[str, float] = {}

    def walk(matcher, out: list[int], p: float) -> None:
        if matcher.is_stopped():
            text = engine.tokenizer.decode(out, skip_special_tokens=True)
            probs[text] = probs.get(text, 0.0) + p
            return
        with torch.no_grad():
            logits = hf(torch.tensor([ids + out])).logits[0, -1].float()
        row = torch.from_numpy(processed_probs(logits.masked_fill(~allowed(matcher, vocab), float("-inf")),
                                               temperature)[0])  # (numpy: not rayspec's transform)
        for tok in row.nonzero().flatten().tolist():
            if row[tok] > 1e-7:
                assert matcher.consume_token(tok)
                walk(matcher, out + [tok], p * float(row[tok]))
                matcher.rollback(1)

    walk(grammar_matcher(engine, spec), [], 1.0)
    return probs


@pytest.mark.parametrize("name,spec", METHODS[1:], ids=[m[0] for m in METHODS[1:]])
def test_sampled_choices_follow_the_masked_target(tiny_model_dir, tiny_loaded, name, spec):
    """Unseeded requests (their drafts verified by rejection sampling; a seeded one would draw
    coupled) choose each choice as often as the masked target does, summed over its token paths.
    Each frequency must lie in the interval it leaves with probability 1e-4 (binomial_interval,
    +-0.035-0.057 at n = 1,500): a choice's probability off by 0.06 (at 0.1) to 0.09 (at 0.5) is
    caught with probability 0.99. Every draw under a grammar, audited against its exact law, in
    every topology: tests/engine/test_lossless_grid.py (column structured)."""
    choice = StructuredOutput.choice(["alpha beta", "gamma delta", "gamma", "epsilon"])
    prompt, temperature, n = "alpha beta gamma delta epsilon gamma alpha beta gamma delta epsilon", 1.5, 1500
    engine = make_engine(tiny_model_dir, loaded=tiny_loaded, max_num_seqs=64, engine_seed=4242, **spec)
    exact = _exact_choice_probs(tiny_model_dir, engine, prompt, choice, temperature)
    assert set(exact) <= set(json.loads(choice.value)) and math.isclose(sum(exact.values()), 1.0, abs_tol=1e-4)
    assert sum(p > 0.05 for p in exact.values()) >= 2, exact  # a real distribution, not a forced choice
    outs = engine.generate([prompt] * n, [SamplingParams(temperature=temperature, max_tokens=12, structured=choice)
                                          for _ in range(n)])
    counts = {c: sum(o.text == c for o in outs) for c in json.loads(choice.value)}
    assert sum(counts.values()) == n
    for c, k in counts.items():
        low, high = binomial_interval(exact.get(c, 0.0), n)
        assert low <= k / n <= high, (c, k / n, exact.get(c, 0.0))
    assert engine.stats.num_draft_tokens > 0


def test_bad_grammars_are_request_errors(tiny_model_dir, tiny_loaded):
    engine = make_engine(tiny_model_dir, loaded=tiny_loaded)
    for bad in (StructuredOutput("regex", "[a-"), StructuredOutput("json", "{not json"),
                StructuredOutput("json", '{"type": "wat"}'), StructuredOutput("grammar", "start: ("),
                StructuredOutput("choice", "[]")):
        with pytest.raises(InvalidRequestError):
            engine.add_request("hi", SamplingParams(structured=bad))
    with pytest.raises(ValueError):
        StructuredOutput("yaml", "x")


def test_generate_cli_with_a_regex(tiny_model_dir, capsys):
    import re

    from rayspec_cli.main import main

    assert main(["generate", "--model", str(tiny_model_dir), "--method", "ngram", "--prompt", "hi",
                 "--max-tokens", "16", "--regex", "[0-9]{3}-[a-z]{2}"]) == 0
    assert re.fullmatch("[0-9]{3}-[a-z]{2}", capsys.readouterr().out.splitlines()[0])


def test_parents_first_reorders_added_nodes():
    from rayspec.sampling.structured import _parents_first

    # node 2 hangs below node 3, which comes later
    assert _parents_first([10, 11, 12, 13], [-1, -1, 3, 0]) == ([10, 11, 13, 12], [-1, -1, 0, 2])


def test_forced_tokens_are_drafted_when_drafting_is_off_for_the_batch(tiny_model_dir, tiny_loaded, reference):
    """disable_by_batch_size turns the proposer off for large batches; forced tokens still go in."""
    engine = make_engine(tiny_model_dir, "ngram", k=8, loaded=tiny_loaded, disable_by_batch_size=1,
                         max_model_len=512)
    params = [SamplingParams(temperature=0, max_tokens=MAX_TOKENS, structured=s) for _, s in CASES]
    outs = engine.generate([p for p, _ in CASES], params)
    assert [o.token_ids for o in outs] == reference
    assert engine.stats.num_accepted_tokens >= 5
    off = engine.generate([CASES[0][0]], SamplingParams(temperature=0, max_tokens=MAX_TOKENS, structured=CASES[0][1],
                                                         num_speculative_tokens=0))[0]
    assert off.token_ids == reference[0] and off.num_draft_tokens == 0  # "no speculation" is still honoured
