"""Asynchronous drafting: draft the next step while the target verifies this one.

(Over 500 lines: PreDrafter's ranking, drafting and speculation cache share one state under one lock.)

After a proposer answers, the verifier spends a whole verification before it calls again, and a
proposer on its own device sits idle meanwhile. PreDrafter fills that time (as speculative
speculative decoding does): for each sequence of the last call it ranks the likeliest verdicts
(how many draft tokens the target accepts, and the bonus token it emits next) by the draft's own
probabilities, drafts the next step for each in turn, and keeps those drafts in a speculation
cache keyed by (sequence, accepted count, bonus token). The next call's token list says which
verdict came true (it is the last context plus the accepted draft tokens plus the bonus token):
a cached draft answers at once (a hit); otherwise the proposer drafts then (a miss), exactly as a
synchronous one would.

Lossless: a pre-draft for a context is made exactly as a call's draft for that context would be
(the same proposer and sampling, its probabilities sent with it), and which one is used depends
on the verifier's verdict alone, never on the pre-drafts' own draws; greedy drafts are the same
tokens either way, and so is a seeded request's output (coupled draws, rayspec.sampling.sampler: the
verifier emits the target's own draw at each position whatever was drafted).

Where it pays: pre-drafting runs beside the verifier's forward, and where the two share what
bounds them (cores, memory bandwidth) it slows the verification; a call that comes while a
hypothesis is still being drafted waits for a forward (or the batch) in flight. So the proposer
measures the whole cycle the verifier sees, reply -> next call -> this reply (the verifier's pace
plus the call), after rounds that pre-drafted and after rounds left idle (every 16th, every paused
one, and every other round until each kind has a few), and pre-drafts only while its cycle is the
shorter (with a probe round every 16th); otherwise it drafts on the call, as a synchronous
proposer. Only regular cycles count (the next call carries the same sequences, each with a verdict
on its last draft): the gap before a new request's first draft spans its prefill and the HTTP
round trip, hundreds of ms that would swamp a few ms of difference; and the cycles compared are
medians of the last few, so no single slow step decides.

Ranking: q_i is the draft's distribution at draft position i (i = 0..k, k: after the last draft
token), d_i the draft tokens, a the per-token acceptance rate measured on the verdicts seen so
far. The verdict "first j tokens accepted, then bonus x" (x != d_j when j < k) is ranked by
a^j (1 - a) q_j(x) / (1 - q_j(d_j)) for j < k and a^k q_k(x) for j = k, over the draft's top
tokens at each position. (The draft's own q_i(d_i) is a poor acceptance estimate: an untrained
truncated draft is confident and wrong, a good one can be flat and right.)

EAGLE heads (proposers offering `paths`): a head drafts from the target's features, and those of
the hypothesised accepted tokens exist only once the target verified them. Each draft's best path
(the chain itself, or a tree's likeliest branch) comes with the head states that predicted its
tokens; verdicts are read along that path, and a hypothesis (j, x) is drafted with the states of
path positions 0..j standing in for the missing features (as the head does inside a tree). A
hit's true features are handed to the head afterwards, off the call's path (`accept_features`;
the next round's first forward catches up on them). The drafts stay exact; only acceptance may
be lower than with true features (stats: accepted tokens after hits and after misses).

Threads: the call handler calls `propose`; a background thread calls `pre_draft` after each
reply. They share the wrapped proposer through one lock, taken per batch of hypotheses; a call
makes the pre-drafter stop between forwards (the proposer's `should_stop` hook). A call whose verdict
is the batch being drafted waits for that batch. A hypothesis batch is started only while a hit on
it, waited for, would still come sooner than drafting on the call (measured times), so where
pre-drafting does not fit (large batches, a slow proposer) drafting falls back to synchronous.
The wrapped proposer is a PreDraftable (rayspec.proposers.base: `num_candidates`, `candidates`,
`should_stop`; draft_model, eagle3, eagle); those drafting from their own states
(`drafts_from_states`: EAGLE) also keep `paths` and take `accept_features`.
"""

from __future__ import annotations

