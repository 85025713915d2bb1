"""Unit tests: n-gram lookup, the logits -> probabilities transform, the adaptive draft length,
and the speculation counters."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from rayspec.adaptive import AdaptiveDraftLength, expected_tokens
from rayspec.metrics import SpecDecodeStats
from rayspec.proposers import PROPOSERS, build_proposer
from rayspec.proposers.base import ProposeRequest
from rayspec.proposers.ngram import NgramProposer, find_ngram_continuation
from rayspec.sampling import logits_to_probs

# ---- n-gram lookup ------------------------------------------------------------------------


@pytest.mark.parametrize("tokens,min_n,max_n,k,expected", [
    ([1, 2, 3, 4, 1, 2], 1, 3, 3, [3, 4, 1]),  # suffix [1, 2] seen at the start
    ([1, 2, 9, 1, 2, 7, 1, 2], 1, 2, 2, [7, 1]),  # the most recent earlier match wins
    ([7, 1, 2, 8, 9, 1, 2, 5, 7, 1, 2], 1, 3, 2, [8, 9]),  # the longest n wins over a later shorter match
    ([7, 1, 2, 8, 9, 1, 2, 5, 7, 1, 2], 1, 2, 2, [5, 7]),  # ... unless max_n forbids it
    ([1, 2, 3, 1, 2], 2, 3, 5, [3, 1, 2]),  # fewer than k tokens follow the match
    ([1, 2, 3, 4, 5], 1, 3, 3, []),  # nothing repeats
    ([1, 2, 3, 9, 3], 2, 3, 3, []),  # only a 1-gram repeats, below min_n
    ([1, 2, 3, 9, 3], 1, 3, 3, [9, 3]),  # ... which min_n = 1 accepts
    ([4, 4, 4], 1, 3, 2, [4]),  # overlapping match; the suffix never matches itself
    ([5], 1, 3, 3, []),
    ([6, 6], 1, 1, 4, [6]),
])
def test_find_ngram_continuation(tokens, min_n, max_n, k, expected):
    assert find_ngram_continuation(np.array(tokens, dtype=np.int64), min_n, max_n, k) == expected


def test_ngram_proposer_batch_and_limits():
    prop = NgramProposer(prompt_lookup_min=1, prompt_lookup_max=3)
    drafts = prop.propose([
        ProposeRequest("a", [1, 2, 3, 1, 2], num_tokens=2),
        ProposeRequest("b", [1, 2, 3, 1, 2], num_tokens=0),
        ProposeRequest("c", [8, 9], num_tokens=4),
    ])
    assert [d.tokens for d in drafts] == [[3, 1], [], []]
    assert all(d.probs is None for d in drafts)  # point masses
    with pytest.raises(ValueError):
        NgramProposer(prompt_lookup_min=0)
    with pytest.raises(ValueError):
        NgramProposer(prompt_lookup_min=3, prompt_lookup_max=2)


def test_proposer_registry():
    assert {"none", "ngram", "draft_model"} <= set(PROPOSERS)
    with pytest.raises(ValueError, match="unknown speculative method"):
        from rayspec.config import SpeculativeConfig

        build_proposer(SpeculativeConfig(method="medusa"), context=None)


# ---- logits_to_probs ----------------------------------------------------------------------

PROBS = torch.tensor([[0.1, 0.4, 0.05, 0.3, 0.15]])  # sorted: 1 (.4), 3 (.3), 4 (.15), 0 (.1), 2 (.05)
LOGITS = PROBS.log()


def _renorm(mask_keep: list[int]) -> torch.Tensor:
    out = torch.zeros_like(PROBS)
    out[0, mask_keep] = PROBS[0, mask_keep]
    return out / out.sum()


@pytest.mark.parametrize("top_k,top_p,keep", [
    (0, 1.0, [0, 1, 2, 3, 4]),  # nothing filtered
    (-1, 1.0, [0, 1, 2, 3, 4]),
    (5, 1.0, [0, 1, 2, 3, 4]),
    (9, 1.0, [0, 1, 2, 3, 4]),  # k above the vocabulary
    (1, 1.0, [1]),
    (2, 1.0, [1, 3]),
    (3, 1.0, [1, 3, 4]),
    (0, 0.3, [1]),  # the top token always stays
    (0, 0.6, [1, 3]),  # mass before token 3 is .4 < .6 -> kept; before token 4 .7 >= .6 -> dropped
    (0, 0.75, [1, 3, 4]),
    (0, 0.9, [1, 3, 4, 0]),
    (2, 0.5, [1]),  # top-p applies to the top-k renormalised distribution: [.57, .43]
    (3, 0.9, [1, 3, 4]),
])
def test_logits_to_probs_masks(top_k, top_p, keep):
    got = logits_to_probs(LOGITS, 1.0, top_k, top_p)
    assert torch.allclose(got, _renorm(keep), atol=1e-6)
    assert torch.allclose(got.sum(-1), torch.ones(1))


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_logits_to_probs_temperature(temperature):
    logits = torch.tensor([[1.0, -0.5, 2.0, 0.0], [3.0, 3.0, -1.0, 0.5]])
    assert torch.allclose(logits_to_probs(logits, temperature), (logits / temperature).softmax(-1), atol=1e-6)


def test_logits_to_probs_rows_independent():
    logits = torch.tensor([[1.0, 2.0, 3.0, 4.0], [4.0, 3.0, 2.0, 1.0]])
    got = logits_to_probs(logits, 1.0, top_k=2)
    assert (got[0, :2] == 0).all() and (got[0, 2:] > 0).all()
    assert (got[1, 2:] == 0).all() and (got[1, :2] > 0).all()
    assert torch.allclose(got[0], got[1].flip(0))


# ---- adaptive draft length ----------------------------------------------------------------


def _measured(max_k: int, step_cost, acceptance_batch: int = 1, **kw) -> AdaptiveDraftLength:
    policy = AdaptiveDraftLength(max_k, **kw)
    for k in range(max_k + 1):
        policy.observe_step(acceptance_batch, k, step_cost(k))
    return policy


@pytest.mark.parametrize("cost_per_draft,acceptance,expected", [
    (1.0, 0.1, 0),  # expensive drafting (each draft token costs a whole step), low acceptance: off
    (0.5, 0.2, 0),
    (0.01, 0.9, 5),  # cheap drafting, high acceptance: the longest draft
    (0.0, 0.5, 5),
])
def test_adaptive_choice(cost_per_draft, acceptance, expected):
    policy = _measured(5, lambda k: 0.010 * (1 + cost_per_draft * k))
    assert policy.choose([acceptance]) == expected


def test_adaptive_middle_choice_maximises_rate():
    cost = lambda k: 0.010 * (1 + 0.3 * k)  # noqa: E731
    policy = _measured(6, cost)
    a = 0.8
    best = max(range(7), key=lambda k: expected_tokens(a, k) / cost(k))
    assert 0 < best < 6 and policy.choose([a]) == best


def test_adaptive_defaults_and_probe():
    assert AdaptiveDraftLength(4, enabled=False).choose([0.0]) == 4  # disabled: always max_k
    assert AdaptiveDraftLength(0).choose([0.9]) == 0
    assert AdaptiveDraftLength(4).choose([None]) == 4  # nothing measured yet: max_k
    policy = _measured(4, lambda k: 0.01 * (1 + k), probe_every=5)
    choices = [policy.choose([0.05]) for _ in range(10)]
    assert choices == [0, 0, 0, 0, 1, 0, 0, 0, 0, 1]  # a 1-token probe now and then


def test_adaptive_costs_are_per_batch_bucket():
    policy = AdaptiveDraftLength(3)
    for k in range(4):
        policy.observe_step(1, k, 0.01 * (1 + 2 * k))  # batch 1: drafting is expensive
        policy.observe_step(8, k, 0.01 * (1 + 0.01 * k))  # batch 5-8: cheap
    assert policy.choose([0.3]) == 0
    assert policy.choose([0.9] * 6) == 3


def test_update_acceptance_is_an_average():
    policy = AdaptiveDraftLength(4)
    assert policy.update_acceptance(None, 0, 0) is None  # nothing proposed: no information
    ema = policy.update_acceptance(None, 4, 4)
    assert policy.prior_acceptance < ema <= 1
    for _ in range(30):
        ema = policy.update_acceptance(ema, 4, 0)
    assert ema < 0.01


@pytest.mark.parametrize("a,k,expected", [(0.0, 3, 1.0), (1.0, 3, 4.0), (0.5, 1, 1.5), (0.5, 2, 1.75)])
def test_expected_tokens(a, k, expected):
    assert math.isclose(expected_tokens(a, k), expected)


def test_spec_decode_stats():
    stats = SpecDecodeStats()
    stats.observe(0, 0)  # a step without drafts is not counted
    stats.observe(4, 2)
    stats.observe(2, 2)
    assert stats.as_dict() == {"num_drafts": 2, "num_draft_tokens": 6, "num_accepted_tokens": 4,
                               "num_accepted_tokens_per_pos": [2, 2, 0, 0],
                               "acceptance_rate": 4 / 6, "mean_acceptance_length": 3.0, "propose_seconds": 0.0}


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="oneDNN is the CPU fast path")
def test_packed_and_fused_projections_match_the_plain_layers():
    """pack_for_cpu's oneDNN copies (q/k/v and gate/up fused) compute what the plain layers do, and
    step aside once a weight changes (training in place) or gradients are on."""
    from rayspec.model import MLP, Attention, ModelArgs

    torch.manual_seed(0)
    args = ModelArgs(vocab_size=50, hidden_size=64, intermediate_size=96, num_layers=1, num_heads=4,
                     num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6, tie_word_embeddings=False)
    attn, mlp = Attention(args), MLP(args)
    for rows in (1, 9):
        x = torch.randn(2, rows, 64)
        with torch.no_grad():
            plain = [attn.q_proj(x), attn.k_proj(x), attn.v_proj(x), mlp(x)]
            for m in (attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj):
                m.pack_for_cpu()
            attn.fuse_for_cpu()
            mlp.fuse_for_cpu()
            q, k, v = attn.qkv(x)
            assert [t.shape for t in (q, k, v)] == [(2, rows, 64), (2, rows, 32), (2, rows, 32)]
            for got, want in zip([q, k, v, mlp(x)], plain):
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
            assert mlp.gate_up(x) is not None
    with torch.no_grad():
        mlp.up_proj.weight.mul_(2)  # an in-place update: the fused copy is stale now
        assert mlp.gate_up(x) is None
        want = mlp.down_proj(torch.nn.functional.silu(x @ mlp.gate_proj.weight.T) * (x @ mlp.up_proj.weight.T))
        torch.testing.assert_close(mlp(x), want, rtol=1e-5, atol=1e-5)
    assert attn.qkv(x) is None  # gradients on: the plain layers (autograd) run


def test_prefill_groups_minimise_padded_cost():
    """Prompts are prefilled in the groups that minimise padded tokens plus a per-forward overhead
    (checked against every partition of small random cases)."""
    import itertools
    import random

    from rayspec.runner import prefill_groups

    def cost(groups, lengths, overhead):
        return sum(overhead + len(g) * max(lengths[i] for i in g) for g in groups)

    def partitions(items):  # every set partition
        if not items:
            yield []
            return
        first, rest = items[0], items[1:]
        for p in partitions(rest):
            yield [[first]] + p
            for k in range(len(p)):
                yield p[:k] + [[first] + p[k]] + p[k + 1:]

    rng = random.Random(0)
    for _ in range(60):
        lengths = [rng.randint(1, 300) for _ in range(rng.randint(1, 6))]
        overhead = rng.choice([0, 24, 1000])
        groups = prefill_groups(lengths, overhead)
        assert sorted(itertools.chain(*groups)) == list(range(len(lengths)))  # each prompt exactly once
        best = min(cost(p, lengths, overhead) for p in partitions(list(range(len(lengths)))))
        assert cost(groups, lengths, overhead) == best
    assert prefill_groups([49, 52, 60, 243], 24) == [[0, 1, 2], [3]]  # the long prompt goes alone
    assert prefill_groups([100, 90, 80], 1024) == [[2, 1, 0]]  # overhead dominates: one batch


def test_top_p_below_float32_range_keeps_the_top_token():
    # found by the route fuzz (top_p 5e-324 -> 500): the threshold rounds to 0.0 in float32, which
    # removed every token and made the probabilities NaN
    from rayspec.sampling import logits_to_probs
    logits = torch.tensor([[0.1, 2.0, -1.0, 0.5], [3.0, 0.0, 0.0, 0.0]])
    for top_p, top_k in ((5e-324, 0), (1e-45, 0), (5e-324, 2)):
        probs = logits_to_probs(logits, 0.7, top_k, top_p)
        assert torch.equal(probs, torch.nn.functional.one_hot(logits.argmax(-1), 4).float())
