"""Sampling as clients send it (issue #53, item 2): unseeded chat requests at temperature 1 with no
top-k / top-p through the served configs/default.yaml app (SmolLM2-135M-Instruct, its 49,152-token
vocabulary, the shipped EAGLE-3 head verifying 8-node token trees), whose output must follow the
target's own distribution.

The app is configs/default.yaml as shipped but for two speculative settings, set here because the
shipped ones never give the tree this test is about: `eagle_topk: 3` (the shipped 2 gives a node
at most 2 head-drafted children, 3 only where the prompt-lookup branch adds one) and `adaptive:
false` (the planner sizes sampled trees from timers, so on a busy machine it may verify fewer than
8 nodes; off, every step verifies min(8, tokens left - 1) nodes). The rest is the YAML's: 4
levels, eagle_stop_prob 0.2, the prompt-lookup branch, trees at batch <= 2, nothing drafted from 3,
prefix caching on. Requests go one at a time with n = 2 (batch 2: trees). A spy installed in the
verifier replica (Ray's `__ray_call__` on its actor: it wraps rayspec.sampling.rejection's
`sample_verdicts` there, changing nothing it returns) counts the trees verified by shape;
asserted: >= MIN_FULL_TREES trees of 8 nodes, 3 levels or more and a node with 3 children that the
target gives mass, and >= 1,000 draft tokens in the app's /v1/stats.

The statistic. Each request returns its choices' token ids (`return_token_ids`); every output token
(the prefill's first one, then those each tree verification emits, EOS included) is transformed by
its randomized probability-integral transform under the target's exact conditional distribution
at its context: transformers' LlamaForCausalLM on the same checkpoint, its float32 logits through
a float64 softmax here (tests/reference.py for the rows with top-k / top-p), not rayspec's code.
Tokens are ordered likeliest first (ties by id), so u = (mass of the likelier tokens) + V p(token),
V ~ U(0, 1). Under the null every u is Uniform(0, 1) and independent of the others, within a
completion too (Rosenblatt: each is uniform given everything before it), so the counts of the u's
in BINS = 20 equal bins are multinomial and Pearson's statistic is chi-square with 19 degrees of
freedom; the test fails above its 1 - ALPHA quantile (ALPHA = 1e-3: the false-alarm rate of a run).
A token the reference gives probability 0 fails at once. Beside it, the surprisal test: the tokens'
summed -log p(token) minus their contexts' entropies has mean 0 and a variance computed exactly from
the same rows, so its z-score is standard normal (over hundreds of tokens); each test at ALPHA / 2.
It sees what the transform cannot: tokens of the wrong likelihood spread evenly over the ranks (what
a head's drafts accepted unverified are at T = 1, where the head is a poor guide).

Power of the transform's test, derived per run from its own contexts (tests/audit.py's method: each bias moves every bin's
probability linearly, so Pearson's statistic is noncentral chi-square with noncentrality
n BINS sum_b move_b^2), for two bias shapes of per-token TV 0.02:
- top-two: 0.02 of mass moved from the likeliest token to the second at every context;
- proportional: p (1 + eps s) renormalised, s = +1 on the likeliest tokens holding half the mass, -1
  on the rest (a sharper draw), scaled to TV 0.02: the shape with the least chi-square divergence
  for its TV.
Measured: 761 tokens (40 completions, 8 of them at T = 0.7 with cuts; 106 full-shape trees, over 2,000
draft tokens): power 0.0014
(top-two) and 0.0020 (proportional) at TV 0.02; power 0.99 from TV 0.21 (top-two) and 0.15
(proportional); at twice the requests (1,252 tokens) 0.17 and 0.12. The randomized transform spreads a
move between the two likeliest tokens over every bin they cover, so the top-two shape, the easiest
for a test over categories, is the harder one here. Printed per run; asserted: TV_099_MAX bounds
both (the sample did not collapse onto a few contexts). So this is an end-to-end check of the served
path (HTTP, n, the app's defaults, the verifier's tree rule at a real vocabulary, the 8-node trees)
against gross faults, at the power a minute of CPU buys; power 0.99 at TV 0.02 for both shapes is
met by the rule's own law (tests/test_rule_law.py), and every draw of every topology is audited by
tests/test_lossless_grid.py.

Injected fault (test_unverified_drafts_are_caught): the replica's tree rule replaced (in the replica,
as the spy is) by one that accepts the first child of every node without the rejection rule; the same
statistic on FAULT_REQUESTS requests per prompt must reject it (either test at p < ALPHA / 2).
At 2 requests per prompt (256 tokens) this was too weak to assert at ALPHA / 2: four 256-token
samples of one run (2026-12-03, AMD EPYC) gave the transform's p = 0.13, 2e-4, 8e-4, 9e-5 and
surprisal p = 2e-5, 1e-4, 5e-6, 6e-7, and a CI run got 0.006 and 0.27 (failed). At 4 requests per
prompt (512 tokens) the noncentrality doubles; the 1,024 tokens of that run gave p = 4e-17 and 8e-19.
A subtler fault, the
token after every rejected child drawn from the whole row (the rejected siblings left in the
residual), gave p = 0.01 at 256 tokens: not caught at this size. At T = 1 the head's children carry
little of the target's mass (6% of draft tokens accepted), so putting them back moves little.
"""

