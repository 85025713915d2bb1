"""A per-step audit of sampled speculative decoding (issue #53): every random draw an engine makes
for an unseeded sampled request, recorded as it is made and held to its exact law (not a test
module; tests/engine/test_lossless_grid.py runs it over the topologies).

Recording (`Audit.attach`). rayspec.sampling.rejection.verify calls its batched rule by module
name (`sample_verdicts`: every sampled sequence of a verification, chains and token trees) and the
engine samples a finished prefill's token with rayspec.engine.llm_engine's `choose_rows` (a queued
decode step, rayspec.engine.overlap, with its own, recorded at the step's read: `Overlap._resolve`);
wrapping these records, per draw, the
target rows the rule read (p: the context's row, then one per draft node), the drafts, their
probabilities q as the rule got them, and what was emitted, at the context of the sequence whose
random stream the call consumed. A seeded request draws coupled and never reaches these
(tests/engine/test_coupled_sampling.py holds it to target-only decoding exactly).

What is checked of a recorded run:
1. `check_rows`: every p row equals the target's processed distribution at its context computed
   independently (tests/reference.py: transformers' forward, the processing in numpy): on the
   common support, log-probabilities within 2 delta / T, delta the logits' rounding bound given to
   it; the supports equal except where a top-k / top-p cut lies within 2 delta of a tie. A topology
   that computes a wrong logit (a tensor-parallel shard, a chunk's positions, a stale cached
   block, a recompute after preemption, a compiled step, a processor left out) fails here
   whatever its size beyond rounding: no sample size involved.
2. `check_bookkeeping`: each output is its prefill token and then its steps' emitted tokens, in
   order, cut only inside the last step (tokens past a stop are never kept, none is dropped or
   changed after verification).
3. `law_test`: every draw follows its exact conditional law: a prefill token ~ p; a sampled
   draft token ~ its q (the condition rejection sampling needs of a proposer); a verification's
   outcome (the accepted path, then the recovered or bonus token) ~ the law the rejection rule
   gives it, computed here from p, q and the drafts (`rule_blocks`; not with rayspec.sampling).
   Each draw's randomized probability-integral transform (outcomes ordered: fewer accepted
   tokens first, then within a path the final token from the likeliest down) is then exactly
   Uniform(0, 1) and independent of the other draws' (Rosenblatt), so the bin counts of the
   transforms over BINS equal bins are multinomial; Pearson's statistic tests them. An outcome of
   probability 0 fails at once.
4. `power`: the test's power against two bias shapes, computed exactly from the run's own draws
   (no simulation): the law of every draw moved a fraction t of the way to
   - "chain": the rule accepting every draft with min(1, 2 p / q) (point masses: 2 R(x) / R's
     mass), the chain-shaped bias of tests/engine/test_lossless_sampled.py;
   - "proportional": every final token (recovered, bonus, prefill) drawn from
     r (1 + s / 2) renormalised, s = +1 on the likeliest tokens holding half of r's mass and -1 on
     the rest: a change proportional to r everywhere (a sharper draw: what a wrong temperature
     does), the shape with the least chi-square divergence for its total variation.
   Under such a mixture every bin probability moves linearly in t, so Pearson's statistic is
   noncentral chi-square with noncentrality n BINS sum_b (t d_b)^2 (d_b: the full bias's mean
   move of bin b), and TV = t * (the full bias's mean per-draw TV); `power` returns, per shape,
   the per-draw TV this run detects with probability 0.99 at the test's level.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

import stat_utils

BINS = 20


@dataclass
class Draw:
    """One random draw of an unseeded sampled request."""

    request_id: str
    context: tuple[int, ...]  # prompt + output when it was drawn (the pending tokens included)
    prompt_len: int
    params: object  # the request's SamplingParams
    kind: str  # "prefill" (one token ~ p[0]: a prefill's, or a queued decode step's), "chain" (a chain's verification), "tree" (a token tree's)
    p: np.ndarray  # [1 + nodes, V] float64: the target rows the rule read: the context's, then each node's
    tokens: list[int] = field(default_factory=list)  # the drafts (tree nodes)
    parents: list[int] = field(default_factory=list)  # each node's parent (-1: the context)
    q: np.ndarray | None = None  # [nodes, V]: a sampled chain's probabilities as the rule got them
    emitted: list[int] = field(default_factory=list)
    path: list[int] = field(default_factory=list)  # the accepted nodes, in order
    preempted: int = 0  # times the request had been preempted (and recomputed) when drawn

    def node_context(self, node: int) -> tuple[int, ...]:
        """The tokens the row of `node` (-1: the context's row) comes after."""
        tail = []
        while node >= 0:
            tail.append(self.tokens[node])
            node = self.parents[node]
        return self.context + tuple(reversed(tail))


def _numpy(t: torch.Tensor) -> np.ndarray:
    return t.detach().to(torch.float64).cpu().numpy()


class Audit:
    """Records the draws of every engine attached (a failover's two engines: one Audit)."""

    def __init__(self):
        self.draws: list[Draw] = []
        self.engines: list = []
        self._seqs: dict[int, object] = {}
        self._patched = False

    def _seq_of(self, generator):
        seq = self._seqs.get(id(generator))
        if seq is None or seq.generator is not generator:
            self._seqs = {id(s.generator): s for e in self.engines for s in e._requests.values()
                          if s.generator is not None}
            seq = self._seqs.get(id(generator))
        return seq

    def _draw(self, generator, **fields) -> None:
        seq = self._seq_of(generator)
        assert seq is not None, "a draw on a stream no request of the attached engines owns"
        self.draws.append(Draw(seq.request_id, tuple(seq.token_ids), len(seq.prompt_token_ids), seq.params,
                               preempted=seq.num_preemptions, **fields))

    def attach(self, engine, monkeypatch) -> "Audit":
        """Record `engine`'s draws from now on (whatever rule functions are in place: a test that
        injects a fault patches them first)."""
        self.engines.append(engine)
        if self._patched:
            return self
        self._patched = True
        import rayspec.engine.llm_engine as llm_engine
        import rayspec.sampling.rejection as rejection

        rule, choose = rejection.sample_verdicts, llm_engine.choose_rows

        def sample_verdicts(logits, index, settings, drafts, draft_probs, generators):
            sizes = [rejection.num_nodes(d) for d in drafts]  # rows each takes (a deferred draft: its budget)
            batch = rule(logits, index, settings, drafts, draft_probs, generators)
            finish = batch.finish

            def recorded(arrays):
                results = finish(arrays)  # (deferred drafts are on the host by now: their kept nodes come first)
                rows, start = _numpy(rejection.rows_probs(logits, index, settings)), 0
                for d, q, gen, (emitted, path), size in zip(drafts, draft_probs, generators, results, sizes):
                    k = len(d.tokens)
                    q = None if q is None else q[:k]
                    chain = d.parents is None or list(d.parents) == list(range(-1, k - 1))
                    self._draw(gen, kind="chain" if chain else "tree", p=rows[start: start + k + 1],
                               tokens=list(d.tokens), parents=list(range(-1, k - 1)) if chain else list(d.parents),
                               q=None if q is None else _numpy(q), emitted=list(emitted), path=list(path))
                    start += size + 1
                return results

            batch.finish = recorded
            return batch

        def first_tokens(logits, params, sources):  # a prefill's first tokens (LLMEngine._first_tokens)
            from rayspec.sampling.sampler import probs_of_rows

            choice = choose(logits, params, sources)
            tokens = choice.tolist()
            for i, (p, source) in enumerate(zip(params, sources)):
                if not p.greedy and not isinstance(source, int):  # an unseeded draw from its own stream
                    probs = probs_of_rows(logits[i: i + 1], [(p.temperature, p.top_k, p.top_p)])
                    self._draw(source, kind="prefill", p=_numpy(probs), emitted=[tokens[i]])
            return choice

        from rayspec.engine.overlap import Overlap

        resolve = Overlap._resolve

        def queued_tokens(overlap, q):  # a queued decode step's draws (rayspec.engine.overlap), at their read
            from rayspec.sampling.sampler import probs_of_rows

            tokens = q.tokens.tolist()
            for b, seq in enumerate(q.seqs):
                p = seq.params
                if not seq.finished and not p.greedy and p.seed is None:  # (before the token is appended)
                    probs = probs_of_rows(q.raw[b: b + 1], [(p.temperature, p.top_k, p.top_p)])
                    self._draw(seq.generator, kind="prefill", p=_numpy(probs), emitted=[tokens[b]])
            return resolve(overlap, q)

        monkeypatch.setattr(rejection, "sample_verdicts", sample_verdicts)
        monkeypatch.setattr(llm_engine, "choose_rows", first_tokens)
        monkeypatch.setattr(Overlap, "_resolve", queued_tokens)
        return self


class PerSequence:
    """A batch rule (`rayspec.sampling.rejection.sample_verdicts`'s signature) that verifies each
    sequence with per-sequence rules on the host: chain_rule(target_probs [k + 1, V], tokens, q,
    generator) -> emitted; tree_rule(probs_at, num_pending, draft, generator) -> (emitted, path).
    A test injects a biased rule with it (`per_sequence`)."""

    def __init__(self, chain_rule, tree_rule, logits, index, settings, drafts, draft_probs, generators):
        from rayspec.sampling.rejection import num_nodes, rows_probs

        self.tensors = []  # nothing to read: the rules read what they need
        self.sizes = [num_nodes(d) for d in drafts]  # rows each takes (a deferred draft: its budget)
        self._args = (chain_rule, tree_rule, rows_probs(logits, index, settings), drafts, draft_probs, generators)

    def finish(self, arrays):  # (deferred drafts are on the host by now: their kept nodes come first)
        chain_rule, tree_rule, probs, drafts, draft_probs, generators = self._args
        out, start = [], 0
        for d, q, gen, size in zip(drafts, draft_probs, generators, self.sizes):
            k = len(d.tokens)
            q = None if q is None else q[:k]
            rows = probs[start: start + k + 1]
            if d.parents is None or list(d.parents) == list(range(-1, k - 1)):
                emitted = chain_rule(rows, list(d.tokens), q, gen)
                out.append((emitted, list(range(len(emitted) - 1))))
            else:
                out.append(tree_rule(lambda r, rows=rows: rows[r], 1, d, gen))
            start += size + 1
        return out


def per_sequence(chain_rule=None, tree_rule=None):
    """sample_verdicts with these rules (None: the engine's own rule for one sequence)."""
    from rayspec.sampling import rejection

    chain_rule = chain_rule or rejection.verify_sampled
    tree_rule = tree_rule or rejection.verify_tree_sampled
    return lambda *args: PerSequence(chain_rule, tree_rule, *args)


# ---- 1. the rows ---------------------------------------------------------------------------------

def check_rows(draws: list[Draw], expected, delta: float) -> dict:
    """expected(items) -> (the reference's processed rows [N, V], their cut margins [N]) for items
    (draw, node) (`expected_rows`); delta: how far a logit of the engine may lie from the
    reference's (rounding). Raises AssertionError naming the first row that differs; returns counts."""
    items = [(d, node) for d in draws for node in range(-1, len(d.tokens))]
    if not items:
        return {"rows": 0, "near_ties": 0, "worst_log_gap": 0.0}
    got = np.stack([d.p[node + 1] for d, node in items])
    want, margin = expected(items)
    limit = np.array([2 * delta / d.params.temperature for d, _ in items])
    near = margin <= limit  # a near-tie at the cut: the supports may differ there
    differ = np.flatnonzero(((got > 0) != (want > 0)).any(-1) & ~near)
    if len(differ):
        d, node = items[differ[0]]
        raise AssertionError(f"{d.request_id} ({d.kind}) node {node}: the support differs at context "
                             f"{d.node_context(node)[-8:]}: engine {np.flatnonzero(got[differ[0]])[:12]}, "
                             f"reference {np.flatnonzero(want[differ[0]])[:12]}")
    # on the common support, renormalised alike: log-ratios within 2 delta / T of a constant
    both = (got > 0) & (want > 0)
    g = np.where(both, got, 1.0)
    w = np.where(both, want, 1.0)
    ratio = np.log(g / np.where(both, got, 0).sum(-1, keepdims=True)) - np.log(w / np.where(both, want, 0).sum(-1, keepdims=True))
    gap = np.where(both, np.abs(ratio), 0.0).max(-1)
    worst = np.flatnonzero(gap > limit)
    if len(worst):
        i = worst[0]
        d, node = items[i]
        raise AssertionError(f"{d.request_id} ({d.kind}) node {node}: log-probabilities differ by {gap[i]:.3g} > "
                             f"2 delta / T = {limit[i]:.3g} at context {d.node_context(node)[-8:]}")
    return {"rows": len(items), "near_ties": int(near.sum()), "worst_log_gap": float((gap * np.array(
        [d.params.temperature for d, _ in items])).max())}


def expected_rows(hf, allowed=None):
    """expected(items) for check_rows: the reference (tests/reference.py) at each (draw, node)'s
    context: hf's raw logits, the request's bias and penalties, `allowed(draw, context) -> [V] bool`
    (a grammar's mask, the test's own), then temperature / top-k / top-p."""
    from reference import cut_margin, penalized, processed_probs

    def expected(items):
        rows, keys = [], []
        for d, node in items:
            context = d.node_context(node)
            p = d.params
            row = penalized(hf(context), context[:d.prompt_len], context[d.prompt_len:], logit_bias=p.logit_bias,
                            repetition_penalty=p.repetition_penalty, frequency_penalty=p.frequency_penalty,
                            presence_penalty=p.presence_penalty)
            if allowed is not None:
                row = np.where(allowed(d, context), row, -np.inf)
            rows.append(row)
            keys.append((p.temperature, p.top_k, p.top_p))
        rows = np.stack(rows)
        want, margin = np.empty_like(rows), np.empty(len(rows))
        for key in set(keys):
            at = np.array([k == key for k in keys])
            want[at], margin[at] = processed_probs(rows[at], *key), cut_margin(rows[at], *key)
        return want, margin

    return expected


def node_contexts(draws: list[Draw]) -> list[tuple[int, ...]]:
    """Every context a row of `draws` comes after (to compute them in one batched pass)."""
    return [d.node_context(node) for d in draws for node in range(-1, len(d.tokens))]


# ---- 2. the bookkeeping --------------------------------------------------------------------------

def check_bookkeeping(draws: list[Draw], outputs: dict[str, list[int]], resumed: dict[str, list[int]] | None = None
                      ) -> None:
    """outputs: request id -> its final output token ids; resumed: request id -> the output it was
    resumed with (failover), which the draws continue. Draws of one request are in draw order."""
    by_request: dict[str, list[Draw]] = {}
    for d in draws:
        by_request.setdefault(d.request_id, []).append(d)
    for rid, out in outputs.items():
        made = list((resumed or {}).get(rid, []))
        for d in by_request.get(rid, []):
            assert tuple(d.context[d.prompt_len:]) == tuple(made), (
                f"{rid}: a draw at output {list(d.context[d.prompt_len:])[-6:]} where the emitted tokens were {made[-6:]}")
            made += d.emitted
        assert made[:len(out)] == list(out), f"{rid}: the output is not the emitted tokens: {out} vs {made}"
        last = by_request[rid][-1] if rid in by_request else None
        cut = len(made) - len(out)
        assert last is not None and 0 <= cut < len(last.emitted), (
            f"{rid}: {cut} emitted tokens dropped (only the last step's may be, past the finish)")


# ---- 3. the law of each draw ---------------------------------------------------------------------

def usable(q: np.ndarray | None, tokens: list[int], vocab: int) -> bool:
    """A q the rule uses (rayspec.sampling.rejection's module docstring, written from it):
    shape [k, V], finite, >= 0, each row summing to 1 (within float32 softmax's 1e-3), q(x) > 0."""
    if q is None or q.shape != (len(tokens), vocab):
        return False
    return bool(np.isfinite(q).all() and (q >= 0).all() and (np.abs(q.sum(-1) - 1) <= 1e-3).all()
                and all(q[j, x] > 0 for j, x in enumerate(tokens)))


@dataclass
class Block:
    """The outcomes of a draw that accept `path` and then draw the final token from `row`."""

    path: tuple[int, ...]
    mass: float
    row: np.ndarray  # [V], sums to 1


def rule_blocks(d: Draw, boost: float = 1.0) -> list[Block]:
    """The exact law of the draw's outcome, by accepted path, in the PIT's order (fewer accepted
    first, then by node index). boost: accept with min(1, boost p / q) (the "chain" bias; 1: the rule).

    Sampled chain (a usable q): draft j is accepted with min(1, p_j(x) / q_j(x)); at the first
    rejection the recovered token ~ normalise(max(0, p_j - q_j)); after all k, the bonus ~ p_k.
    Point masses (a chain without q, a tree): at a node the children are tried in turn against what
    is left of its row R, each accepted with R(x) / R's mass and removed when rejected; the final
    token ~ what is left."""
    if d.kind == "prefill":
        return [Block((), 1.0, d.p[0])]
    vocab = d.p.shape[-1]
    blocks: list[Block] = []
    if d.kind == "chain" and usable(d.q, d.tokens, vocab):
        reach = 1.0
        for j, x in enumerate(d.tokens):
            a = min(1.0, boost * d.p[j, x] / d.q[j, x])
            residual = np.maximum(d.p[j] - d.q[j], 0.0)
            if reach * (1 - a) > 0 and residual.sum() > 0:
                blocks.append(Block(tuple(range(j)), reach * (1 - a), residual / residual.sum()))
            reach *= a
            if reach == 0:
                break
        if reach > 0:
            k = len(d.tokens)
            blocks.append(Block(tuple(range(k)), reach, d.p[k]))
    else:
        children: dict[int, list[int]] = {}
        for j, parent in enumerate(d.parents):
            children.setdefault(parent, []).append(j)

        def walk(node: int, reach: float, path: tuple[int, ...]) -> None:
            left = d.p[node + 1].copy()
            for c in children.get(node, ()):
                x = d.tokens[c]
                total = left.sum()
                a = min(1.0, boost * left[x] / total) if total > 0 else 0.0
                if a > 0:
                    walk(c, reach * a, path + (c,))
                reach *= 1 - a
                left[x] = 0.0
            if reach > 0 and left.sum() > 0:
                blocks.append(Block(path, reach, left / left.sum()))

        walk(-1, 1.0, ())
    blocks.sort(key=lambda b: (len(b.path), b.path))
    return blocks


def sharpened(blocks: list[Block], eps: float = 0.5) -> list[Block]:
    """The "proportional" bias: each final row r -> r (1 + eps s) renormalised, s = +1 on the
    likeliest tokens holding half of r's mass (mass before them < 1/2), -1 on the rest."""
    out = []
    for b in blocks:
        order = np.argsort(-b.row, kind="stable")
        before = np.cumsum(b.row[order]) - b.row[order]
        sign = np.where(before < 0.5, 1.0, -1.0)
        row = np.empty_like(b.row)
        row[order] = b.row[order] * (1 + eps * sign)
        out.append(Block(b.path, b.mass, row / row.sum()))
    return out


def _order(row: np.ndarray) -> np.ndarray:
    return np.argsort(-row, kind="stable")  # the likeliest first, ties by id


def pit(blocks: list[Block], path: tuple[int, ...], token: int, u: float) -> float | None:
    """The randomized probability-integral transform of outcome (path, token); None if it has
    probability 0 under `blocks`."""
    start = 0.0
    for b in blocks:
        if b.path == path:
            if b.row[token] <= 0:
                return None
            order = _order(b.row)
            rank = int(np.flatnonzero(order == token)[0])
            before = float(b.row[order[:rank]].sum())
            return start + b.mass * (before + u * b.row[token])
        start += b.mass
    return None


def bin_probs(null: list[Block], alt: list[Block], bins: int = BINS) -> np.ndarray:
    """[bins]: the probability of each equal bin of the null's PIT when the outcome follows `alt`
    (the same paths, in the same order; alt puts no mass where null has none)."""
    edges = np.linspace(0.0, 1.0, bins + 1)[1:-1]
    cdf = np.zeros(len(edges))
    start = 0.0
    for b, a in zip(null, alt):
        inside = (edges > start) & (edges < start + b.mass)
        cdf[edges >= start + b.mass] += a.mass
        if inside.any():
            order = _order(b.row)
            cum = np.concatenate([[0.0], np.cumsum(b.row[order])])
            alt_cum = np.concatenate([[0.0], np.cumsum(a.row[order])])
            t = (edges[inside] - start) / b.mass
            i = np.clip(np.searchsorted(cum, t, side="right") - 1, 0, len(order) - 1)
            width = b.row[order][i]
            frac = np.where(width > 0, (t - cum[i]) / np.where(width > 0, width, 1), 0.0)
            cdf[inside] += a.mass * (alt_cum[i] + a.row[order][i] * np.clip(frac, 0, 1))
        start += b.mass
    return np.diff(np.concatenate([[0.0], cdf, [1.0]]))


def _tv(null: list[Block], alt: list[Block]) -> float:
    return 0.5 * sum(float(np.abs(a.mass * a.row - b.mass * b.row).sum()) for b, a in zip(null, alt))


@dataclass
class LawResult:
    num_draws: int  # the transforms tested
    impossible: list[str]
    counts: np.ndarray  # per bin
    statistic: float
    p_value: float
    shapes: dict  # shape -> (the full bias's mean per-draw TV, its mean move of each bin's probability [BINS])

    def __str__(self) -> str:
        return (f"{self.num_draws} draws: chi2 = {self.statistic:.1f} on {BINS - 1} df, p = {self.p_value:.3g}, "
                f"{len(self.impossible)} impossible")

    def tv_detected(self, shape: str, alpha: float, power: float = 0.99) -> float:
        """The per-draw TV of a bias of this shape that the test rejects with `power` at level alpha
        (the bias scaled by t: TV t * tv, noncentrality t^2 * n BINS sum_b move_b^2)."""
        tv, move = self.shapes[shape]
        unit = self.num_draws * BINS * float((move ** 2).sum())  # noncentrality at t = 1
        if unit == 0:
            return float("inf")
        crit = stat_utils.chi2_isf(alpha, BINS - 1)
        low, high = 0.0, 1.0
        while stat_utils.ncx2_sf(crit, BINS - 1, unit * high ** 2) < power:
            high *= 2
            if high > 1e6:
                return float("inf")
        for _ in range(50):
            mid = (low + high) / 2
            low, high = (mid, high) if stat_utils.ncx2_sf(crit, BINS - 1, unit * mid ** 2) < power else (low, mid)
        return high * tv


def law_test(draws: list[Draw], seed: int = 0) -> tuple[LawResult, LawResult]:
    """Sections 3 and 4 of the module docstring over `draws`: (the outcomes' test, with the power
    of both bias shapes; the sampled drafts' test)."""
    rng = np.random.default_rng(seed)
    outcome_us, draft_us, impossible = [], [], []
    moves = {"chain": np.zeros(BINS), "proportional": np.zeros(BINS)}
    tvs = {"chain": 0.0, "proportional": 0.0}
    for d in draws:
        vocab = d.p.shape[-1]
        if d.kind == "chain" and usable(d.q, d.tokens, vocab):
            for j, x in enumerate(d.tokens):  # the proposer's draws: x_j ~ q_j
                u = pit([Block((), 1.0, d.q[j] / d.q[j].sum())], (), x, rng.random())
                if u is None:
                    impossible.append(f"{d.request_id}: draft {x} has q = 0")
                else:
                    draft_us.append(u)
        null = rule_blocks(d)
        path = tuple(d.path)
        u = pit(null, path, d.emitted[-1], rng.random())
        if u is None or list(d.emitted[:-1]) != [d.tokens[j] for j in path]:
            impossible.append(f"{d.request_id} ({d.kind}): outcome {d.emitted} (path {d.path}) has probability 0")
            continue
        outcome_us.append(u)
        for shape, alt in (("chain", _boosted(d, null)), ("proportional", sharpened(null))):
            moves[shape] += bin_probs(null, alt) - 1.0 / BINS
            tvs[shape] += _tv(null, alt)
    n = len(outcome_us)
    shapes = {s: (tvs[s] / max(n, 1), moves[s] / max(n, 1)) for s in moves}
    return _pearson(outcome_us, impossible, shapes), _pearson(draft_us, [], {})


def _pearson(us: list[float], impossible: list[str], shapes: dict) -> LawResult:
    n = len(us)
    counts = np.bincount(np.minimum((np.asarray(us, dtype=float) * BINS).astype(int), BINS - 1), minlength=BINS)
    expected = n / BINS
    statistic = float(((counts - expected) ** 2 / expected).sum()) if n else 0.0
    return LawResult(n, impossible, counts, statistic, stat_utils.chi2_sf(statistic, BINS - 1) if n else 1.0, shapes)


def _boosted(d: Draw, null: list[Block]) -> list[Block]:
    """The "chain" bias's blocks, aligned with the null's paths (a path the boost makes certain
    keeps a block of mass 0)."""
    alt = {b.path: b for b in rule_blocks(d, boost=2.0)}
    return [alt.get(b.path, Block(b.path, 0.0, b.row)) for b in null]
