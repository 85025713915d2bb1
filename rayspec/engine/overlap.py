"""Overlap scheduling for decode steps that draft nothing (EngineSettings.overlap_scheduling; issue #50 item 2a).

A decode step whose sequences draft nothing (a target-only engine, a batch at or past
disable_by_batch_size, requests with num_speculative_tokens 0) emits exactly one token per
sequence, so the next step's shape is known before its tokens are: its rows sit one position
further and its input ids are this step's chosen tokens, still on the device. With overlap on, the
engine queues the next step's forward and draws (`choose_rows`) before it reads this step's tokens
(`device_io.start_read`: a copy behind this step only, waited for by an event), then does this
step's host work (the read, appending tokens, stop strings, detokenisation, outputs, prefix-cache
commits) while the device computes the next: SGLang's overlap scheduler and vLLM's async scheduling
do this. One read a step, made after the next step is queued.

Each queued step is a `Queued`; the engine holds at most one (`Overlap.in_flight`). `advance()` (the
engine's step while one is queued) queues the next when the batch may continue as it is, then
resolves the queued one. A batch continues while: the same sequences run (no join: nothing waits
that could be admitted; one that finished or was aborted leaves it), each has tokens left past the queued one, no sequence needs
its tokens on the host before its draw (penalties, logit_bias, min_tokens, a grammar), and the pool
has its next row. Otherwise the queued step is resolved alone and the next step is an ordinary one
(scheduled, drafting as planned). A sequence that finishes at the read of a step (EOS, a stop
string) had its next row queued already: that row's token is dropped and its KV row lies past the
sequence's committed length (freed with it). Outputs therefore come one step later than without
overlap, and the KV books and draws are the ordinary step's: the queued step's row is kept before
the next step is queued (the ordinary step keeps it at its commit), a seeded request draws at the
same position, an unseeded one from its own stream one draw a step, so the output is the one
without overlap, token for token (tests/engine/test_overlap.py). (One difference: the step after a
sequence's finish computes its void row beside the others, a batch one row larger than without
overlap, which rounds their logits differently in the last bits, as a request joining a batch does.)

Not queued: tensor parallelism (the ranks take host inputs), batch-invariant rows (their CPU
attention takes spans from the host), models with sliding-window layers; decode steps that draft.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch

from rayspec.device_io import PendingRead, start_read, to_device
from rayspec.engine.sequence import Sequence
from rayspec.sampling.logits_processing import needs_processing
from rayspec.sampling.rejection import coupled
from rayspec.sampling.sampler import choose_rows, coupled_key

logger = logging.getLogger(__name__)


@dataclass
class Queued:
    """A decode step queued on the device whose tokens the host has not read yet."""

    seqs: list[Sequence]
    tokens: torch.Tensor  # [B] each sequence's next token, on the device
    read: PendingRead  # those tokens on their way to the host
    raw: torch.Tensor  # [B, vocab] the rows' target logits (logprobs)
    features: torch.Tensor | None  # [B, F] the rows' target features (an EAGLE head's input), or None
    kv_kept: bool = False  # its rows count as cached


class Overlap:
    def __init__(self, engine):
        self.engine = engine
        self.in_flight: Queued | None = None
        self.num_queued = 0  # steps queued ahead of their read, since the engine started

    def enabled(self) -> bool:
        e = self.engine
        setting = e.config.overlap_scheduling
        on = setting if setting is not None else e.device.type != "cpu"
        return bool(on) and e.ranks is None and not e.runner.batch_invariant and not e.model.args.sliding_layers

    # ---- the engine's two entries ------------------------------------------------------------
    def launch_first(self, scheduled) -> bool:
        """An ordinary scheduled step that may be queued instead of run: queue it (True; its tokens come
        with the next step's outputs), else False (run it as usual)."""
        seqs = scheduled.decode
        if scheduled.prefill or not self._may_queue(seqs, ahead=0):
            return False
        try:
            self.in_flight = self._launch(seqs, [[s.token_ids[-1]] for s in seqs], ahead=0)
        except Exception as err:  # noqa: BLE001 - the ordinary step runs it (its failures handled there)
            logger.warning("queueing a decode step failed (%r); running it without overlap", err)
            return False
        return True

    def advance(self) -> list[Sequence]:
        """The engine's step while a step is queued: queue the next where the batch goes on as it is,
        then read and apply the queued one. Returns the sequences that took a token."""
        old, self.in_flight = self.in_flight, None
        nxt = None
        # (a sequence that finished at the last read left its void row in `old`: the rest go on)
        live = [b for b, s in enumerate(old.seqs) if not s.finished]
        seqs = [old.seqs[b] for b in live]
        if self._may_queue(seqs, ahead=1) and self._grow(seqs):
            self._keep_kv(old)
            tokens = old.tokens
            if len(live) < len(old.seqs):
                tokens = tokens.index_select(0, to_device(np.asarray(live, dtype=np.int64), device=tokens.device)[0])
            try:
                nxt = self._launch(seqs, tokens[:, None], ahead=1)
            except Exception as err:  # noqa: BLE001 - as in launch_first
                logger.warning("queueing a decode step failed (%r); the next step runs without overlap", err)
        touched = self._resolve(old)
        self.in_flight = nxt
        return touched

    # ---- queueing ------------------------------------------------------------------------------
    def _may_queue(self, seqs: list[Sequence], ahead: int) -> bool:
        """Whether seqs' next decode step may be queued before the host has their last `ahead` tokens."""
        e = self.engine
        if not seqs or not self.enabled() or not self._drafts_nothing(seqs):
            return False
        sched = e.scheduler
        if sched.may_admit():  # a request may join: the scheduler admits it
            return False
        if len(sched.running) != len(seqs) or {id(s) for s in sched.running} != {id(s) for s in seqs}:
            return False
        return all(not s.finished and s.prefilled and s.grammar is None and not needs_processing(s.params)
                   and s.remaining_tokens > ahead and e.kv.cached_len(s.request_id) == len(s.token_ids) - 1
                   for s in seqs)

    def _drafts_nothing(self, seqs: list[Sequence]) -> bool:
        """Whether the engine's plan for this batch is no draft at all, whatever the sequences' tokens."""
        e = self.engine
        if e.max_k == 0 or (e.disable_by_batch_size and len(seqs) >= e.disable_by_batch_size):
            return True
        return all(s.params.num_speculative_tokens == 0 for s in seqs)

    def _grow(self, seqs: list[Sequence]) -> bool:
        """KV blocks for each sequence's next row (the queued token's); False where the pool is out (the
        ordinary step then preempts)."""
        kv = self.engine.kv
        return all(len(s.token_ids) + 1 <= kv.capacity and kv.grow(s.request_id, len(s.token_ids) + 1)
                   for s in seqs)

    def _launch(self, seqs: list[Sequence], inputs, ahead: int) -> Queued:
        """Queue one decode row per sequence (inputs: host ids, or [B, 1] on the device) and its draws."""
        e = self.engine
        e._plan_drafts(seqs)  # (drafts nothing; an adaptive planner counts the skipped step)
        ids = [s.request_id for s in seqs]
        hidden, features = e._target_forward(ids, inputs, packed=True, static=True, advance=False,
                                             lengths=[1] * len(seqs))
        raw = e.model.logits(hidden)  # [B, vocab]
        params = [s.params for s in seqs]
        # the drawn token's position: past the host's tokens and the `ahead` still on their way
        sources = [coupled_key(p.seed, len(s.token_ids) + ahead) if coupled(p) else s.generator
                   for s, p in zip(seqs, params)]
        tokens = choose_rows(raw, params, sources)
        self.num_queued += 1
        return Queued(list(seqs), tokens, start_read(tokens), raw, features)

    # ---- resolving -----------------------------------------------------------------------------
    def _keep_kv(self, q: Queued) -> None:
        """The queued step's rows count as cached (an ordinary step keeps them at its commit)."""
        if q.kv_kept:
            return
        kv = self.engine.kv
        for s in q.seqs:
            if not s.finished:
                kv.set_cached_len(s.request_id, kv.cached_len(s.request_id) + 1)
        q.kv_kept = True

    def _resolve(self, q: Queued) -> list[Sequence]:
        """Read q's tokens and apply them as an ordinary step's commit does."""
        e = self.engine
        (tokens,) = q.read.wait()
        self._keep_kv(q)
        touched = []
        for b, (seq, tok) in enumerate(zip(q.seqs, tokens.tolist())):
            if seq.finished:  # aborted, or finished at the previous step's read: this row is void
                continue
            try:
                kept = seq.append_tokens([tok])
                if q.features is not None:
                    seq.features.append(q.features[b: b + 1])
                if kept and seq.logprobs is not None:
                    e._record_logprobs(seq, q.raw[b: b + 1], [tok])
                seq.num_steps += 1
                e.stats.observe(0, 0)
            except Exception as err:  # noqa: BLE001 - this request's postprocessing failed; the others go on
                e._fail(seq, err, " in a queued step")
            touched.append(seq)
        return touched