from __future__ import annotations

import copy
import time
from collections import Counter
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
import yaml

import audit
import stat_utils
from deployments.app import build_app

CONFIG = Path(__file__).resolve().parents[2] / "configs" / "default.yaml"
APP = "sampled"
MESSAGES = [
    [{"role": "user", "content": "Write a short poem about the sea."}],
    [{"role": "user", "content": "Give me three ideas for a birthday party."}],
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "user", "content": "Tell me a fun fact about cats."}],
]
MAX_TOKENS = 16
# (temperature, top_k, top_p, requests of n = 2 per prompt): as clients send it, then the settings
# the engine-level tests run (a cut vocabulary), cheaper here
SETTINGS = [(1.0, None, None, 5), (0.7, 40, 0.9, 1)]
FAULT_REQUESTS = 4  # per prompt, T = 1 (n = 2: 8 completions of 16 tokens per prompt)
ALPHA = 1e-3
TV = 0.02
TV_099_MAX = 0.3  # each shape is caught with power 0.99 from a per-token TV below this (the sample did not collapse)
MIN_FULL_TREES = 40
MIN_DRAFT_TOKENS = 1000


def app_args() -> dict:
    (app,) = yaml.safe_load(CONFIG.read_text())["applications"]
    args = copy.deepcopy(app["args"])
    args["speculative"].update(eagle_topk=3, adaptive=False)
    return args


def verifier_actor():
    import ray

    (name,) = [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
               if a["name"].startswith(f"SERVE_REPLICA::{APP}#Verifier#")]
    return ray.get_actor(name, namespace="serve")


def in_replica(fn, *args):
    """fn(*args) run in the verifier replica's process (its module state is the engine's); this
    module's functions travel by value (the replica cannot import a test module)."""
    import sys

    import ray
    from ray import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    return ray.get(verifier_actor().__ray_call__.remote(lambda _self: fn(*args)), timeout=300)


# ---- run inside the replica ----------------------------------------------------------------------

def _install(kind: str) -> None:
    """Put a shape-counting spy ("spy") or the faulty rule ("fault") around the sampled rule."""
    from collections import Counter as _Counter

    from rayspec.sampling import rejection
    from rayspec.sampling.sampler import sample

    original = getattr(rejection.sample_verdicts, "original", rejection.sample_verdicts)

    def trees(probs, drafts):
        """(draft, its children by node, its context row) for the token trees of a batch."""
        start = 0
        for draft in drafts:
            if draft.parents is not None and list(draft.parents) != list(range(-1, len(draft.tokens) - 1)):
                children: dict[int, list[int]] = {}
                for j, p in enumerate(draft.parents):
                    children.setdefault(p, []).append(j)
                yield draft, children, start
            start += len(draft.tokens) + 1

    def spy(logits, index, settings, drafts, draft_probs, generators):
        probs = rejection.rows_probs(logits, index, settings)
        for draft, children, start in trees(probs, drafts):
            live = 0
            for node, kids in children.items():
                if len(kids) >= 3:
                    row = probs[start + 1 + node]  # (node -1: the context's row)
                    live = max(live, sum(bool(row[draft.tokens[k]] > 0) for k in kids))
            spy.shapes[(len(draft.tokens), max(rejection.draft_depths(draft)), live)] += 1
        return original(logits, index, settings, drafts, draft_probs, generators)

    def fault(logits, index, settings, drafts, draft_probs, generators):
        # no rejection rule on trees: the first child of every node is accepted as drafted, and the
        # token after the path drawn from the target's row there
        batch = original(logits, index, settings, drafts, draft_probs, generators)
        finish = batch.finish
        probs = rejection.rows_probs(logits, index, settings)

        def faulty(arrays):
            results = finish(arrays)
            by_draft = {id(d): (children, start) for d, children, start in trees(probs, drafts)}
            for i, (draft, gen) in enumerate(zip(drafts, generators)):
                if id(draft) in by_draft:
                    children, start = by_draft[id(draft)]
                    node, path = -1, []
                    while children.get(node):
                        node = children[node][0]
                        path.append(node)
                    token = sample(probs[start + 1 + node], gen)
                    results[i] = ([draft.tokens[j] for j in path] + [token], path)
            return results

        batch.finish = faulty
        return batch

    chosen = spy if kind == "spy" else fault
    chosen.original, spy.shapes = original, _Counter()
    rejection.sample_verdicts = chosen