import dataclasses
import statistics
import threading
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from rayspec.proposers.base import Draft, PreDraftable, Proposer, ProposeRequest

Candidates = list[tuple[list[int], list[float]]]  # per draft position: top tokens, their probabilities
Verdict = tuple[int, int]  # (accepted draft tokens, bonus token)


@dataclass
class _Sent:
    """A sequence's last answer: the request (its token_ids: the context) and the draft sent."""
    request: ProposeRequest
    tokens: list[int]  # the path verdicts are read along: the chain sent, or a tree's best branch
    candidates: Candidates  # positions 0..len(tokens); without the last one until a lookahead ran
    states: torch.Tensor | None = None  # EAGLE: [len(candidates), H] head states that predicted them
    hit: bool = False  # answered from the speculation cache


@dataclass
class _PreDraft:
    draft: Draft  # draft_model: one token more than asked (the extra position ranks the next verdicts)
    candidates: Candidates
    rank: int
    token_ids: list[int]  # the hypothesised context it was drafted for
    num_tokens: int  # asked for
    path: list[int]
    states: torch.Tensor | None


@dataclass
class PreDraftStats:
    num_hits: int = 0
    num_misses: int = 0
    hits_by_rank: list[int] = field(default_factory=list)
    num_pre_drafts: int = 0  # hypotheses drafted to the end
    num_interrupted: int = 0  # hypothesis batches a call stopped
    num_skipped: int = 0  # hypothesis batches not started: expected to end after the next call
    num_idle_rounds: int = 0  # rounds left idle to measure the verifier's pace without pre-drafting
    num_paused_rounds: int = 0  # rounds not pre-drafted: it slowed the verifier more than the hits saved
    pre_draft_seconds: float = 0.0
    miss_draft_seconds: float = 0.0  # drafting on calls (misses)
    call_seconds: float = 0.0  # inside propose, all calls
    hit_call_seconds: float = 0.0  # inside propose, calls answered from the cache alone
    num_hit_calls: int = 0
    wait_seconds: float = 0.0  # calls waiting for the proposer (a batch or forward in flight)
    # acceptance of the drafts sent (accepted draft tokens per verdict), by where they came from
    accepted_after_hits: int = 0
    verdicts_after_hits: int = 0
    accepted_after_misses: int = 0
    verdicts_after_misses: int = 0

    @property
    def hit_rate(self) -> float:
        return self.num_hits / max(1, self.num_hits + self.num_misses)

    def as_dict(self) -> dict:
        return {"speculation_cache_hits": self.num_hits, "speculation_cache_misses": self.num_misses,
                "speculation_cache_hit_rate": round(self.hit_rate, 4), "hits_by_rank": list(self.hits_by_rank),
                "pre_drafts": self.num_pre_drafts, "pre_drafts_interrupted": self.num_interrupted,
                "pre_drafts_skipped": self.num_skipped, "idle_rounds": self.num_idle_rounds,
                "paused_rounds": self.num_paused_rounds, "pre_draft_seconds": round(self.pre_draft_seconds, 4),
                "miss_draft_seconds": round(self.miss_draft_seconds, 4),
                "in_proposer_call_seconds": round(self.call_seconds, 4),
                "in_proposer_hit_call_seconds": round(self.hit_call_seconds, 4), "hit_calls": self.num_hit_calls,
                "in_proposer_wait_seconds": round(self.wait_seconds, 4),
                "accepted_per_hit_draft": round(self.accepted_after_hits / max(1, self.verdicts_after_hits), 4),
                "accepted_per_miss_draft": round(self.accepted_after_misses / max(1, self.verdicts_after_misses), 4),
                "verdicts_after_hits": self.verdicts_after_hits, "verdicts_after_misses": self.verdicts_after_misses}


