"""Exact marginals of the first sampled tokens of a 16-token model, from the target alone (HF forward
and temperature / top-k / top-p in numpy, tests/reference.py: not rayspec's transform): what tests/engine/test_sampling_distribution.py (TP=1) and
tests/serve/test_tensor_parallel.py (TP=2) hold the engine's samples to. Not a test module."""

from __future__ import annotations

import torch

from reference import processed_probs

VOCAB = 16
# every token appears, in a repeating pattern, so the n-gram proposer always finds a match
PROMPT = [3, 7, 1, 12, 5, 9, 14, 0, 8, 11, 4, 13, 6, 10, 15, 2, 3, 7, 1, 12, 5, 9, 14, 0]
TEMPERATURE, TOP_K, TOP_P = 0.9, 6, 0.9
NUM_REQUESTS = 3000


# penalties and a bias strong enough to move a 16-token model's distribution a lot
PENALIZED = dict(frequency_penalty=1.5, presence_penalty=0.5, repetition_penalty=1.5, logit_bias={4: 2.0, 9: -3.0})


def marginals(target_dir, penalties: dict | None):
    """Marginals of generated tokens 1..3 from the target alone (HF forward + the sampler's
    transform; with `penalties`, each context's logits processed from the definitions first)."""
    from collections import Counter

    from transformers import LlamaForCausalLM

    hf = LlamaForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()

    def processed(row: torch.Tensor, output: list[int]) -> torch.Tensor:
        if not penalties:
            return row
        row = row.clone()
        for t, b in penalties["logit_bias"].items():
            row[t] += b
        for t in set(PROMPT) | set(output):
            rp = penalties["repetition_penalty"]
            row[t] = row[t] / rp if row[t] > 0 else row[t] * rp
        for t, c in Counter(output).items():
            row[t] -= penalties["frequency_penalty"] * c + penalties["presence_penalty"]
        return row

    def probs(contexts: list[list[int]]) -> torch.Tensor:
        with torch.no_grad():
            logits = hf(torch.tensor(contexts)).logits[:, -1].float()
        logits = torch.stack([processed(row, ctx[len(PROMPT):]) for row, ctx in zip(logits, contexts)])
        return torch.from_numpy(processed_probs(logits.double(), TEMPERATURE, TOP_K, TOP_P))

    p1 = probs([PROMPT])[0]  # [V]
    p2 = probs([PROMPT + [a] for a in range(VOCAB)])  # [V(t1), V]
    p3 = probs([PROMPT + [a, b] for a in range(VOCAB) for b in range(VOCAB)]).view(VOCAB, VOCAB, VOCAB)
    m2 = p1 @ p2
    m3 = torch.einsum("a,ab,abc->c", p1, p2, p3)
    # P(token 3 == token 2): penalties make it small; processing a row without the drafts before it
    # (in its step) would not
    repeat = float(torch.einsum("a,ab,abb->", p1, p2, p3))
    return p1, m2, m3, repeat


# ---- the check the engine's samples must pass, and its power ------------------------------------
# Pearson's chi-square test of each position's tokens against its exact marginal (stat_utils), at
# ALPHA per position. Its power (stat_utils.power, noncentral chi-square): a bias that moves TV
# `SHIFT` of mass from a position's likeliest token to its second likeliest is rejected at
# NUM_REQUESTS samples with probability >= 0.99 at every checked position (test_sampling_distribution.py,
# test_marginal_check_has_power). A bias spread in proportion over every token carries the least
# chi-square for its TV (4 TV^2): against that shape the power is ~0.7-0.8 at TV 0.05 and >= 0.99
# from TV 0.07 (4-8 degrees of freedom). The TV bound this replaced (a McDiarmid bound on the
# empirical TV, about 0.06 here) let two-token shifts of up to 0.07 pass as often as not.
ALPHA = 1e-4
SHIFT = 0.05


def shifted(p, shift: float) -> dict[int, float]:
    """p (a [VOCAB] tensor) with `shift` of mass moved from its likeliest token to the second."""
    probs = {t: float(v) for t, v in enumerate(p) if v > 0}
    first, second = sorted(probs, key=lambda t: -probs[t])[:2]
    probs[first] -= shift
    probs[second] += shift
    return probs


def assert_marginals(outs, exact, label: str = "") -> None:
    """The first three tokens of `outs` (RequestOutputs) against the exact marginals, one chi-square
    test per position; a token of probability 0 fails at once."""
    import stat_utils

    for pos in range(3):
        probs = {t: float(v) for t, v in enumerate(exact[pos]) if v > 0}
        result = stat_utils.chi_square_test([o.token_ids[pos] for o in outs], probs)
        assert result.impossible == 0 and result.p_value > ALPHA, f"{label}: token {pos + 1}: {result}"
