"""Cost-aware drafting: per step and per sequence, draft only what pays.

(Over 500 lines: one model of a step's worth, its three parts read together: the acceptance
estimates, the cost fits, and the plan that weighs one against the other.)

A draft is a bet. Drafting n more tokens of sequence i costs a proposer call (once per step, for
the batch) and n more verification rows in the target's forward; it returns the tokens of it the
target accepts. The planner estimates both sides and picks, per sequence, the draft budget n_i
that maximises the step's expected output tokens per second:

    rate = sum_i (1 + E_i(n_i)) / (verify_s(batch, rows, rows x context) + propose_s(depth, batch))

- E_i(n): expected accepted tokens of a draft of budget n, from the sequence's recent acceptance
  (`Acceptance`): per draft depth d, a discounted Beta posterior of alpha_d = P(depth d accepted |
  depth d - 1 was), its prior the engine's recent pooled traffic of the same shape and sampling
  kind. A chain of n reaches depth n; a tree of n nodes, `topk` wide per depth, depth ceil(n / topk).
  E(n) = calibration x sum_{d <= depth} prod_{j <= d} alpha_j (`DraftPlanner.calibration`, at most 1:
  what the recent planned drafts accepted over what was expected of them). Greedy and sampled
  requests alike (their acceptance is what their verification reports).
- worth: an accepted token counts as an emitted one (the rate's numerator), except in a closed
  batch (the engine's Scheduler.closed_batch: nothing waiting or joining), which runs as many steps
  as its slowest sequences need: there the slowest (PlanInput.weight 1: within one draft of the
  one with most tokens left) bring the end nearer only by what the least advancing of them
  advances, so a step is worth n x (1 + min E_i) over them, and a sequence ahead nothing (it
  drafts again once the slowest catch up). `Proposer.draftable` caps a budget at what the
  proposer can draft now (an n-gram lookup without a match: 0).
- costs: `MeasuredCosts` fits both functions online to the engine's host-timed steps (discounted
  least squares; rows are nearly free on a GPU and not on a CPU, and the fit says so), seeded by
  a calibration at warm-up, robust to one-sided timing noise (a shape's first timing left out,
  later ones clipped at OUTLIER x the prediction, a proposer fit far above a fresh timing
  restarted: on an H200 one cold call otherwise stopped a draft model that was always right); `ModelledCosts` (SpeculativeConfig.draft_costs) takes fixed
  coefficients instead, so tests and anyone needing determinism get the same plans on any machine.

Zero drafts when nothing pays (a plain decode step: the proposer is not called). A sequence left
at zero for `probe_every` steps drafts its full budget once (a probe), so acceptance that returns
is seen and the cost of a full draft stays measured; a probe with nothing accepted doubles the
sequence's interval (up to `max_probe_every`), any accepted draft resets it. Probes are also paced
engine-wide: the sequences due take their probes together, in one step, and only once `probe_gap`
steps have passed since the last probing step; a probe that finds nothing doubles that gap (up to
`max_probe_gap`), an accepted draft halves it. Traffic no draft can guess so pays for a probe step
every few hundred steps, not one per sequence every few dozen: a draft model's probe catches up on
the context it skipped (its last Proposer.probe_window tokens at most: the draft restarts from
there), and on a CPU any multi-row verification jumps in cost. The probes
that must first catch up on a context (a draft model's) also have a budget
(SpeculativeConfig.probe_share, 2% by default): each step adds that share of its estimated cost
(a step at disable_by_batch_size, planned without drafts, too: `skip`), a probing step takes what
those probes add (their catch-up, windowed, counted whole), and the sequences due probe only as far as the
budget covers, longest-waiting first; where nothing is ever accepted, they then cost at most that
share of the time plus one probing step's worth; a probe dearer than the budget ever banks
(max_probe_gap steps' share) goes once the bank is full, so an estimate too high is re-measured
now and then instead of never. A probe with nothing to catch up on (n-gram, an
EAGLE head) costs at most one multi-row step and is paced only: budgeted, a fresh engine's first
requests could end before one came due (seen: configs/default.yaml's head, 24 tokens, no draft).
- catch-up: a proposer with a model of its own runs through the context it has not seen before it
  drafts (Proposer.catch_up_tokens: a draft model after steps without drafts, or a new sequence's
  prompt). Its cost is a term of the proposer fit; the planner spreads the part past one step's
  tokens over the steps the sequence has left (paid once, it serves every later draft).
Drafting less never changes what is emitted at temperature 0, nor the distribution above
(the verifier keeps the output the target's), nor a seeded request's tokens: its draws are coupled
to positions, not to a stream that drafted tokens consume (rayspec.sampling.sampler), so a seeded request
is planned like any other.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import numpy as np

# per-sequence observations are discounted by this per draft (about the last 10 drafts count);
# the engine-wide pool, the prior of every sequence, by POOL_DISCOUNT (about the last 50)
SEQ_DISCOUNT, POOL_DISCOUNT = 0.9, 0.98
PRIOR_MEAN, PRIOR_WEIGHT = 0.5, 2.0  # the pool's own prior at every depth
POOL_WEIGHT = 3.0  # pseudo-observations the pool lends a sequence's estimate at each depth
# a probe budget that keeps probes (paced, engine-wide) to this share of the estimated step time:
# SpeculativeConfig.probe_share's default
PROBE_SHARE = 0.02
# the estimates' calibration: expected accepted tokens of the drafts planned (probes left out)
# against what their verification accepted, discounted by this per draft (about the last 100), with
# CALIBRATION_WEIGHT pseudo-tokens of agreement, clipped to CALIBRATION_RANGE: it only ever lowers
# the estimates (one too low costs a gain, one too high a loss; raised, EAGLE-3's trees on MT-bench
# drafted 7% more for as many accepted)
CALIBRATION_DISCOUNT, CALIBRATION_WEIGHT, CALIBRATION_RANGE = 0.99, 8.0, (0.5, 1.0)


@dataclass
class DepthCounts:
    """Discounted Beta counts per draft depth (index d - 1 for depth d)."""

    accepted: list[float] = field(default_factory=list)
    tried: list[float] = field(default_factory=list)

    def observe(self, depth: int, num_accepted: int, discount: float) -> None:
        """A draft reaching `depth` whose first `num_accepted` tokens were accepted: depths
        1..num_accepted succeeded, depth num_accepted + 1 (if drafted) failed, deeper unseen."""
        grow = depth - len(self.tried)
        if grow > 0:
            self.accepted += [0.0] * grow
            self.tried += [0.0] * grow
        self.accepted = [a * discount for a in self.accepted]
        self.tried = [t * discount for t in self.tried]
        for d in range(min(num_accepted + 1, depth)):
            self.tried[d] += 1.0
            self.accepted[d] += 1.0 if d < num_accepted else 0.0

    def get(self, d: int) -> tuple[float, float]:
        return (self.accepted[d], self.tried[d]) if d < len(self.tried) else (0.0, 0.0)


class Acceptance:
    """The engine's acceptance estimates: a pool per (shape, greedy) and each sequence's own."""

    def __init__(self):
        self.pool: dict[tuple[str, bool], DepthCounts] = {}

    def rates(self, own: DepthCounts | None, shape: str, greedy: bool, depth: int) -> list[float]:
        """alpha_1..alpha_depth: the sequence's posterior means (its counts over the pool's prior)."""
        pool = self.pool.get((shape, greedy))
        out = []
        for d in range(depth):
            pa, pt = pool.get(d) if pool is not None else (0.0, 0.0)
            prior = (pa + PRIOR_MEAN * PRIOR_WEIGHT) / (pt + PRIOR_WEIGHT)
            a, t = own.get(d) if own is not None else (0.0, 0.0)
            out.append((a + prior * POOL_WEIGHT) / (t + POOL_WEIGHT))
        return out

    def observe(self, own: DepthCounts, shape: str, greedy: bool, depth: int, num_accepted: int) -> None:
        own.observe(depth, num_accepted, SEQ_DISCOUNT)
        self.pool.setdefault((shape, greedy), DepthCounts()).observe(depth, num_accepted, POOL_DISCOUNT)


def expected_accepted(rates: list[float], depth: int) -> float:
    """sum_{d <= depth} prod_{j <= d} alpha_j: expected accepted tokens of a draft that deep."""
    total, reach = 0.0, 1.0
    for a in rates[:depth]:
        reach *= a
        total += reach
    return total


# ---- costs ------------------------------------------------------------------------------------

def verify_features(batch: int, rows: int, row_context: float) -> np.ndarray:
    """rows: tokens verified in the step (all sequences); row_context: sum over sequences of
    rows x context length, in thousands (attention's share). The second feature is 1 when any
    sequence verifies more than one row: a CPU then leaves its one-row (decode) kernels for
    matrix-matrix ones, a jump measured at ~45% of a SmolLM2 step on the AMD EPYC here, after which
    each row adds ~3%; on a GPU neither shows."""
    return np.array([1.0, float(rows > batch), rows, row_context / 1000.0])


def propose_features(depth: int, batch: int, catch_up: float = 0.0) -> np.ndarray:
    """depth: sequential proposer forwards (chain length, tree depth); batch: sequences drafted;
    catch_up: tokens the proposer runs through before drafting (Proposer.catch_up_tokens, summed over
    the sequences drafted), in thousands: a draft model's prefill of the context it skipped."""
    return np.array([1.0, depth, depth * batch, catch_up / 1000.0])


class LinearFit:
    """Discounted least squares y ~ theta . x with a ridge pull towards theta0 (per coefficient
    weights `ridge`, in pseudo-observations of x_j = 1)."""

    def __init__(self, theta0, ridge, discount: float = 0.98):
        self.theta0 = np.asarray(theta0, dtype=np.float64)
        n = len(self.theta0)
        self.prior = np.diag(np.asarray(ridge, dtype=np.float64))
        self.a = np.zeros((n, n))
        self.b = np.zeros(n)
        self.discount = discount
        self.num_observed = 0
        self.num_clipped = self.num_restarts = 0
        self._theta = self.theta0.copy()
        self._stale = False  # observed since theta was last solved for (solved when next read)

    def observe(self, x: np.ndarray, y: float, clip: float | None = None, restart: bool = False) -> None:
        """clip: once the fit has data, y counts at most clip x the fit's prediction (winsorised);
        restart: and a y below 1 / clip of it restarts the fit from y (what it learnt is not the
        present: an outlier it was seeded with; for a fit observed only now and then)."""
        if clip is not None and self.num_observed:
            predicted = float(self._theta @ x)  # as last solved for (at most the last step's data behind)
            if predicted > 0 and y > clip * predicted:
                y, self.num_clipped = clip * predicted, self.num_clipped + 1
            elif restart and y * clip < predicted:
                self.a, self.b, self.num_restarts = np.zeros_like(self.a), np.zeros_like(self.b), self.num_restarts + 1
        self.a = self.discount * self.a + np.outer(x, x)
        self.b = self.discount * self.b + x * y
        self.num_observed += 1
        self._stale = True

    @property
    def theta(self) -> np.ndarray:
        """The coefficients, solved for when first read after an observation (an engine observes
        every step; a solve per step cost ~150 us with lstsq, 1% of a CPU decode step and more of
        a GPU one, also where nothing reads the fit)."""
        if self._stale:
            system, rhs = self.a + self.prior, self.b + self.prior @ self.theta0
            try:  # positive definite: the ridge is > 0 on every coefficient
                theta = np.linalg.solve(system, rhs)
            except np.linalg.LinAlgError:
                theta = np.linalg.lstsq(system, rhs, rcond=None)[0]
            self._theta, self._stale = np.maximum(theta, 0.0), False  # no cost falls with more rows or depth
        return self._theta

    def predict(self, x: np.ndarray) -> float:
        return float(self.theta @ x)


# a timed step counts at most this many times the fit's prediction (MeasuredCosts): step times have
# one-sided noise (one-off work, preemption), and one outlier must not stop drafting for good
OUTLIER = 3.0


class MeasuredCosts:
    """Step costs fitted to the engine's own host timers: verification (the target forward, the
    verdicts, the commit) as a function of rows and rows x context, the proposer call as one of
    depth and batch. `calibrate` seeds the verification fit with timed dummy forwards."""

    deterministic = False

    def __init__(self):
        # the context term is pulled to 0 by ~10 pseudo-steps: on a busy machine step times are
        # noisy, and rows x context moves with rows; attention's share must show in the data
        self.verify = LinearFit([0.0, 0.0, 0.0, 0.0], ridge=[1e-6, 1e-2, 1e-2, 10.0])
        self.propose = LinearFit([0.0, 0.0, 0.0, 0.0], ridge=[1e-6, 1e-2, 1e-2, 1e-2])
        self._seen: set[tuple] = set()  # step shapes timed once already (_first_seen)
        self.num_first_seen = 0  # timings left out as a shape's first

    def verify_s(self, batch: int, rows: int, row_context: float) -> float:
        return self.verify.predict(verify_features(batch, rows, row_context))

    def propose_s(self, depth: int, batch: int, catch_up: float = 0.0) -> float:
        # nothing measured yet: free (optimistic), so the proposer gets called and timed
        return self.propose.predict(propose_features(depth, batch, catch_up)) if self.propose.num_observed else 0.0

    def coefficients(self) -> tuple[list[float], list[float]]:
        """The verification and proposer coefficients over verify_features / propose_features."""
        propose = self.propose.theta.tolist() if self.propose.num_observed else [0.0] * 4
        return self.verify.theta.tolist(), propose

    def observe_verify(self, batch: int, rows: int, row_context: float, seconds: float, warm: bool = False) -> None:
        """warm: a timing known to be of warm kernels (calibrate_costs' medians), kept even for a shape
        seen the first time."""
        if self._first_seen(("verify", batch, rows), warm):
            return
        self.verify.observe(verify_features(batch, rows, row_context), seconds, clip=OUTLIER)

    def observe_propose(self, depth: int, batch: int, seconds: float, catch_up: float = 0.0) -> None:
        if self._first_seen(("propose", depth, batch), False):
            return
        # (observed only when drafting: a fit too high, which stops the drafts, restarts on the next
        # probe's timing; the verification fit is observed every step and outgrows an outlier)
        self.propose.observe(propose_features(depth, batch, catch_up), seconds, clip=OUTLIER, restart=True)

    def _first_seen(self, shape: tuple, warm: bool) -> bool:
        """Whether this is the first timing of a step of this shape (then left out of the fit): the
        first call of a shape pays one-off work, lazily loaded CUDA kernels, a compiled shape's
        compilation and graph capture, a CPU library's first primitives. Later one-off costs (a
        kernel first loaded for a new prefill length, a preempted thread) count at most OUTLIER x
        the fit's prediction. Kept whole, such outliers (an EAGLE head's first tree on an H200,
        eager: 0.3 s against ~20 ms warm; a draft model's first catch-ups) set the proposer's fit so
        high that the planner stopped drafting and its rare probes could not bring it back
        (benchmarks/gpu_never_loses.py, results/gpu_never_loses_h200.json)."""
        if shape in self._seen:
            return False
        self._seen.add(shape)
        self.num_first_seen += not warm
        return not warm

    @property
    def known(self) -> bool:
        return self.verify.num_observed > 0


class ModelledCosts:
    """Fixed cost coefficients (SpeculativeConfig.draft_costs): no timer involved, the same plan on
    every machine. Keys: step_s, multirow_s (added when any sequence verifies drafts), row_s,
    row_context_s (per row x 1000 context tokens), propose_s, propose_depth_s,
    propose_depth_batch_s, propose_catch_up_s (per 1000 tokens caught up); missing ones are 0."""

    deterministic = True
    known = True
    KEYS = ("step_s", "multirow_s", "row_s", "row_context_s", "propose_s", "propose_depth_s", "propose_depth_batch_s",
            "propose_catch_up_s")

    def __init__(self, coefficients: dict):
        unknown = set(coefficients) - set(self.KEYS)
        if unknown:
            raise ValueError(f"draft_costs: unknown keys {sorted(unknown)} (known: {', '.join(self.KEYS)})")
        if any(v < 0 for v in coefficients.values()):
            raise ValueError("draft_costs must be >= 0")
        c = [float(coefficients.get(k, 0.0)) for k in self.KEYS]
        if c[0] <= 0:
            raise ValueError("draft_costs.step_s must be > 0")
        self.verify_theta, self.propose_theta = np.array(c[:4]), np.array(c[4:])

    def verify_s(self, batch: int, rows: int, row_context: float) -> float:
        return float(self.verify_theta @ verify_features(batch, rows, row_context))

    def propose_s(self, depth: int, batch: int, catch_up: float = 0.0) -> float:
        return float(self.propose_theta @ propose_features(depth, batch, catch_up))

    def coefficients(self) -> tuple[list[float], list[float]]:
        return self.verify_theta.tolist(), self.propose_theta.tolist()

    def observe_verify(self, batch: int, rows: int, row_context: float, seconds: float, warm: bool = False) -> None:
        pass

    def observe_propose(self, depth: int, batch: int, seconds: float, catch_up: float = 0.0) -> None:
        pass


# ---- the plan ---------------------------------------------------------------------------------

@dataclass
class SeqDraftState:
    """What the planner keeps per sequence (Sequence.drafting)."""

    counts: dict[str, DepthCounts] = field(default_factory=dict)  # per shape ("chain", "tree")
    steps_at_zero: int = 0  # consecutive decode steps planned without drafts
    probe_every: int | None = None  # its steps at zero before a probe (None: the planner's probe_every)
    probing: bool = False  # its current draft is a probe
    # its current planned draft's alpha_1.. (Acceptance.rates, uncalibrated): what the planner
    # expected of it, checked against its verification (DraftPlanner.calibration)
    expected_rates: list[float] | None = None


@dataclass
class PlanInput:
    """One decoding sequence as the planner sees it."""

    state: SeqDraftState
    greedy: bool
    context: int  # tokens in its context
    cap: int  # the most it may draft (remaining tokens, its own num_speculative_tokens)
    catch_up: int = 0  # tokens the proposer would first run through to draft for it (Proposer.catch_up_tokens)
    remaining: int = 0  # tokens the request may still produce (0: unknown; its catch-up is not spread)
    # what its accepted tokens are worth, per token emitted: 1, unless the batch is closed (nothing
    # waits or has joined lately; LLMEngine._token_weights) and it is ahead of the batch's slowest:
    # then 0, as finishing it sooner ends no step sooner
    weight: float = 1.0
    probe_catch_up: int | None = None  # the same for a probe (Proposer.probe_window); None: catch_up


class DraftPlanner:
    """Chooses each step's per-sequence draft budgets (see the module docstring)."""

    def __init__(self, max_k: int, costs, topk: int = 1, max_depth: int | None = None, probe_every: int = 16,
                 max_probe_every: int = 64, max_probe_gap: int = 256, probe_share: float | None = None):
        self.max_k, self.topk = max_k, max(1, topk)
        self.max_depth = max_depth or max_k  # a tree's depth limit (num_steps)
        self.costs = costs
        self.acceptance = Acceptance()
        self.probe_every, self.max_probe_every = probe_every, max_probe_every
        # engine-wide pacing of probes: planned steps since the last
        # probing step, and the fewest allowed between two (0 until a probe finds nothing)
        self.since_probe, self.probe_gap, self.max_probe_gap = 0, 0, max_probe_gap
        self._round_open = False  # a paced probing step whose verdict has not yet moved the gap
        # what probes may cost: each planned step adds probe_share of its own estimated cost, a
        # paced probing step takes its estimated extra cost (catch-up included); None: no limit
        self.probe_share, self.probe_budget = probe_share, 0.0
        self._bank_cap = math.inf  # the most the budget banks (max_probe_gap steps' share), as last accrued
        # per (shape, greedy): discounted sums of (expected, accepted) tokens of planned drafts
        self._calibration: dict[tuple[str, bool], list[float]] = {}

    def calibration(self, shape: str, greedy: bool) -> float:
        """Accepted over expected tokens of the recent planned drafts of this shape and sampling kind
        (1 until some are verified): the factor the plan scales its expectations by. The estimates
        are posterior means, and the plan drafts where they are highest: the drafts taken are those
        whose estimate came out high, and they accept less than it says (n-gram at concurrency 8 on
        HumanEval, 2 cores, requests joining as others finish: 432 tokens expected, 383 accepted;
        there a draft only just pays, and the engine served 0.92x its baseline; calibrated, 0.83,
        it read 0.960x against 0.946x uncalibrated in one interleaved in-process run)."""
        expected, accepted = self._calibration.get((shape, greedy), (0.0, 0.0))
        lo, hi = CALIBRATION_RANGE
        return min(hi, max(lo, (accepted + CALIBRATION_WEIGHT) / (expected + CALIBRATION_WEIGHT)))

    def budgets(self, tree: bool) -> list[int]:
        """The draft budgets a step may give a sequence: any k for chains; for trees whole depths
        of `topk` nodes (and max_k itself)."""
        if not tree:
            return list(range(self.max_k + 1))
        menu = {min(self.max_k, self.topk * d) for d in range(1, self.max_depth + 1)} | {self.max_k}
        return [0] + sorted(b for b in menu if b > 0)

    def depth(self, budget: int, tree: bool) -> int:
        """Draft depth whose acceptance counts (E); for trees ceil(budget / topk)."""
        return min(self.max_depth, math.ceil(budget / self.topk)) if tree else budget

    def proposer_depth(self, budget: int, tree: bool) -> int:
        """Sequential proposer forwards a draft of this budget takes (the EAGLE tree grows
        min(num_steps, budget) deep and keeps the best `budget` nodes)."""
        return min(self.max_depth, budget) if tree else budget

    def plan(self, seqs: list[PlanInput], tree: bool, closed: bool = False) -> list[int]:
        """Per sequence, the budget to ask the proposer for (0: none). closed: the batch runs as many
        steps as its slowest sequences need (Scheduler.closed_batch; the slowest have weight 1)."""
        shape = "tree" if tree else "chain"
        menu = self.budgets(tree)
        options, values, all_rates = [], [], []  # per sequence: allowed budgets (ascending) and E at each
        for s in seqs:
            allowed = sorted({min(b, s.cap) for b in menu if b >= 0})
            rates = self.acceptance.rates(s.state.counts.get(shape), shape, s.greedy, self.depth(allowed[-1], tree))
            scale = self.calibration(shape, s.greedy)
            options.append(allowed)
            all_rates.append(rates)
            values.append([scale * expected_accepted(rates, self.depth(b, tree)) for b in allowed])
        full_values = [v[-1] for v in values]  # the pace a sequence's context grows at (catch-up spreading)
        planned = self.costs.known
        if not planned:  # nothing timed yet: the full budget, so the costs get measured
            choice = [len(o) - 1 for o in options]
        elif closed and len(seqs) > 1:
            choice = self._closed(seqs, options, values, full_values, tree)
        else:
            worth = [[s.weight * x for x in v] for s, v in zip(seqs, values)] if any(s.weight != 1.0 for s in seqs) \
                else values
            choice = self._climb(seqs, options, worth, full_values, tree)
        out = [o[c] for o, c in zip(options, choice)]
        for s, b, rates in zip(seqs, out, all_rates):
            s.state.expected_rates = rates if planned and b > 0 else None
        self._probe(seqs, options, full_values, out, tree)
        return out

    def _probe(self, seqs: list[PlanInput], options: list[list[int]], full_values: list[float], out: list[int],
               tree: bool) -> None:
        """Now and then a sequence left at zero drafts its full budget (a probe): those due probe
        together once the engine-wide gap has passed; one whose proposer must first catch up on its
        context (more than a drafting step's tokens) only as far as the probe budget covers the
        extra cost (its catch-up unspread: a probe that finds nothing has no later steps to spread
        it over)."""
        due = []
        for i, (s, o) in enumerate(zip(seqs, options)):
            state = s.state
            state.probing = False
            if out[i] == 0 and len(o) > 1 and s.weight > 0:  # (a probe of a sequence worth 0 tells nothing of use)
                state.steps_at_zero += 1
                if state.steps_at_zero >= (state.probe_every or self.probe_every):
                    due.append(i)
            else:
                state.steps_at_zero = 0
        self.since_probe += 1
        paced_ok = self.since_probe >= self.probe_gap
        if self.probe_share is not None and self.costs.known:
            self._accrue(self._step_cost(seqs, out, full_values, tree))
            # a probe's catch-up (a draft model's: at most its probe window), built on steps with probes due
            probes = [s if s.probe_catch_up is None else dataclasses.replace(s, catch_up=s.probe_catch_up)
                      for s in seqs] if due else seqs
            dear = [i for i in due if probes[i].catch_up > 1 + self.max_k]  # a context to catch up on first
            if paced_ok and dear:  # those longest waiting first, as many as the budget covers
                probing = [options[i][-1] if i in due and i not in dear else b for i, b in enumerate(out)]
                base = self._step_cost(probes, probing, full_values, tree, spread=False)
                covered, spent = [], 0.0
                for i in sorted(dear, key=lambda i: -seqs[i].state.steps_at_zero):
                    probing[i] = options[i][-1]
                    extra = self._step_cost(probes, probing, full_values, tree, spread=False) - base
                    # a probe dearer than the most the budget banks goes once the bank is full:
                    # else an estimate too high (one outlier timed) would never be re-measured
                    if extra > self.probe_budget and (covered or self.probe_budget < self._bank_cap):
                        break
                    covered.append(i)
                    spent = extra
                self.probe_budget -= spent
                due = [i for i in due if i not in dear] + covered
                paced_ok = bool(due)
        probed = due if paced_ok else []
        for i in probed:
            seqs[i].state.steps_at_zero, seqs[i].state.probing = 0, True
            out[i] = options[i][-1]
        if probed:
            self.since_probe, self._round_open = 0, True

    def skip(self, seqs: list[PlanInput]) -> None:
        """A step decoded without consulting the planner (a batch at disable_by_batch_size): the probe
        budget accrues its share of the step as of a planned one, so the probes that restart drafting
        once the batch shrinks are not held back by a stretch that banked nothing."""
        if self.probe_share is None or not self.costs.known or not seqs:
            return
        self._accrue(self._step_cost(seqs, [0] * len(seqs), [0.0] * len(seqs), tree=False))

    def _accrue(self, step_s: float) -> None:
        """The probe budget gains probe_share of a step's estimated seconds (no more than
        max_probe_gap steps' worth banked)."""
        self._bank_cap = self.probe_share * step_s * self.max_probe_gap
        self.probe_budget = min(self.probe_budget + self.probe_share * step_s, self._bank_cap)

    def _closed(self, seqs: list[PlanInput], options, values, full_values, tree: bool) -> list[int]:
        """A closed batch ends when its slowest sequences (weight 1) do, so a step brings the end
        nearer by what the least advancing of them advances: its worth is n x (1 + min_i E_i(b_i))
        over them, not the sum of every sequence's tokens (which counted a step's accepted tokens
        of a few as if the batch had gained them all). Drafting pays only where all of them draft.
        The plans weighed: per budget level, the least E_i any of them reaches at it (its largest
        budget up to the level) is the step's gain, and each drafts the least that reaches that gain
        (a likelier sequence needs a shorter draft for it); the sequences ahead draft nothing. The
        best rate wins, no drafts included. A slowest
        sequence the proposer can draft nothing for now (capped to 0: an n-gram lookup with no
        match) leaves the step without drafts."""
        n = len(seqs)
        slow = [i for i, s in enumerate(seqs) if s.weight > 0]
        best, best_rate = [0] * n, -1.0
        for level in sorted({b for o in options for b in o}):
            gain = min((values[i][max(c for c, b in enumerate(options[i]) if b <= level)] for i in slow), default=0.0)
            choice = [0] * n
            for i in slow:  # values[i] rise with the budget
                choice[i] = next(c for c, v in enumerate(values[i]) if v >= gain - 1e-12)
            cost = self._step_cost(seqs, [o[c] for o, c in zip(options, choice)], full_values, tree)
            rate = n * (1.0 + gain) / max(cost, 1e-9)
            if rate > best_rate * (1 + 1e-9):
                best, best_rate = choice, rate
        return best

    def _climb(self, seqs: list[PlanInput], options, values, full_values, tree: bool) -> list[int]:
        """From every sequence at its smallest budget, repeatedly move the one sequence whose next
        budget gives the best step rate, to the top; return the best point of the climb (climbing
        on through worse points, as the proposer's fixed cost is paid once: the first drafts alone
        may not pay where more do). The step cost is _step_cost's, kept as running sums that a move
        updates (a batch of 8 planned in ~0.5 ms, not ~7: on a GPU a whole step takes a few ms)."""
        (v0, v1, v2, v3), (p0, p1, p2, p3) = self.costs.coefficients()
        n = len(seqs)
        catch = [self._charged_catch_up(s, f) for s, f in zip(seqs, full_values)]  # charged when it drafts
        choice = [0] * n
        budget = [o[0] for o in options]
        rows = sum(1 + b for b in budget)
        row_ctx = sum((1 + b) * s.context for b, s in zip(budget, seqs))
        tokens = sum(1 + v[0] for v in values)
        drafting = sum(1 for b in budget if b > 0)
        caught = sum(c for c, b in zip(catch, budget) if b > 0)
        depth = max((self.proposer_depth(b, tree) for b in budget if b > 0), default=0)

        def rate(rows, row_ctx, tokens, drafting, caught, depth) -> float:
            cost = v0 + v1 * (rows > n) + v2 * rows + v3 * row_ctx / 1000.0
            if drafting:
                cost += p0 + p1 * depth + p2 * depth * drafting + p3 * caught / 1000.0
            return tokens / max(cost, 1e-9)

        best, best_rate = list(choice), rate(rows, row_ctx, tokens, drafting, caught, depth)
        while True:
            scored = []
            for i in range(n):
                c = choice[i]
                if c + 1 >= len(options[i]):
                    continue
                old, new = budget[i], options[i][c + 1]
                first = old == 0 and new > 0
                scored.append((rate(rows + new - old, row_ctx + (new - old) * seqs[i].context,
                                    tokens + values[i][c + 1] - values[i][c], drafting + first,
                                    caught + catch[i] * first, max(depth, self.proposer_depth(new, tree))), -i))
            if not scored:
                return best
            r, neg_i = max(scored)
            i = -neg_i
            old, new = budget[i], options[i][choice[i] + 1]
            first = old == 0 and new > 0
            rows += new - old
            row_ctx += (new - old) * seqs[i].context
            tokens += values[i][choice[i] + 1] - values[i][choice[i]]
            drafting += first
            caught += catch[i] * first
            depth = max(depth, self.proposer_depth(new, tree))
            choice[i] += 1
            budget[i] = new
            if r > best_rate * (1 + 1e-9):
                best, best_rate = list(choice), r

    def _step_cost(self, seqs: list[PlanInput], budgets: list[int], full_values, tree: bool,
                   spread: bool = True) -> float:
        """Estimated seconds of a step drafting `budgets`: verification, and the proposer call with
        the catch-up of the sequences drafting. A catch-up past the tokens one drafting step adds
        (1 + max_k) is spread over the steps the sequence has left at its full budget's rate
        (`full_values`: per sequence, its expected accepted tokens there): paid once,
        it serves every later draft of the sequence."""
        rows = sum(1 + b for b in budgets)
        row_context = sum((1 + b) * s.context for b, s in zip(budgets, seqs))
        cost = self.costs.verify_s(len(seqs), rows, row_context)
        drafting = [i for i, b in enumerate(budgets) if b > 0]
        if drafting:
            catch_up = sum(self._charged_catch_up(seqs[i], full_values[i], spread) for i in drafting)
            depth = max(self.proposer_depth(budgets[i], tree) for i in drafting)
            cost += self.costs.propose_s(depth, len(drafting), catch_up)
        return cost

    def _charged_catch_up(self, s: PlanInput, full_value: float, spread: bool = True) -> float:
        """The catch-up tokens a step charges for drafting s: up to the 1 + max_k a drafting step
        adds in full, the excess spread over the steps s has left at its full budget's rate."""
        steady = 1 + self.max_k
        excess = max(0, s.catch_up - steady)
        if spread and s.remaining and excess:
            excess /= max(1.0, s.remaining / (1.0 + full_value))
        return min(s.catch_up, steady) + excess

    def observe(self, state: SeqDraftState, tree: bool, greedy: bool, depth: int, num_accepted: int) -> None:
        """A verified draft of `depth` (its deepest token) with num_accepted tokens accepted."""
        if state.expected_rates is not None and not state.probing and depth > 0:  # a planned draft
            sums = self._calibration.setdefault(("tree" if tree else "chain", greedy), [0.0, 0.0])
            sums[0] = CALIBRATION_DISCOUNT * sums[0] + expected_accepted(state.expected_rates, depth)
            sums[1] = CALIBRATION_DISCOUNT * sums[1] + num_accepted
        state.expected_rates = None
        if num_accepted:  # drafts pay again: probe at the usual interval
            state.probe_every = None
            self.probe_gap, self._round_open = self.probe_gap // 2, False
        elif state.probing:  # back off from a sequence whose probes find nothing, and engine-wide
            state.probe_every = min(2 * (state.probe_every or self.probe_every), self.max_probe_every)
            if self._round_open:  # once per probing step, however many sequences probed in it
                self.probe_gap = min(max(2 * self.probe_gap, state.probe_every), self.max_probe_gap)
                self._round_open = False
        state.probing = False
        if depth <= 0:
            return
        shape = "tree" if tree else "chain"
        own = state.counts.setdefault(shape, DepthCounts())
        self.acceptance.observe(own, shape, greedy, depth, num_accepted)