def rank_verdicts(tokens: list[int], candidates: Candidates, limit: int, accept_rate: float) -> list[Verdict]:
    """The `limit` likeliest verdicts of a draft, best first (see the module docstring)."""
    scored = []
    k = len(tokens)
    for j, (top, probs) in enumerate(candidates[: k + 1]):
        reach = accept_rate ** j * ((1 - accept_rate) if j < k else 1.0)  # P(first j accepted, then stop)
        rest = 1.0 - (dict(zip(top, probs)).get(tokens[j], 0.0) if j < k else 0.0)  # mass left for the bonus
        for x, p in zip(top, probs):
            if j < k and x == tokens[j]:
                continue
            scored.append((reach * p / max(rest, 1e-9), j, x))
    scored.sort(key=lambda s: -s[0])
    return [(j, x) for _, j, x in scored[:limit]]


class PreDrafter:
    EMA = 0.2  # weight of the newest time measured
    # a batch that may still run when the next call comes is started while its rank's measured hit
    # rate is at least this (a miss waits for the forward in flight, so a rank that rarely hits
    # costs more than it saves); every PROBE-th round tries it anyway, so a rank that starts to pay
    # is found again (the rounds `_pays` probes on). Batches expected to end before the call run
    # whatever their hit rate.
    MIN_HIT_RATE = 0.1
    PROBE = 16
    PACE_WINDOW = 9  # regular cycles kept per kind (after busy rounds, after idle ones): medians compared
    PACE_MIN = 3  # rounds alternate busy / idle until each kind has this many

    def __init__(self, proposer: Proposer, num_hypotheses: int, max_model_len: int, num_candidates: int = 2,
                 clock=time.perf_counter, budget: bool = True):
        """budget: start a hypothesis batch only when it is expected to end before the next call
        (False: draft every hypothesis; PreDraftingProposer's inline rounds)."""
        if not isinstance(proposer, PreDraftable):
            raise ValueError(f"proposer {proposer.name!r} cannot pre-draft (draft_model can)")
        self.proposer = proposer
        # EAGLE: hypotheses drafted from the head's own states (see the module docstring)
        self.standins = proposer.drafts_from_states
        self.extra = 0 if self.standins else 1  # draft_model drafts one more (ranks the next verdicts)
        self._pending: dict[str, list[ProposeRequest]] = {}  # hits' true features, not yet handed over
        self.num_hypotheses = num_hypotheses
        self.max_model_len = max_model_len
        self.budget = budget
        proposer.num_candidates = num_candidates
        self.stats = PreDraftStats(hits_by_rank=[0] * num_hypotheses)
        self._clock = clock
        self._model_lock = threading.Lock()  # the proposer's state is not thread-safe
        self._lock = threading.Lock()  # the fields below
        self._generation = 0  # bumped by every call: pre-drafts of an older one are stale
        self._batch: list[str] = []  # the last call's sequences: what the next round pre-drafts for
        self._sent: dict[str, _Sent] = {}
        self._cache: dict[str, dict[Verdict, _PreDraft]] = {}
        self._replied_at: float | None = None
        self._interval_s: float | None = None  # reply -> next call, as the verifier paces it
        self._batch_s: dict[int, float] = {}  # one hypothesis batch's drafting time, by batch size
        self._miss_s: dict[int, float] = {}  # drafting on a call, by the number of sequences drafted
        self._round_gen = -1
        self._attempts = [0] * num_hypotheses  # pre-drafted batches per rank, hits: stats.hits_by_rank
        self._rounds = 0
        # does pre-drafting pay here? Pre-drafting runs beside the verifier's forward; where they
        # share what bounds them (cores, memory bandwidth, a device) it slows the verification.
        # The cycle reply -> next call -> its reply (regular steps only) after rounds that
        # pre-drafted and after rounds that did not (every PROBE-th round is left idle to measure it)
        self._busy_cycles: deque[float] = deque(maxlen=self.PACE_WINDOW)
        self._idle_cycles: deque[float] = deque(maxlen=self.PACE_WINDOW)
        self._round_busy = False  # the last round drafted something
        self._accepted, self._tried = 1.0, 2.0  # decayed counts of draft tokens accepted / verified
        self._in_flight: dict[str, Verdict] = {}  # the hypothesis batch being drafted
        self._hold = False  # a call waits for the batch in flight: start no other

    # ---- the call handler's side -----------------------------------------------------------
    def propose(self, requests: list[ProposeRequest]) -> list[Draft]:
        arrival = self._clock()
        with self._lock:
            after_busy = self._round_busy
            verdicts = [self._verdict(r) for r in requests]
            # a cycle counts only from a regular step (the last call's sequences again, each with a
            # verdict), not across a prefill or a batch that changed
            drafting = [(r, v) for r, v in zip(requests, verdicts) if r.num_tokens > 0]
            regular = (self._replied_at is not None and bool(self._batch)
                       and sorted(r.seq_id for r, _ in drafting) == sorted(self._batch)
                       and all(v is not None for _, v in drafting))
            interval = None
            if regular:
                interval = arrival - self._replied_at
                self._interval_s = self._ema(self._interval_s, interval)
            for r, v in zip(requests, verdicts):
                if v is not None:
                    self._observe(v[0], len(self._sent[r.seq_id].tokens))
                self._count_accepted(r)
            # a verdict whose pre-draft is being drafted right now: let that batch end (less than
            # a draft to wait), then stop the round; otherwise stop it at its next forward
            wait = any(v is not None and self._in_flight.get(r.seq_id) == v and self._lookup(r, v) is None
                       for r, v in zip(requests, verdicts))
            self._hold = wait
            if not wait:
                self._generation += 1
        if wait:
            started = self._clock()
            with self._model_lock:
                pass
            self.stats.wait_seconds += self._clock() - started
            with self._lock:
                self._generation += 1
                self._hold = False
        with self._lock:
            drafts: list[Draft | None] = [None] * len(requests)
            misses = []
            for i, (req, verdict) in enumerate(zip(requests, verdicts)):
                hit = self._lookup(req, verdict)
                if hit is not None:
                    drafts[i] = self._answer(req, hit.draft, hit.candidates, hit.path, hit.states, True)
                    self.stats.num_hits += 1
                    self.stats.hits_by_rank[hit.rank] += 1
                    if self.standins and req.features is not None:  # the head catches up on them later
                        self._pending.setdefault(req.seq_id, []).append(req)
                elif req.num_tokens > 0:
                    misses.append(i)
            for req in requests:
                self._cache.pop(req.seq_id, None)
            drafted = [r for r in requests if r.num_tokens > 0]
            self._round_busy = False
        if misses:
            started = self._clock()
            with self._model_lock:
                got_lock = self._clock()
                self._hand_over_pending()
                fresh = self.proposer.propose([requests[i] for i in misses])
                answers = [self._drafted(requests[i].seq_id, d) for i, d in zip(misses, fresh)]
            took = self._clock() - started
            self.stats.wait_seconds += got_lock - started
            self.stats.miss_draft_seconds += took
            self._miss_s[len(misses)] = self._ema(self._miss_s.get(len(misses)), took)
            with self._lock:
                for i, (draft, cands, path, states) in zip(misses, answers):
                    drafts[i] = self._answer(requests[i], draft, cands, path, states, False)
                    self.stats.num_misses += 1
        with self._lock:
            self._batch = [r.seq_id for r in requests if r.num_tokens > 0]
            self._replied_at = self._clock()
            self.stats.call_seconds += self._replied_at - arrival
            if interval is not None and drafted:  # the cycle this round's mode gave the verifier
                cycle = interval + (self._replied_at - arrival)
                (self._busy_cycles if after_busy else self._idle_cycles).append(cycle)
            if not misses and requests:
                self.stats.num_hit_calls += 1
                self.stats.hit_call_seconds += self._replied_at - arrival
        return [d if d is not None else Draft([]) for d in drafts]

    def _drafted(self, seq_id: str, draft: Draft):
        """(draft, candidates, path, states) of the proposer's latest draft for seq_id (model lock held)."""
        if not draft.tokens:
            return draft, [], [], None
        cands = list(self.proposer.candidates.get(seq_id, []))
        if not self.standins:
            return draft, cands, draft.tokens, None
        path, states = self.proposer.paths.get(seq_id, ([], None))
        return draft, cands, list(path), states

    def _hand_over_pending(self) -> None:
        """Give the head the true features of the calls answered from the cache (model lock held)."""
        with self._lock:
            pending, self._pending = self._pending, {}
        for reqs in pending.values():
            for req in reqs:
                self.proposer.accept_features(req)

    def _verdict(self, req: ProposeRequest) -> Verdict | None:
        """The verdict on the last draft sent for req.seq_id that req's token list shows; None when
        it shows none (a new sequence, other settings, or tokens that are no such verdict)."""
        sent = self._sent.get(req.seq_id)
        if sent is None or req.num_tokens <= 0 or not self._same_settings(sent, req):
            return None
        context = sent.request.token_ids
        j = len(req.token_ids) - len(context) - 1
        if not 0 <= j <= len(sent.tokens) or req.token_ids[: len(context) + j] != context + sent.tokens[:j]:
            return None
        return j, req.token_ids[-1]

    @staticmethod
    def _same_settings(sent: _Sent, req: ProposeRequest) -> bool:
        return dataclasses.replace(sent.request, token_ids=req.token_ids, num_tokens=req.num_tokens,
                                   features=req.features, features_start=req.features_start) == req

    def _count_accepted(self, req: ProposeRequest) -> None:
        """Accepted draft tokens of the draft last sent for req.seq_id, by whether it was a hit."""
        sent = self._sent.get(req.seq_id)
        if sent is None or not self._same_settings(sent, req):
            return
        context = sent.request.token_ids
        accepted = len(req.token_ids) - len(context) - 1
        if accepted < 0 or req.token_ids[: len(context)] != context:
            return
        if sent.hit:
            self.stats.accepted_after_hits += accepted
            self.stats.verdicts_after_hits += 1
        else:
            self.stats.accepted_after_misses += accepted
            self.stats.verdicts_after_misses += 1

    def _observe(self, accepted: int, drafted: int) -> None:
        decay = 0.98
        self._accepted = decay * self._accepted + accepted
        self._tried = decay * self._tried + min(accepted + 1, drafted)

    @property
    def accept_rate(self) -> float:
        return min(self._accepted / self._tried, 0.99)

    def _lookup(self, req: ProposeRequest, verdict: Verdict | None) -> _PreDraft | None:
        hit = self._cache.get(req.seq_id, {}).get(verdict) if verdict is not None else None
        ok = hit is not None and hit.num_tokens >= req.num_tokens and hit.token_ids == req.token_ids
        return hit if ok else None

    def _answer(self, req: ProposeRequest, draft: Draft, candidates: Candidates, path: list[int],
                states: torch.Tensor | None, hit: bool) -> Draft:
        n = min(req.num_tokens, len(draft.tokens))
        parents = None if draft.parents is None else draft.parents[:n]
        draft = Draft(draft.tokens[:n], None if draft.probs is None else draft.probs[:n], parents, pre_drafted=hit)
        if draft.parents is None:  # a chain: its path is what is left of it
            path = path[:n]
        # a copy: the engine's token list grows in place
        self._sent[req.seq_id] = _Sent(dataclasses.replace(req, token_ids=list(req.token_ids), features=None),
                                       list(path), candidates[: len(path) + 1],
                                       None if states is None else states[: len(path) + 1], hit)
        return draft

    def release(self, seq_id: str) -> None:
        with self._lock:
            self._generation += 1
            self._sent.pop(seq_id, None)
            self._cache.pop(seq_id, None)
            self._pending.pop(seq_id, None)
        with self._model_lock:
            self.proposer.release(seq_id)

    # ---- the background thread's side ----------------------------------------------------
    def _stale(self) -> bool:
        return self._generation != self._round_gen

    def pre_draft(self) -> None:
        """One round for the last call's sequences: a lookahead forward where the draft sent lacks
        its last position's candidates, then the hypotheses rank by rank, each rank one batch."""
        with self._lock:
            gen, seqs = self._generation, list(self._batch)
            sent = {s: self._sent[s] for s in seqs if s in self._sent}
            replied_at = self._replied_at
        self._round_gen = gen
        if not sent or replied_at is None or not self._pays(len(sent)):
            return
        self._round_busy = True
        lookahead = [s for s, x in sent.items() if len(x.candidates) <= len(x.tokens)
                     and (not self.standins or (x.tokens and x.states is not None and len(x.states) >= len(x.tokens)))]

        def extend(i, draft, cands, path, states):  # the position after the path sent
            x = sent[lookahead[i]]
            if cands:
                x.candidates.append(cands[0])
                if self.standins and states is not None and len(states):
                    x.states = torch.cat([x.states[: len(x.tokens)], states[:1]])

        # a chain of one: the top tokens after the path, none of them in the tree sent
        requests = [dataclasses.replace(sent[s].request, token_ids=sent[s].request.token_ids + sent[s].tokens,
                                        num_tokens=1, features=None, tree=False) for s in lookahead]
        standins = [sent[s].states[: len(sent[s].tokens)] for s in lookahead] if self.standins else None
        if requests and not self._run(requests, standins, gen, extend):
            return
        rate = self.accept_rate
        verdicts = {s: rank_verdicts(x.tokens, x.candidates, self.num_hypotheses, rate) for s, x in sent.items()}
        for rank in range(self.num_hypotheses):
            if self._hold:
                return
            rows = [(s, verdicts[s][rank]) for s in sent if rank < len(verdicts[s])]
            rows = [(s, v) for s, v in rows
                    if len(sent[s].request.token_ids) + v[0] + 1 + sent[s].request.num_tokens <= self.max_model_len
                    and (not self.standins or (sent[s].states is not None and len(sent[s].states) > v[0]))]
            if not rows:
                return
            expected = self._batch_s.get(len(rows))
            ends = None if expected is None or self._interval_s is None else self._clock() - replied_at + expected
            # worth starting while a hit on it, waited for, still comes sooner than a miss's draft
            if self.budget and ends is not None and ends > self._interval_s + self._miss_s.get(len(rows), 0.0):
                self.stats.num_skipped += 1
                return
            # a batch expected to end before the next call uses idle time; one that may still run
            # when it comes only while its rank hits often enough
            if (self.budget and (ends is None or ends > self._interval_s)
                    and self._rounds % self.PROBE != self.PROBE // 2
                    and (self.stats.hits_by_rank[rank] + 1) / (self._attempts[rank] + 2) < self.MIN_HIT_RATE):
                self.stats.num_skipped += 1
                continue
            requests = []
            for s, (j, x) in rows:
                r = sent[s].request
                requests.append(dataclasses.replace(r, token_ids=r.token_ids + sent[s].tokens[:j] + [x],
                                                    num_tokens=r.num_tokens + self.extra, features=None))
            standins = [sent[s].states[: j + 1] for s, (j, _) in rows] if self.standins else None

            def store(i, draft, cands, path, states, rows=rows, rank=rank, requests=requests):
                s, verdict = rows[i]
                if draft.tokens and (self.standins or len(draft.tokens) >= requests[i].num_tokens):
                    self._cache.setdefault(s, {})[verdict] = _PreDraft(
                        draft, cands, rank, requests[i].token_ids, requests[i].num_tokens, path, states)
                    self.stats.num_pre_drafts += 1

            started = self._clock()
            with self._lock:
                self._in_flight = dict(rows)
                self._attempts[rank] += len(rows)
            ran = self._run(requests, standins, gen, store)
            with self._lock:
                self._in_flight = {}
            if not ran:
                return
            self._batch_s[len(rows)] = self._ema(self._batch_s.get(len(rows)), self._clock() - started)

    @property
    def _cycle_busy(self) -> float | None:
        """The verifier's cycle after rounds that pre-drafted (median of the last regular ones)."""
        return statistics.median(self._busy_cycles) if len(self._busy_cycles) >= self.PACE_MIN else None

    @property
    def _cycle_idle(self) -> float | None:
        """... and after rounds left idle."""
        return statistics.median(self._idle_cycles) if len(self._idle_cycles) >= self.PACE_MIN else None

    def _pays(self, batch: int) -> bool:
        """Pre-draft this round? Until both cycles are measured, rounds alternate busy and idle;
        then every PROBE-th round stays idle (measures the cycle without pre-drafting); otherwise
        pre-draft while the cycle after pre-drafting rounds (the verifier's pace plus the call: what
        hits save, what the slowed verifier and the waits for forwards in flight cost, all in one)
        is shorter than after idle ones, and every PROBE-th round anyway (re-measures)."""
        self._rounds += 1
        if not self.budget:
            return True
        if None in (self._cycle_busy, self._cycle_idle):  # calibrating: busy and idle rounds by turns
            if len(self._idle_cycles) < len(self._busy_cycles):
                self.stats.num_idle_rounds += 1
                return False
            return True
        if self._rounds % self.PROBE == 0:
            self.stats.num_idle_rounds += 1
            return False
        if self._rounds % self.PROBE == self.PROBE // 2:
            return True
        if self._cycle_busy < self._cycle_idle:
            return True
        self.stats.num_paused_rounds += 1
        return False

    def _run(self, requests: list[ProposeRequest], standins: list[torch.Tensor] | None, gen: int, store) -> bool:
        """Draft one batch under the model lock; store(i, draft, candidates, path, states) each
        result unless a call came meanwhile. False: stopped (a call came)."""
        started = self._clock()
        with self._model_lock:
            if self._stale() or self._hold:
                return False
            self._hand_over_pending()
            self.proposer.should_stop = self._stale  # only here: a call's own drafting runs to the end
            try:
                if self.standins:
                    drafts = self.proposer.propose(requests, standins=standins)
                else:
                    drafts = self.proposer.propose(requests)
                answers = [self._drafted(r.seq_id, d) for r, d in zip(requests, drafts)]
            finally:
                self.proposer.should_stop = None
        self.stats.pre_draft_seconds += self._clock() - started
        with self._lock:
            if self._generation != gen:
                self.stats.num_interrupted += 1
                return False
            for i, answer in enumerate(answers):
                store(i, *answer)
        return True

    def _ema(self, old: float | None, new: float) -> float:
        return new if old is None else (1 - self.EMA) * old + self.EMA * new


