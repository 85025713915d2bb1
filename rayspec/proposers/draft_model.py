from __future__ import annotations

import itertools

import numpy as np
import torch

from rayspec.device_io import to_device, to_host
from rayspec.model.batch_layout import catch_up_pieces
from rayspec.kv.kv_space import DEFAULT_BLOCK_SIZE, KVSpace, proposer_num_blocks
from rayspec.model.native import CausalLM
from rayspec.model.runner import ModelRunner
from rayspec.proposers.deferred import defer_chains
from rayspec.proposers.base import Draft, PreDraftable, ProposeRequest
from rayspec.sampling.sampler import DraftSources, argmax, draw_rows, probs_of_rows


def common_prefix_len(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


# A probe (ProposeRequest.max_catch_up) catches up on at most this many of the context's last
# tokens: after steps without drafts a draft model would otherwise first prefill everything it
# skipped (the whole prompt, for a sequence never drafted for), and a probe on text no draft
# guesses was mostly that prefill (SmolLM2's 8-layer self-draft, 8 prompts of the unguessable set
# at temperature 1: one probe's propose call 154 ms, 123 ms of it the catch-up, against 30 ms
# steps). 64 tokens keep a paragraph of context for the draft, at a few decode steps' cost.
PROBE_WINDOW = 64


class DraftModelProposer(PreDraftable):
    """A smaller causal LM with the target's tokenizer, on its own KV cache.

    Rollback is implicit: the cached tokens are compared with the sequence the engine sends;
    everything after the common prefix (rejected drafts) is overwritten by the catch-up forward.
    A probe whose catch-up exceeds its max_catch_up restarts the draft's context from the
    sequence's last max_catch_up tokens (at positions from 0: attention under rotary embeddings
    depends on relative positions only), and later drafts continue from there.
    """

    name = "draft_model"
    probe_window = PROBE_WINDOW

    @classmethod
    def create(cls, config, context) -> "DraftModelProposer":
        from rayspec.model.loader import load_model

        model = getattr(context.target, "draft_shard", None)  # split over the target's ranks (rayspec.model.parallel)
        if model is not None and config.draft_quantization is not None:
            raise ValueError("draft_quantization needs the draft whole on one device (draft_tensor_parallel_size 1)")
        if model is None:
            if (config.draft_tensor_parallel_size or 1) > 1:
                raise ValueError("draft_tensor_parallel_size > 1 needs the draft in the target's process group: "
                                 "equal to tensor_parallel_size, topology colocated")
            model, _ = load_model(config.draft_model or context.target_model, device=context.device,
                                  dtype=config.draft_dtype or context.dtype, num_layers=config.draft_num_layers,
                                  quantization=config.draft_quantization, tokenizer=False,
                                  quantized_weights=context.quantized_weights)
        proposer = cls(model, context.max_model_len, context.num_slots, config.num_speculative_tokens,
                       context.num_blocks, context.block_size, context.enable_prefix_caching)
        proposer.runner.max_chunk_tokens = context.max_num_batched_tokens
        proposer.set_compile(context.compile)
        return proposer

    def __init__(self, model: CausalLM, max_model_len: int, num_slots: int, max_draft_tokens: int,
                 target_blocks: int | None = None, block_size: int = DEFAULT_BLOCK_SIZE,
                 enable_prefix_caching: bool = False):
        """target_blocks: the target's pool (the draft's holds as many plus its slack per sequence)."""
        slack = max_draft_tokens + 1
        num_blocks = proposer_num_blocks(target_blocks, num_slots, max_model_len + slack, slack, block_size)
        # the draft's own pool: its books (kv) here, its tensors in the runner
        self.kv = KVSpace(max_model_len, num_slots, slack, num_blocks, block_size, enable_prefix_caching)
        self.runner = ModelRunner(model, self.kv)
        self._fed: dict[str, list[int]] = {}  # tokens whose KV the draft cache holds, per sequence
        # where the draft's context starts in the sequence (> 0 after a windowed probe)
        self._offset: dict[str, int] = {}
        self._sources = DraftSources(self.runner.device, salt=1)  # sampled drafts' draws
        self._last_used: dict[str, int] = {}  # seq id -> call clock (evicts the stalest when slots run out)
        self._clock = itertools.count()
        # asynchronous drafting (rayspec.proposers.pre_draft): keep each draft position's top
        # num_candidates tokens and their draft probabilities, and stop between forwards when asked
        super().__init__()  # (PreDraftable: candidates kept for asynchronous drafting)

    def set_compile(self, on: bool) -> None:
        self.runner.set_compile(on)

    def models(self) -> list[torch.nn.Module]:
        return [self.runner.model]

    def kv_usage(self) -> dict[str, float]:
        return {"num_slots": self.kv.num_slots, "num_free_slots": self.kv.num_free_slots,
                "kv_cache_usage": self.kv.kv_cache_usage()}

    def release(self, seq_id: str) -> None:
        self.kv.free(seq_id)
        self._fed.pop(seq_id, None)
        self._offset.pop(seq_id, None)
        self._sources.release(seq_id)
        self._last_used.pop(seq_id, None)
        self.candidates.pop(seq_id, None)

    def catch_up_tokens(self, seq_id: str, num_tokens: int, window: int | None = None) -> int:
        # what the cache holds (its last draft's tokens too: an upper bound on the kept prefix)
        context = num_tokens - self._offset.get(seq_id, 0)
        need = context - min(len(self._fed.get(seq_id, ())), context - 1)
        return need if window is None else min(need, window)

    def _allocate(self, seq_id: str, batch: set[str], token_ids: list[int], cache_salt: str | None) -> None:
        """A slot for seq_id; when none is free, the sequence seen longest ago outside this batch is
        dropped (a shared proposer deployment: sequences a lost verifier replica left behind). If it
        comes back, it is prefilled again from its tokens. A cached prefix is looked up, and the
        sequence's blocks registered, among its cache_salt's sequences only."""
        if self.kv.num_free_slots == 0:
            stale = min((s for s in self._last_used if s not in batch), key=self._last_used.get, default=None)
            if stale is not None:
                self.release(stale)
        # (verified tokens: a cached prefix may be shared)
        cached = self.kv.allocate(seq_id, token_ids, cache_salt=cache_salt)
        self._fed[seq_id] = list(token_ids[:cached])

    def _restart(self, seq_id: str, offset: int) -> None:
        """Drop the draft's cache of seq_id; its context starts at `offset` from now on."""
        if self.kv.has(seq_id):
            self.kv.free(seq_id)
        self._fed.pop(seq_id, None)
        self._offset[seq_id] = offset

    def _forward_last(self, seq_ids: list[str], pending: list[list[int]]) -> torch.Tensor:
        """The catch-up forward ([B, vocab] last logits), in as few batches as fit the cache
        (ModelRunner.padded_groups) and the chunk budget (catch_up_pieces)."""
        forwards = catch_up_pieces([len(p) for p in pending], self.runner.max_chunk_tokens)
        if len(forwards) == 1 and len(self.runner.padded_groups(seq_ids, [len(p) for p in pending])) == 1:
            return self.runner.forward(seq_ids, pending, last_only=True, static=True)
        out: list[torch.Tensor | None] = [None] * len(seq_ids)
        for pieces in forwards:
            ids = [seq_ids[i] for i, _, _ in pieces]
            toks = [pending[i][lo:hi] for i, lo, hi in pieces]
            for idx in self.runner.padded_groups(ids, [len(t) for t in toks]):
                logits = self.runner.forward([ids[j] for j in idx], [toks[j] for j in idx], last_only=True)
                for row, j in zip(logits, idx):
                    i, _, hi = pieces[j]
                    if hi == len(pending[i]):
                        out[i] = row
        return torch.stack(out)

    @torch.inference_mode()  # (an engine step is; a proposer deployment's call thread is not, by itself)
    def propose(self, requests: list[ProposeRequest]) -> list[Draft]:
        active = [r for r in requests if r.num_tokens > 0]
        if not active:
            return [Draft([]) for _ in requests]
        seq_ids, pending = [], []
        batch = {r.seq_id for r in active}
        tick = next(self._clock)
        for req in active:
            window = req.max_catch_up
            if window is not None and self.catch_up_tokens(req.seq_id, len(req.token_ids)) > window:
                self._restart(req.seq_id, len(req.token_ids) - window)
            token_ids = req.token_ids[self._offset.get(req.seq_id, 0):]  # the draft's context
            if not self.kv.has(req.seq_id):
                self._allocate(req.seq_id, batch, token_ids, req.cache_salt)
            self._last_used[req.seq_id] = tick
            fed = self._fed[req.seq_id]
            keep = min(common_prefix_len(fed, token_ids), len(token_ids) - 1)
            self.kv.set_cached_len(req.seq_id, keep)
            self.kv.commit(req.seq_id, token_ids)  # the engine's tokens are verified ones
            seq_ids.append(req.seq_id)
            pending.append(token_ids[keep:])
            self._fed[req.seq_id] = list(token_ids)
        # drafted tokens stay on the device until the end: one read (rayspec.device_io) per call
        k = max(r.num_tokens for r in active)
        sampled = [i for i, r in enumerate(active) if r.temperature > 0]
        # the sampled rows' indices, sent without a blocking copy (none when all are greedy)
        rows = to_device(np.asarray(sampled, dtype=np.int64), device=self.runner.device)[0] if sampled else None
        settings = [(active[i].temperature, active[i].top_k, active[i].top_p) for i in sampled]
        probs: list[list[torch.Tensor]] = [[] for _ in active]
        toks = []
        logits = self._forward_last(seq_ids, pending)  # [B, vocab]
        if self.num_candidates:
            for req in active:
                self.candidates[req.seq_id] = []
        for step in range(k):
            choice = argmax(logits)  # [B]
            if sampled:  # one batch of kernels for all sampled rows, no host read
                p = probs_of_rows(logits.index_select(0, rows), settings)
                choice.index_copy_(0, rows, draw_rows(p, [
                    self._sources.source(active[i].seq_id, active[i].seed, active[i].stream_seed,
                                         len(active[i].token_ids) + step) for i in sampled]))
                for j, i in enumerate(sampled):
                    probs[i].append(p[j])
            toks.append(choice)
            if self.num_candidates:  # (asynchronous drafting only: reads the top tokens per position)
                self._keep_candidates(active, logits, probs, step)
            if step + 1 < k and self.should_stop is not None and self.should_stop():
                break  # drafts come back shorter; the cache holds exactly what _fed says
            if step + 1 < k:
                logits = self.runner.forward(seq_ids, choice[:, None], last_only=True, static=True)
        drafted = torch.stack(toks, 1)  # [B, k]

        def finish(arrays) -> list[Draft]:
            tokens = arrays[0].tolist()
            for i, req in enumerate(active):
                self._fed[req.seq_id] += tokens[i][: len(toks) - 1]  # the draft cache holds all but the last
            return [Draft(tokens[i][: r.num_tokens], torch.stack(probs[i][: r.num_tokens]) if probs[i] else None)
                    for i, r in enumerate(active)]

        if self.num_candidates == 0 and self.should_stop is None and all(r.defer_read for r in requests):
            # read with the verdict (rayspec.proposers.deferred): _fed grows then, before the next call
            by_id = dict(zip(seq_ids, defer_chains(drafted, [r.num_tokens for r in active], [drafted], finish,
                                                   [torch.stack(p) if p else None for p in probs])))
        else:
            by_id = dict(zip(seq_ids, finish(to_host(drafted))))
        return [by_id.get(r.seq_id, Draft([])) for r in requests]

    def _keep_candidates(self, active: list[ProposeRequest], logits: torch.Tensor,
                         probs: list[list[torch.Tensor]], step: int) -> None:
        """The top tokens of this draft position, by the distribution each row drew from (greedy
        rows: the draft's softmax), for ranking the verdicts to pre-draft for."""
        # logits [B, vocab]
        dist = torch.softmax(logits.float(), -1)
        for i, req in enumerate(active):
            row = probs[i][step] if req.temperature > 0 else dist[i]
            top = row.topk(self.num_candidates)
            self.candidates[req.seq_id].append((top.indices.tolist(), top.values.tolist()))