def _shapes() -> dict:
    from rayspec.sampling import rejection

    return dict(getattr(rejection.sample_verdicts, "shapes", {}))


# ---- the reference: transformers' forward, float64 probabilities ---------------------------------

class Reference:
    """The target's exact next-token distributions after a prompt and its completions (transformers'
    LlamaForCausalLM; the prompt's KV computed once and shared by the batch)."""

    def __init__(self, model_dir):
        from transformers import AutoTokenizer, LlamaForCausalLM

        self.hf = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)

    def prompt_ids(self, messages) -> list[int]:
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)

    @torch.no_grad()
    def logits(self, prompt: list[int], outputs: list[list[int]]) -> list[torch.Tensor]:
        """Per output, [len(output), V] float32 logits: row j predicts output token j."""
        first = self.hf(input_ids=torch.tensor([prompt]), use_cache=True)
        head = first.logits[0, -1]  # [V]: every output's first token
        longest = max(len(o) for o in outputs) - 1
        if longest <= 0:
            return [head[None] for _ in outputs]
        cache = copy.deepcopy(first.cache)
        cache.batch_repeat_interleave(len(outputs))
        ids = torch.zeros(len(outputs), longest, dtype=torch.long)  # right padding: no real token sees it
        for i, o in enumerate(outputs):
            ids[i, :len(o) - 1] = torch.tensor(o[:-1])
        rest = self.hf(input_ids=ids, cache=cache, use_cache=True).logits  # [B, longest, V]
        return [torch.cat([head[None], rest[i, :len(o) - 1]]) for i, o in enumerate(outputs)]


def processed(logits: torch.Tensor, temperature: float, top_k, top_p) -> torch.Tensor:
    """[R, V] float64 probabilities: a softmax at T = 1 without cuts, else tests/reference.py's."""
    if temperature == 1.0 and top_k is None and top_p is None:
        return torch.softmax(logits.double(), -1)
    from reference import processed_probs

    return torch.from_numpy(processed_probs(logits, temperature, top_k or 0, 1.0 if top_p is None else top_p))