class PreDraftThread:
    """Runs a PreDrafter's rounds in a daemon thread: `kick()` after each reply starts one."""

    def __init__(self, pre_drafter: PreDrafter):
        self.pre_drafter = pre_drafter
        self._wake = threading.Event()
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="pre-draft", daemon=True)
        self._thread.start()

    def kick(self) -> None:
        self._wake.set()

    def _loop(self) -> None:
        while True:
            self._wake.wait()
            self._wake.clear()
            if self._closed:
                return
            self.pre_drafter.pre_draft()

    def close(self) -> None:
        self._closed = True
        self._wake.set()


class PreDraftingProposer(Proposer):
    """A proposer answering through a PreDrafter, in the engine's process: after each answer a
    round runs in a background thread (`background`), overlapping the engine's verification, or
    at once in the caller's thread (every hypothesis drafted, no timing: the hit rates the ranking
    allows, deterministically; for tests and offline measurements)."""

    name = "pre_draft"

    def __init__(self, proposer: Proposer, num_hypotheses: int, max_model_len: int, background: bool = False,
                 num_candidates: int = 2):
        self.inner = proposer
        self.in_process = proposer.in_process
        self.feature_layers = proposer.feature_layers  # EAGLE: the engine hands over the target's features
        self.pre_drafter = PreDrafter(proposer, num_hypotheses, max_model_len, num_candidates, budget=background)
        self._thread = PreDraftThread(self.pre_drafter) if background else None

    def propose(self, requests: list[ProposeRequest]) -> list[Draft]:
        drafts = self.pre_drafter.propose(requests)
        if self._thread is not None:
            self._thread.kick()
        else:
            self.pre_drafter.pre_draft()
        return drafts

    def release(self, seq_id: str) -> None:
        self.pre_drafter.release(seq_id)

    def close(self) -> None:
        if self._thread is not None:
            self._thread.close()

    # the wrapped proposer's model, cache and compile choice are its own
    def set_compile(self, on: bool) -> None:
        self.inner.set_compile(on)

    def models(self) -> list[torch.nn.Module]:
        return self.inner.models()

    def kv_usage(self) -> dict[str, float] | None:
        return self.inner.kv_usage()
