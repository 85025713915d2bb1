"""Sampling parameters, the logits -> probabilities transform shared by target and draft, and the draws.

Temperature, top-k and top-p are applied identically to both distributions, which is what
keeps rejection sampling lossless with respect to the *processed* target distribution.

Two kinds of draw:
- a request without a seed draws from its own random stream (a torch.Generator: `sample`,
  `sample_rows`), and its drafts are verified by rejection sampling (rayspec.sampling.rejection);
- a seeded request draws *coupled*: the token at position t of its sequence is
  argmax_x p(x) / E_x, where E_x = -log U_x and U_x is a counter-based hash of (seed, t, x)
  (`coupled_noise`, `coupled_sample`). That is the exponential race (the Gumbel-max trick): the
  token is distributed exactly as p, and it depends on nothing but the seed, the position and p.
  A proposer drafting for the request draws its token at t from its own q with the same E, and the
  verifier keeps a draft token iff it is the target's coupled draw there. So what a seeded request
  emits is the same whatever was drafted, how much, or whether at all: the same as target-only
  decoding with that seed, token for token, under any method, any draft length and any plan of the
  cost-aware drafting; after a failover, and in a batch or alone.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from rayspec.device_io import to_device
# a request's parameters and their bounds (no torch there: a Serve ingress uses them), re-exported here
from rayspec.sampling.params import (MAX_REPETITION_PENALTY, MAX_SEED, MIN_REPETITION_PENALTY,  # noqa: F401
                                     MIN_TEMPERATURE, SamplingParams)


# Top-k / top-p sort only the tokens that can be kept: torch.topk of those (on CPU its cost grows with
# how many: ~0.25 ms for 256 of 49,152, as much as sorting the whole row, ~4.7 ms per row on an AMD
# EPYC core, for all of them). A top-p's possible tokens are those above a floor (below), counted on
# the host. On a GPU that count would be a host read per step, and sorting the whole row (what this
# did there before) costs a sort of the vocabulary per row: a top-p without top-k is found there by
# bisection instead (`_top_p_keep`): 33 masked sums, no sort, no read. tests/unit/test_units.py checks
# the kept sets of every path against a full sort's.


def logits_to_probs(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """logits: [N, vocab] float32 -> probs: [N, vocab] after temperature, top-k, top-p.

    Top-p keeps the most likely tokens until the mass before the next one reaches top_p (the first
    always stays), over the distribution left by top-k; that mass is summed in float64 (in float32 a
    running sum over thousands of small probabilities drifts by enough to move the cut by dozens of
    tokens). Tokens whose logits equal the last kept one's all stay (the kept set is every token
    whose logit is at least a threshold: it does not depend on an order among equals). Among tokens
    with equal logits at a top-k cut, which ones stay is the order torch.topk gives them."""
    if temperature != 1.0:  # (x / 1.0 is x: no copy of the rows)
        logits = logits / temperature
    vocab = logits.shape[-1]
    top_k = top_k if 0 < top_k < vocab else 0
    if not top_k and top_p >= 1.0:
        return logits.softmax(-1)
    if not top_k and not _count_on_host(logits.device):  # a GPU: no sort, no host read
        return logits.masked_fill(~_top_p_keep(logits, top_p), float("-inf")).softmax(-1)
    log_norm = None if top_k else logits.double().logsumexp(-1, keepdim=True)
    if top_k:
        candidates = top_k
    else:
        # a token less likely than (1 - top_p) / (2 vocab) never stays: all of those together hold
        # under (1 - top_p) / 2, so the mass before the first of them (in sorted order) exceeds top_p
        floor = (log_norm + math.log((1.0 - top_p) / (2 * vocab))).float()
        candidates = max(1, int((logits >= floor).sum(-1).max()))
    values, index = logits.topk(candidates, dim=-1)  # sorted, largest first
    keep = torch.ones_like(values, dtype=torch.bool)
    if top_p < 1.0:
        values64 = values.double()
        # normalized over the top-k, or over the whole row (the tokens left out add to the denominator only)
        probs = values64.softmax(-1) if top_k else (values64 - log_norm).exp()
        keep = probs.cumsum(-1) - probs < top_p  # the mass before each token
        keep[:, 0] = True  # top_p below float32's smallest (5e-324 rounds to 0) must keep it too
        # every token tied with the last kept one stays too (as `_top_p_keep` keeps them)
        keep = values >= values.masked_fill(~keep, float("inf")).amin(-1, keepdim=True)
    kept = torch.full_like(logits, float("-inf")).scatter_(-1, index, values.masked_fill(~keep, float("-inf")))
    return kept.softmax(-1)


def _order_keys(x: torch.Tensor) -> torch.Tensor:
    """float32 [...] -> int64 keys in the same order (IEEE-754: a non-negative float's bits grow with
    it; a negative one's magnitude bits are flipped). -0.0 counts as 0.0."""
    bits = (x + 0.0).view(torch.int32)  # + 0.0: -0.0 becomes 0.0
    return torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits).long()