def transforms(probs: torch.Tensor, tokens: torch.Tensor, rng: np.random.Generator):
    """probs [R, V] float64, tokens [R]: (the tokens' randomized PITs [R] (nan: probability 0), per
    bias shape (its summed per-row TV, its summed move of each bin's probability [BINS]), and the
    tokens' summed surprisal minus their contexts' entropies with the variance of that sum)."""
    s, order = probs.sort(dim=-1, descending=True, stable=True)  # likeliest first, ties by id
    cum = s.cumsum(-1)
    rank = (order == tokens[:, None]).int().argmax(-1)
    p_token = s.gather(1, rank[:, None])[:, 0]
    before = cum.gather(1, rank[:, None])[:, 0] - p_token
    v = torch.from_numpy(rng.random(len(tokens)))
    us = torch.where(p_token > 0, before + v * p_token, torch.nan)
    # surprisal -log p(token) against its law at the context: mean the entropy, variance below
    logs = torch.where(s > 0, s.log(), 0.0)
    entropy = -(s * logs).sum(-1)
    surprisal = (-(p_token.clamp_min(1e-300).log()) - entropy).sum()
    variance = ((s * logs * logs).sum(-1) - entropy ** 2).sum()
    edges = torch.linspace(0, 1, audit.BINS + 1, dtype=torch.float64)[1:-1].expand(len(tokens), -1).contiguous()
    at = torch.searchsorted(cum, edges, right=True).clamp_max(s.shape[1] - 1)  # the token each edge falls in
    start = cum.gather(1, at) - s.gather(1, at)
    frac = ((edges - start) / s.gather(1, at).clamp_min(1e-300)).clamp(0, 1)
    top_two = s.clone()
    m = s[:, 0].clamp_max(TV)
    top_two[:, 0] -= m
    top_two[:, 1] += m
    sign = torch.where(cum - s < 0.5, 1.0, -1.0)
    sharper = s * (1 + 0.5 * sign)
    sharper /= sharper.sum(-1, keepdim=True)
    shapes = {}
    for name, alt in (("top-two", top_two), ("proportional", sharper)):
        alt_cum = alt.cumsum(-1)
        cdf = alt_cum.gather(1, at) - alt.gather(1, at) + alt.gather(1, at) * frac  # [R, BINS - 1]
        ones = torch.ones(len(tokens), 1, dtype=torch.float64)
        bins = torch.diff(torch.cat([0 * ones, cdf, ones], 1), dim=1)  # [R, BINS]
        shapes[name] = (float((alt - s).abs().sum() / 2), (bins - 1.0 / audit.BINS).sum(0).numpy())
    return us, shapes, (float(surprisal), float(variance))


def law(reference: Reference, samples: dict, seed: int = 0) -> tuple[audit.LawResult, "Surprisal"]:
    """samples: (prompt ids, (T, top_k, top_p)) -> the output token lists. Pearson's test of every
    output token's PIT, with the two shapes' mean TV and bin moves (audit.LawResult); the surprisal
    test's p-value."""
    rng = np.random.default_rng(seed)
    us, impossible, excess, variance = [], [], 0.0, 0.0
    totals = {"top-two": [0.0, np.zeros(audit.BINS)], "proportional": [0.0, np.zeros(audit.BINS)]}
    for (prompt, setting), outputs in samples.items():
        logits = torch.cat(reference.logits(list(prompt), outputs))
        tokens = torch.tensor([t for o in outputs for t in o])
        for chunk in range(0, len(tokens), 128):  # [128, V] float64 rows at a time
            part = slice(chunk, chunk + 128)
            u, shapes, (e, var) = transforms(processed(logits[part], *setting), tokens[part], rng)
            excess, variance = excess + e, variance + var
            impossible += [f"token {int(t)} after prompt ...{prompt[-3:]}" for t, x in zip(tokens[part], u)
                           if torch.isnan(x)]
            us += [float(x) for x in u if not torch.isnan(x)]
            for name, (tv, move) in shapes.items():
                totals[name][0] += tv
                totals[name][1] += move
    n = max(len(us), 1)
    result = audit._pearson(us, impossible, {k: (tv / n, move / n) for k, (tv, move) in totals.items()})
    return result, Surprisal(excess, variance)


class Surprisal(float):
    """The surprisal test's two-sided p-value (a float) with its z-score: the summed excess over its
    standard deviation (mean 0 under the null; normal by the central limit theorem over hundreds of
    tokens: checked by simulation at these prompts, benchmarks/results/ci_module_seconds_session17.md).
    z > 0: the tokens were less likely than the target's law makes them; z < 0: likelier (a sharper draw)."""

    def __new__(cls, excess: float, variance: float):
        import math

        z = excess / math.sqrt(max(variance, 1e-300))
        out = super().__new__(cls, math.erfc(abs(z) / math.sqrt(2)))
        out.z = z
        return out

    def __format__(self, spec: str) -> str:
        return f"{float(self):{spec}} (z = {self.z:+.2f})"


def power_at(result: audit.LawResult, shape: str, tv: float) -> float:
    """The power of the level-ALPHA test against this shape scaled to per-token TV `tv`."""
    mean_tv, move = result.shapes[shape]
    lam = result.num_draws * audit.BINS * float((((tv / mean_tv) * move) ** 2).sum())
    return stat_utils.ncx2_sf(stat_utils.chi2_isf(ALPHA, audit.BINS - 1), audit.BINS - 1, lam)


