"""Scheduler: the waiting and running queues, and what each step runs.

`schedule()` decides a step, in this order:
  1. reserve KV blocks for the verification of every running sequence whose prefill is done (its
     tokens and up to max_k drafts), oldest first, preempting the youngest when the pool runs out;
  2. admit waiting sequences while max_num_seqs allows and their prompts' blocks (a cached prefix
     shared) are free;
  3. cut the running sequences' unfinished prompts into this step's prefill chunks, within the
     prompt-token budget (max_num_batched_tokens).
It owns the target's KV books (`kv`, a KVSpace: slots, block tables, cached lengths, prefix
matching): sequences take, grow, commit and give back their blocks here and nowhere else; the
runner only reads them. A proposer's own cache is reached through the Proposer interface
(`cached_prefix`, `trim_prefix`, `release`).
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass

from rayspec.engine.sequence import Sequence, Status
from rayspec.kv.kv_space import KVSpace
from rayspec.proposers.base import Proposer

logger = logging.getLogger(__name__)


@dataclass
class ScheduledStep:
    prefill: list[tuple[Sequence, int]]  # (sequence, prompt tokens to prefill this step), admission order
    decode: list[Sequence]  # sequences to draft for and verify, their KV reserved


class Scheduler:
    def __init__(self, kv: KVSpace, proposer: Proposer, max_k: int, max_num_batched_tokens: int | None):
        """kv: the target pool's books, owned from here on."""
        self.kv, self.proposer = kv, proposer
        self.max_k, self.max_num_batched_tokens = max_k, max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0  # sequences sent back to waiting because the KV blocks ran out
        # schedules so far, and the last one that admitted a new request beside decoding ones (traffic
        # that joins a running batch: its freed slots get taken; see closed_batch)
        self.num_schedules, self._joined_at = 0, None

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def finish(self, seq: Sequence) -> None:
        """A finished or aborted sequence leaves its queue, and its KV (the target's and the
        proposer's) goes back."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.kv.free(seq.request_id)
        self.proposer.release(seq.request_id)

    def commit_verified(self) -> None:
        """The running sequences' verified full blocks may serve later prompts (prefix caching)."""
        for seq in self.running:
            self.kv.commit(seq.request_id, seq.token_ids)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def closed_batch(self, window: int = 128) -> bool:
        """Nothing waits and no new request has joined a decoding batch in the last `window`
        schedules: the running sequences look like one batch that ends with its slowest (an offline
        generate() of many prompts), not open traffic whose finished requests are replaced at once
        (a server's clients). The draft planner then values only the slowest sequences' tokens."""
        return not self.waiting and (self._joined_at is None or self.num_schedules - self._joined_at > window)

    def schedule(self) -> ScheduledStep:
        self.num_schedules += 1
        decode = self._reserve([s for s in self.running if s.prefilled])
        self._admit()
        return ScheduledStep(self._prefill_chunks([s for s in self.running if not s.prefilled]), decode)

    def may_admit(self) -> bool:
        """Whether the next schedule could admit a waiting sequence (False is sure: no slot free, or fewer
        free blocks than the one to spare per running sequence that _admit keeps, which even a prompt
        whose blocks are all cached needs)."""
        return bool(self.waiting) and self.kv.num_free_slots > 0 and self.kv.num_free_blocks >= len(self.running)

    def _admit(self) -> None:
        """Running sequences take waiting ones while max_num_seqs allows and the KV blocks of the
        prompt (its cached prefix shared) are free, with one block to spare per running sequence:
        admitting one only to preempt it at the next verification would waste its prefill."""
        while self.waiting and self.kv.num_free_slots > 0:
            seq = self.waiting[0]
            cached, limit = self._allocate(seq)
            need = self.kv.blocks_for(len(seq.token_ids)) - cached // self.kv.block_size
            if need + len(self.running) > self.kv.num_free_blocks:
                self.kv.free(seq.request_id)
                if limit is not None:  # (the head's place, taken by cached_prefix)
                    self.proposer.release(seq.request_id)
                break
            if limit is not None:
                self.proposer.trim_prefix(seq.request_id, cached)  # (the target's prefix may be shorter)
            seq.prefill_start = cached
            seq.features, seq.features_start = [], cached
            self.kv.grow(seq.request_id, len(seq.token_ids))
            self.waiting.popleft()
            if seq.num_cached_tokens is None:  # (a preempted one reports its first admission's)
                seq.num_cached_tokens = cached
                if any(s.prefilled for s in self.running):  # a new request joins a decoding batch
                    self._joined_at = self.num_schedules
            seq.status = Status.RUNNING
            self.running.append(seq)

    def _allocate(self, seq: Sequence) -> tuple[int, int | None]:
        """A KV slot for seq, its cached prefix shared: (tokens cached, the head's prefix limit or None)."""
        # prompt logprobs need every prompt row computed: no cached prefix for those
        reuse = seq.params.prompt_logprobs is None or bool(seq.output_token_ids)
        limit = None
        if reuse and self.proposer.feature_layers is not None:
            # a cached prefix has no target features: an EAGLE head must hold its own keys for it
            limit = self.proposer.cached_prefix(seq.request_id, seq.token_ids, seq.params.cache_salt)
            reuse = limit is not None
        cached = self.kv.allocate(seq.request_id, seq.token_ids if reuse else None, limit,
                                      seq.params.cache_salt)
        return cached, limit

    def _reserve(self, seqs: list[Sequence]) -> list[Sequence]:
        """KV blocks for this step's verification of every sequence in seqs (its tokens and up to
        max_k drafts), oldest first; when the pool runs out, the youngest running sequence is
        preempted (see preempt). Returns those of seqs still running."""
        cap = self.kv.capacity
        for seq in seqs:
            if seq.status is not Status.RUNNING:
                continue
            while not self.kv.grow(seq.request_id, min(len(seq.token_ids) + self.max_k, cap)):
                victim = self.running[-1]
                self.preempt(victim)
                if victim is seq:
                    break
        return [s for s in seqs if s.status is Status.RUNNING]

    def preempt(self, seq: Sequence) -> None:
        """Free a running sequence's KV cache and put it first in line, its tokens kept: admitted
        again, it is prefilled over prompt and output (its verified blocks likely still cached) and
        goes on where it stopped, as a resumed request does."""
        logger.info("KV cache full: request %s preempted (%d tokens), to be recomputed", seq.request_id,
                    len(seq.token_ids))
        self.running.remove(seq)
        self.kv.commit(seq.request_id, seq.token_ids)
        self.kv.free(seq.request_id)
        self.proposer.release(seq.request_id)
        seq.prefilled, seq.status = False, Status.WAITING
        seq.features, seq.features_start = [], 0
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def _prefill_chunks(self, seqs: list[Sequence]) -> list[tuple[Sequence, int]]:
        """(sequence, tokens to prefill this step), in admission order, at most
        max_num_batched_tokens in all (None: whole prompts).

        A prompt is cut at fixed places, every max_num_batched_tokens tokens from its start, and a
        step takes whole pieces while they fit (the first that does not waits for the next step,
        and the ones behind it too). So where a prompt is cut never depends on what else runs:
        with a speculative method or without, joining an idle engine or a busy one, its KV cache is
        computed from the same pieces, which in bfloat16 is what keeps speculation equal to
        target-only decoding (other cuts compute other roundings). Verification rows are a forward
        of their own, never cut."""
        size = self.max_num_batched_tokens
        budget, chunks = size, []
        for seq in seqs:
            done = self.kv.cached_len(seq.request_id)
            n = len(seq.token_ids) - done
            if size is not None:
                n = min(n, size - done % size)  # up to the prompt's next cut
                if n > budget:
                    break
                budget -= n
            chunks.append((seq, n))
        return chunks