def _top_p_keep(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """[N, V] float32 (temperature applied) -> [N, V] bool: the tokens top-p keeps, with no sort and
    no host read. A token stays iff the mass of the tokens strictly likelier than it is under top_p
    (the sorted rule, ties at the cut all kept); that mass falls as the logit grows, so the kept set
    is every token whose logit's order key is at least t*, the least key whose strictly-above mass is
    under top_p. t* is found by bisection over the keys (int64, a span under 2^32: 33 steps), each
    step one masked sum of exp(logit - max) in float32 (each within half an ulp) accumulated in
    float64 and compared with top_p times their float64 total (no float32 normalisation, whose
    rounding would move every mass alike). Against a float64 sort of the whole row, 2 of 9,600
    random rows (16,384 tokens, T scales 0.3-12, top_p 0.5-0.999) kept sets one token apart: a
    mass-before within float32 rounding of top_p. Lossless either way: the target's processed
    distribution is whatever this returns, for the speculative and the target-only path alike."""
    logits = logits.float()
    weights = (logits - logits.amax(-1, keepdim=True)).exp()
    bound = top_p * weights.sum(-1, keepdim=True, dtype=torch.float64)
    keys = _order_keys(logits)
    hi = keys.amax(-1, keepdim=True)  # nothing is above the top token: mass 0 < top_p
    lo = keys.amin(-1, keepdim=True) - 1  # everything is above: mass 1 >= top_p
    for _ in range(33):
        mid = lo + (hi - lo) // 2
        above = torch.where(keys > mid, weights, 0.0).sum(-1, keepdim=True, dtype=torch.float64)
        under = above < bound
        hi, lo = torch.where(under, mid, hi), torch.where(under, lo, mid)
    return keys >= hi


def argmax(x: torch.Tensor) -> torch.Tensor:
    """x.argmax(-1), computed as x.max(-1)'s indices: the same index (the first maximum, a NaN as argmax
    takes it; tests/unit/test_sampler_argmax.py), a third of the time on CPU, where torch's argmax over a
    vocabulary row is not vectorized: [9, 49152] float32 625 vs 199 us, bfloat16 1,583 vs 341 us, one
    thread (torch 2.13, Intel Xeon; benchmarks/argmax_cost.py). Every vocabulary-wide choice goes through it."""
    return x.max(-1).indices


def top_logprobs(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k (at most the vocabulary) largest log-probabilities of each row of logits [..., V], sorted, and
    their token ids: one topk of the rows' log_softmax. (Not topk of the logits less a logsumexp: on
    CPU torch's logsumexp is unfused, 1.5-4.5x the time of the fused log_softmax over the same rows
    (benchmarks/norm_cost.py); the tree drafting's host time at batch 1 rose by ~0.3 ms a step with it.)"""
    top = torch.topk(logits.log_softmax(-1), min(k, logits.shape[-1]))
    return top.values, top.indices


def probs_of_rows(logits: torch.Tensor, settings: list[tuple[float, int, float]]) -> torch.Tensor:
    """logits: [N, vocab] -> probs [N, vocab], row i under settings[i] = (temperature, top_k, top_p):
    the rows that share settings (in a batch, nearly always all of them) go through logits_to_probs
    together, one set of kernels for the lot instead of one per row. Each row comes out as
    logits_to_probs gives it alone (row-wise operations; a shared top-p narrowing keeps more
    candidates, never fewer, so the kept set is the same)."""
    groups: dict[tuple[float, int, float], list[int]] = {}
    for i, key in enumerate(settings):
        groups.setdefault(key, []).append(i)
    if len(groups) == 1:
        return logits_to_probs(logits, *settings[0])
    out = torch.empty_like(logits)
    for key, rows in groups.items():
        (index,) = to_device(np.asarray(rows, dtype=np.int64), device=logits.device)  # no blocking copy
        out[index] = logits_to_probs(logits.index_select(0, index), *key)
    return out


def sample_rows(probs: torch.Tensor, generators: list[torch.Generator]) -> torch.Tensor:
    """probs: [N, vocab] -> [N] token ids (int64, on probs' device, no host read): row i drawn with
    generators[i], exactly as sample(probs[i], generators[i]) draws it (the same uniform, the same
    float32 cumulative mass), so a seeded request draws the same token in a batch or alone."""
    cumulative = probs.float().cumsum(-1)
    u = torch.cat([torch.rand(1, generator=g, device=probs.device) for g in generators])
    u = u * cumulative[:, -1]
    return torch.searchsorted(cumulative, u[:, None], right=True)[:, 0].clamp_(max=probs.shape[-1] - 1)


# ---- coupled draws (seeded requests) -------------------------------------------------------------

_MASK64 = (1 << 64) - 1
_GAMMA = 0x9E3779B97F4A7C15  # splitmix64's increment (the golden ratio in 64 bits)
_MIX1, _MIX2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB


def _signed(x: int) -> int:
    """A 64-bit pattern as the int64 torch holds it."""
    x &= _MASK64
    return x - (1 << 64) if x >> 63 else x


def _mix64(z: int) -> int:
    """splitmix64's finaliser on Python ints (the reference for the tensor version below)."""
    z &= _MASK64
    z = ((z ^ (z >> 30)) * _MIX1) & _MASK64
    z = ((z ^ (z >> 27)) * _MIX2) & _MASK64
    return z ^ (z >> 31)


def coupled_key(seed: int, position: int) -> int:
    """The counter of a seeded request's draw at sequence position `position` (0-based over
    prompt + output: the index the drawn token will have)."""
    return _mix64(_mix64(seed ^ 0x5EEDC0DE) + (position + 1) * _GAMMA)


def coupled_keys_at(seeds: list[int], positions: torch.Tensor) -> torch.Tensor:
    """coupled_key(seeds[r], positions[r]) for every row, computed on positions' device (int64 lanes;
    positions may be known on the device only, a deferred draft's depths: no host read)."""
    (base,) = to_device(np.asarray([_signed(_mix64(seed ^ 0x5EEDC0DE)) for seed in seeds], dtype=np.int64),
                        device=positions.device)
    return _mix64_tensor(base + (positions.to(torch.int64) + 1) * _signed(_GAMMA))


def _srl(z: torch.Tensor, s: int) -> torch.Tensor:
    """A logical right shift of int64 lanes (torch's >> is arithmetic)."""
    return (z >> s) & ((1 << (64 - s)) - 1)


def _mix64_tensor(z: torch.Tensor) -> torch.Tensor:
    """_mix64 over int64 lanes: products wrap modulo 2**64 as the Python version's mask does
    (tests/unit/test_units.py compares the two)."""
    z = (z ^ _srl(z, 30)) * _signed(_MIX1)
    z = (z ^ _srl(z, 27)) * _signed(_MIX2)
    return z ^ _srl(z, 31)


_TOKEN_STEPS: dict = {}  # (device, vocab) -> token_id * GAMMA (int64, wrapped), made once


def _token_steps(token_ids: torch.Tensor | int, device) -> torch.Tensor:
    if isinstance(token_ids, int):
        key = (str(device), token_ids)
        if key not in _TOKEN_STEPS:
            _TOKEN_STEPS[key] = torch.arange(token_ids, dtype=torch.int64, device=device) * _signed(_GAMMA)
        return _TOKEN_STEPS[key]
    return token_ids.to(torch.int64) * _signed(_GAMMA)


def coupled_noise(keys: list[int] | torch.Tensor, token_ids: torch.Tensor | int, device) -> torch.Tensor:
    """E[r, j] = -log U, U uniform on (0, 1) from 52 bits of splitmix64 at (keys[r], token j):
    [R, V] float64 standard exponentials, independent across tokens and keys. token_ids: the vocabulary
    size V (tokens 0..V-1), or the target ids of a draft vocabulary's entries (EAGLE-3's reduced one),
    so a draft's E at a token is the target's. The keys reach the device without a blocking copy (or
    are there already: an int64 tensor, `coupled_keys_at`)."""
    if isinstance(keys, torch.Tensor):
        k = keys.to(device=torch.device(device), dtype=torch.int64)
    else:
        (k,) = to_device(np.array([_signed(x) for x in keys], dtype=np.int64), device=torch.device(device))
    z = _mix64_tensor(k[:, None] + _token_steps(token_ids, device)[None, :])
    # 52 bits as the mantissa of a float64 in [1, 2) (a bit pattern, no int -> float conversion), less
    # 1 - 2**-53: (2 m + 1) 2**-53, exact, in (0, 1)
    u = (_srl(z, 12) | 0x3FF0000000000000).view(torch.float64) - (1.0 - 2.0 ** -53)
    return -torch.log(u)


def coupled_sample(probs: torch.Tensor, keys: list[int] | torch.Tensor, token_ids: torch.Tensor | int | None = None) -> torch.Tensor:
    """probs: [R, V] -> [R] token indices (int64, on probs' device, no host read): row r's draw
    argmax_x probs[r, x] / E[r, x] with E from coupled_noise(keys[r]). A token of probability 0 is never
    drawn (a row without mass returns index 0). token_ids: what coupled_noise takes (default V)."""
    noise = coupled_noise(keys, probs.shape[-1] if token_ids is None else token_ids, probs.device)
    return argmax(probs.double() / noise)


def draw_rows(probs: torch.Tensor, sources: list, token_ids: torch.Tensor | int | None = None) -> torch.Tensor:
    """probs: [N, vocab] -> [N] indices into vocab, row i drawn from sources[i]: a torch.Generator
    (its own stream, `sample_rows`) or an int (a coupled key, `coupled_sample`; token_ids as there).
    No host read."""
    streams = [i for i, s in enumerate(sources) if not isinstance(s, int)]
    if len(streams) == len(sources):
        return sample_rows(probs, sources)
    if not streams:
        return coupled_sample(probs, sources, token_ids)
    out = coupled_sample(probs, [s if isinstance(s, int) else 0 for s in sources], token_ids)
    (index,) = to_device(np.asarray(streams, dtype=np.int64), device=probs.device)
    return out.index_copy_(0, index, sample_rows(probs.index_select(0, index), [sources[i] for i in streams]))


def choose_rows(logits: torch.Tensor, params: list, sources: list) -> torch.Tensor:
    """logits: [N, vocab] processed rows -> [N] token ids on the device (no host read): row i's argmax
    where params[i] is greedy, else a draw from its probabilities under its own settings, from
    sources[i] (`draw_rows`: a coupled key or the sequence's stream), as `sample` draws one row."""
    choice = argmax(logits)
    sampled = [i for i, p in enumerate(params) if not p.greedy]
    if sampled:
        (index,) = to_device(np.asarray(sampled, dtype=np.int64), device=logits.device)
        probs = probs_of_rows(logits.index_select(0, index),
                              [(params[i].temperature, params[i].top_k, params[i].top_p) for i in sampled])
        choice.index_copy_(0, index, draw_rows(probs, [sources[i] for i in sampled]))
    return choice


class DraftSources:
    """What a proposer draws each sampled draft token from (`draw_rows`' sources): a seeded request's
    coupled key at the token's position (the target's draw uses the same noise), else the sequence's
    own stream, seeded from its stream_seed xor `salt` (apart from the target's) or from the OS."""

    def __init__(self, device, salt: int):
        self.device, self.salt = device, salt
        self._streams: dict[str, torch.Generator] = {}

    def source(self, seq_id: str, seed: int | None, stream_seed: int | None, position: int):
        if seed is not None:
            return coupled_key(seed, position)
        if seq_id not in self._streams:
            self._streams[seq_id] = make_generator(None if stream_seed is None else stream_seed ^ self.salt,
                                                   self.device)
        return self._streams[seq_id]

    def release(self, seq_id: str) -> None:
        self._streams.pop(seq_id, None)


def _count_on_host(device: torch.device) -> bool:
    """Whether logits_to_probs narrows a top-p by counting its possible tokens (a host read)."""
    return device.type == "cpu"


def make_generator(seed: int | None, device) -> torch.Generator:
    gen = torch.Generator(device=device)
    if seed is None:
        gen.seed()
    else:
        gen.manual_seed(seed)
    return gen


def sample(probs: torch.Tensor, generator: torch.Generator) -> int:
    """probs: [vocab] (summing to 1, or to any positive mass) -> one token id, drawn with probability
    proportional to its entry: the cumulative mass inverted at one uniform draw, as torch.multinomial
    does (which took ~1.5 ms per 49,152-entry row on CPU). A token of probability 0 is never drawn.

    The cumulative mass is summed in float32, as multinomial's: its rounding absorbs the last-bit
    differences between the logits of one sequence computed alone and in a batch (kernels differ by
    row count), so a seeded request draws the same tokens in either; a float64 sum kept them and,
    over a flat 38,000-token row, moved a draw (tests/engine/test_stopping.py)."""
    cumulative = probs.float().cumsum(-1)
    u = torch.rand(1, generator=generator, device=probs.device) * cumulative[-1]
    return int(torch.searchsorted(cumulative, u, right=True).clamp_(max=probs.shape[-1] - 1))