# ---- the served app ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def served(smollm2, serve_url):
    from ray_utils import serving

    with serving((APP, build_app(app_args()), f"/{APP}")):
        in_replica(_install, "spy")
        yield f"{serve_url}/{APP}"


@pytest.fixture(scope="module")
def reference(smollm2):
    from conftest import smollm2_dir

    return Reference(smollm2_dir())


def sample(url: str, reference: Reference, settings, name: str) -> dict:
    """(prompt ids, setting) -> output token lists: one request (n = 2, unseeded) at a time."""
    out: dict = {}
    with httpx.Client(timeout=300) as client:  # a request takes 1-2 s; minutes on a loaded machine
        for temperature, top_k, top_p, count in settings:
            for messages in MESSAGES:
                prompt = tuple(reference.prompt_ids(messages))
                body = {"model": name, "messages": messages, "max_tokens": MAX_TOKENS, "n": 2,
                        "temperature": temperature, "return_token_ids": True}
                body.update({k: v for k, v in (("top_k", top_k), ("top_p", top_p)) if v is not None})
                for _ in range(count):
                    r = client.post(f"{url}/v1/chat/completions", json=body)
                    assert r.status_code == 200, r.text
                    choices = r.json()["choices"]
                    assert len(choices) == 2 and all(c["token_ids"] for c in choices)
                    out.setdefault((prompt, (temperature, top_k, top_p)), []).extend(c["token_ids"] for c in choices)
    return out


def test_prompts_tokenize_alike(served, reference):
    """The reference conditions on the prompt ids the app uses: its chat template's, via /tokenize."""
    name = app_args()["served_model_name"]
    for messages in MESSAGES:
        r = httpx.post(f"{served}/tokenize", json={"model": name, "messages": messages}, timeout=60)
        assert r.status_code == 200 and r.json()["tokens"] == reference.prompt_ids(messages), r.text


def test_t1_output_follows_the_target(served, reference):
    """Every output token's transform is uniform (module docstring); the trees and draft counts
    asserted are what make it a test of 8-node tree verification."""
    name = app_args()["served_model_name"]
    before = httpx.get(f"{served}/v1/stats", timeout=60).json()
    started = time.monotonic()
    samples = sample(served, reference, SETTINGS, name)
    sampled_s = time.monotonic() - started
    after = httpx.get(f"{served}/v1/stats", timeout=60).json()
    shapes = Counter(in_replica(_shapes))
    started = time.monotonic()
    result, surprisal = law(reference, samples)
    powers = {s: (power_at(result, s, TV), result.tv_detected(s, ALPHA)) for s in result.shapes}
    print(f"{sampled_s:.0f} s sampling, {time.monotonic() - started:.0f} s reference; {result}; power at TV {TV}, "
          f"TV at power 0.99: {powers}; surprisal p = {surprisal:.3g}; trees (nodes, depth, live siblings): {shapes.most_common(8)}")
    drafted = after["num_draft_tokens"] - before["num_draft_tokens"]
    assert drafted >= MIN_DRAFT_TOKENS, (before, after)
    full = sum(c for (nodes, depth, live), c in shapes.items() if nodes == 8 and depth >= 3 and live >= 3)
    assert full >= MIN_FULL_TREES, shapes
    assert not result.impossible, result.impossible[:5]
    assert result.p_value > ALPHA / 2, f"the served output is not the target's: {result}"
    assert surprisal > ALPHA / 2, f"the served output is not the target's: surprisal p = {surprisal:.3g}"
    assert all(tv99 < TV_099_MAX for _, tv99 in powers.values()), powers


def test_unverified_drafts_are_caught(served, reference):
    """The same statistic rejects the replica's tree rule replaced by one that accepts the first child
    of every node unverified (installed in the replica, then the spy put back)."""
    name = app_args()["served_model_name"]
    in_replica(_install, "fault")
    try:
        samples = sample(served, reference, [(1.0, None, None, FAULT_REQUESTS)], name)
    finally:
        in_replica(_install, "spy")
    result, surprisal = law(reference, samples, seed=1)
    print(f"faulty rule: {result}; surprisal p = {surprisal:.3g}")
    assert min(result.p_value, surprisal) < ALPHA / 2, \
        f"drafts accepted without the rejection rule went undetected: {result}; surprisal p = {surprisal:.3g}"
