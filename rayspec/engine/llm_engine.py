"""LLMEngine: continuous batching with speculative decoding.

(Over 500 lines: propose/verify/commit use state servers swap in place, engine.proposer and .stats.)

One `step()` is schedule -> run -> postprocess:
  schedule  the Scheduler (rayspec/engine/scheduler.py) reserves the running requests' KV for this
            step's verification (preempting the youngest when the block pool runs out), admits
            waiting requests, and cuts unfinished prompts into the step's prefill chunks;
  run       the chunks are prefilled (a prompt's last chunk samples its first token); the requests
            whose prefill is done decode: propose (pick the draft budget that pays,
            rayspec.engine.drafting, and ask the proposer for drafts in one batched call) -> verify (one
            target forward over every draft, then rayspec.sampling.rejection.verify) -> commit (keep the
            accepted rows' KV and features, append the emitted tokens, record logprobs and stats);
  postprocess  outputs for the requests that took tokens; finished ones are released.
Requests join and leave between steps. A prefill and a decode each run as a transaction
(`_transact`): their forwards and the verdict (prepare) change no sequence and no KV book (rows
are written past each cached length; rayspec.engine.decode_step holds what passes between the phases),
and commit applies them in one place. So a prepare that raises is simply tried again in halves:
an error one request causes (an out-of-memory on its prompt, a processor that fails) finishes that
request with finish_reason "error" and the others go on, with no rollback code.
"""

from __future__ import annotations

import itertools
import logging
import random
import time
from collections import deque

import numpy as np
import torch

from rayspec.config import EngineConfig, ProposerContext, set_torch_threads
from rayspec.device_io import to_device, to_host
from rayspec.engine.decode_step import Prefilled, Proposal, Verdict, cut_draft, draft_depth, features_of
from rayspec.engine.deferred_verify import may_defer, read_verdict, row_lengths, verification_inputs
from rayspec.engine.drafting import DraftPlanner, MeasuredCosts, ModelledCosts, PlanInput
from rayspec.engine.intake import check_request, encode_chat, resume
from rayspec.engine.metrics import SpecDecodeStats
from rayspec.engine.overlap import Overlap
from rayspec.engine.outputs import (EngineOverloadedError, GrammarCompilerBusyError,  # noqa: F401 (re-exported)
                                    InvalidGrammarError, InvalidRequestError, RequestOutput, request_output)
from rayspec.engine.scheduler import ScheduledStep, Scheduler
from rayspec.engine.sequence import IncrementalDetokenizer, Sequence
from rayspec.engine.warm_up import (calibrate_costs, compile_buckets, keep_compiled_step, paged_attention_agrees,
                                    time_decode, verification_rows)
from rayspec.memory.malloc import keep_freed_memory
from rayspec.model.batch_layout import packed_offsets, prefill_groups
from rayspec.model.compiled import bucket, default_compile
from rayspec.kv.kv_space import KVSpace
from rayspec.model.native import CausalLM
from rayspec.model.row_attention import default_batch_invariant
from rayspec.model.runner import ModelRunner
from rayspec.proposers import Draft, Proposer, ProposeRequest, build_proposer
from rayspec.sampling.logits_processing import grammar_draft, needs_processing, process_rows, process_verification_logits
from rayspec.sampling.logprobs import compute_logprobs, prompt_logprobs_rows
from rayspec.sampling.rejection import Verification, coupled, coupled_choices, verify
from rayspec.sampling.sampler import SamplingParams, argmax, choose_rows, coupled_key, make_generator
from rayspec.sampling.structured import GrammarCompiler, GrammarCompilerBusy


logger = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, config: EngineConfig, model: CausalLM | None = None, tokenizer=None,
                 proposer: Proposer | None = None, rank_launcher=None):
        """rank_launcher: starts the other ranks when config.tensor_parallel_size > 1
        (rayspec.model.tp_ranks.RankLauncher; deployments.replicas.tensor_parallel has Ray's)."""
        from rayspec.model import loader
        from rayspec.model.weights import hub

        self.config = config
        set_torch_threads(config.num_threads)
        eos_ids: set[int] = set()
        self.ranks = None  # the other tensor-parallel ranks (a launcher's handle)
        if model is None:
            if config.tensor_parallel_size > 1:
                from rayspec.model.tp_ranks import start_tensor_parallel

                model, tokenizer, self.ranks = start_tensor_parallel(config, rank_launcher)
            else:
                model, tokenizer = loader.load_model(config.model, device=config.device, dtype=config.dtype,
                                                     quantized_weights=config.quantized_weights)
            eos_ids |= hub.generation_eos_ids(config.model)
        self.model, self.tokenizer = model, tokenizer
        if tokenizer is not None and tokenizer.eos_token_id is not None:
            eos_ids.add(tokenizer.eos_token_id)
        self.eos_token_ids = eos_ids
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        if self.device.type == "cpu":
            keep_freed_memory()

        spec = config.speculative
        self.max_k = spec.num_speculative_tokens
        # unseeded sampled requests' stream seeds, a fixed sequence when the engine has a seed
        self._streams = random.Random(config.seed) if config.seed is not None else None
        self.max_model_len = min(config.max_model_len, model.args.max_position_embeddings)
        self.kv_plan = self._kv_plan(model, spec, in_process=proposer is None or proposer.in_process)
        num_slots, num_blocks = self.kv_plan.num_slots, self.kv_plan.num_blocks
        self.compile = config.compile if config.compile is not None else default_compile(self.device)
        context = ProposerContext(config.model, self.max_model_len, num_slots, self.device, self.dtype, model,
                                  max_num_batched_tokens=config.max_num_batched_tokens, num_blocks=num_blocks,
                                  block_size=config.block_size, enable_prefix_caching=config.enable_prefix_caching,
                                  compile=self.compile, quantized_weights=config.quantized_weights)
        self._proposer = proposer if proposer is not None else build_proposer(spec, context)
        # EAGLE heads draft from target hidden states: () the final one, else inputs of those layers
        self.feature_layers = self.proposer.feature_layers
        self._warmed_up = False
        self.compile_timings: dict[str, float] | None = None  # the default's measurement (warm_up)
        # the scheduler owns the target pool's books; the runner holds its tensors and reads them
        self.scheduler = Scheduler(KVSpace(self.max_model_len, num_slots, slack=self.max_k + 1, num_blocks=num_blocks,
                                           block_size=config.block_size,
                                           enable_prefix_caching=config.enable_prefix_caching),
                                   self._proposer, self.max_k, config.max_num_batched_tokens)
        self.runner = ModelRunner(model, self.kv, compile=self.compile, paged_attention=config.paged_attention,
                                  batch_invariant=default_batch_invariant(config, model, self.device),
                                  max_compiled_rows=verification_rows(config.max_num_seqs, self.max_k))
        self.runner.min_verify_rows = bucket(1 + self.max_k)  # the rows compile_buckets warms (warm_up.py)
        self.tree_topk, self.tree_max_batch = spec.eagle_topk, spec.tree_max_batch
        self.adaptive = spec.adaptive and self.max_k > 0
        costs = ModelledCosts(spec.draft_costs) if spec.draft_costs is not None else MeasuredCosts()
        self.planner = DraftPlanner(self.max_k, costs, topk=spec.eagle_topk, max_depth=spec.num_steps,
                                    probe_share=spec.probe_share)
        self.disable_by_batch_size = spec.disable_by_batch_size
        self.stats = SpecDecodeStats()
        # unfinished outputs carry only what they add (RequestOutput.delta_*), not copies of the
        # whole output so far: a server that streams sets this (deployments.replicas.engine_loop)
        self.delta_outputs = False
        self._requests: dict[str, Sequence] = {}
        self._ids = itertools.count()
        self._grammars = GrammarCompiler(tokenizer, model.args.vocab_size, eos_ids)
        self.num_steps = 0
        self.overlap = Overlap(self)
        if self.runner.compiled is not None:
            self.warm_up()
        if self.adaptive and not costs.deterministic:
            calibrate_costs(self, costs)

    @torch.inference_mode()  # as step(): grad mode is part of what a compiled graph is guarded on
    def warm_up(self) -> list[tuple[int, int]]:
        """With the compiled step: compile the shapes a step takes most before the first request
        (rayspec.engine.warm_up; other shapes compile when first seen), where `compile` was left to its
        default only if the compiled step is the faster here. Runs once (the engine calls it when
        built). Returns the (batch, rows) buckets compiled."""
        if self.runner.compiled is None or self._warmed_up:
            return []
        self._warmed_up = True
        if self.config.compile is None and not keep_compiled_step(self):
            return []
        if self.runner.paged_attention and not paged_attention_agrees(self.runner):
            self.runner.paged_attention = False
        done = compile_buckets(self)
        logger.info("compiled step warmed up for (batch, rows) %s", done)
        return done

    def _time_decode(self, static: bool, repeats: int = 10) -> float:
        return time_decode(self, static, repeats)

    def _kv_plan(self, model: CausalLM, spec, in_process: bool = True):
        """in_process: the proposer (a draft model's cache) shares this process's KV budget; a
        disaggregated one (deployments.transport.remote_proposer) keeps its cache in its own deployment."""
        from rayspec.memory.plan import draft_kv_fraction, kv_cache_plan  # the one sizing (`rayspec plan` reports it too)

        return kv_cache_plan(model.args, self.dtype, self.max_model_len, self.max_k, self.config.max_num_seqs,
                             self.config.kv_cache_memory_gb, spec.method if in_process else "none",
                             self.config.block_size,
                             draft_kv_fraction(spec, self.config.model, model.args, self.dtype, device=self.device))

    @property
    def kv(self) -> KVSpace:
        """The target pool's books (the scheduler's)."""
        return self.scheduler.kv

    @property
    def num_slots(self) -> int:
        """The most sequences running at once (max_num_seqs); their tokens share num_blocks blocks."""
        return self.kv.num_slots

    @property
    def num_blocks(self) -> int:
        return self.kv.num_blocks

    def kv_cache_usage(self) -> float:
        """The fraction of the target's KV blocks held by sequences, 0..1."""
        return self.kv.kv_cache_usage()

    # ---- requests ----------------------------------------------------------------------
    def encode_chat(self, messages: list[dict], tools: list[dict] | None = None,
                    add_generation_prompt: bool = True) -> list[int]:
        """The chat template's prompt (rayspec.engine.intake.encode_chat)."""
        return encode_chat(self.tokenizer, messages, tools, add_generation_prompt)

    def encode(self, prompt: str) -> list[int]:
        if self.tokenizer is None:
            raise InvalidRequestError("this engine has no tokenizer; send token ids")
        return self.tokenizer.encode(prompt)

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, resume_output_ids: list[int] | None = None,
                    resume_sent_chars: int = 0, grammar=None) -> str:
        """Queue a request. `resume_output_ids` continues a generation another engine started (a
        replica that died): those output tokens are taken as already generated (prefilled with the
        prompt, counted against max_tokens and stop conditions), and the first `resume_sent_chars`
        characters of their text are not handed out again. `grammar`: the request's grammar state from
        `prepare_grammar` (built elsewhere beforehand), else it is built here from params.structured."""
        params = params or SamplingParams()
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        bound = self.config.max_num_waiting
        # those already waiting take the free slots first; past them, this one would wait too
        if bound is not None and not resume_output_ids and len(self.waiting) - self.kv.num_free_slots >= bound:
            raise EngineOverloadedError(f"{self.num_running} requests run and {len(self.waiting)} wait for "
                                        f"a KV slot (max_num_waiting {bound})")
        if request_id in self._requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        prompt_ids = self.encode(prompt) if isinstance(prompt, str) else list(prompt)
        max_tokens = check_request(prompt_ids, params, self.model.args.vocab_size, self.max_model_len,
                                   self.kv.num_blocks * self.kv.block_size, self.max_k,
                                   self.config.kv_cache_memory_gb)
        detok = (IncrementalDetokenizer(self.tokenizer, prompt_ids, params.skip_special_tokens)
                 if self.tokenizer is not None else None)
        if params.stop and detok is None:
            raise InvalidRequestError("stop strings need a tokenizer")
        stream_seed, gen = None, None
        if not params.greedy and not coupled(params):  # coupled draws need no stream
            stream_seed = self._streams.getrandbits(63) if self._streams is not None else None
            gen = make_generator(stream_seed, self.device)
        seq = Sequence(request_id, prompt_ids, params, max_tokens, self.eos_token_ids, detok, gen)
        seq.stream_seed = stream_seed
        if params.structured is not None:
            seq.grammar = grammar if grammar is not None else self.prepare_grammar(params.structured)
        if resume_output_ids:
            resume(seq, resume_output_ids, resume_sent_chars, self.model.args.vocab_size, max_tokens)
        self._requests[request_id] = seq
        self.scheduler.add(seq)
        return request_id

    def prepare_grammar(self, spec):
        """The grammar state a structured request starts from (thread-safe; can take up to ~1 s the
        first time a complex schema is seen, so a server calls it off the engine's thread; refused
        past rayspec.sampling.structured.COMPILE_TIMEOUT_S)."""
        try:
            return self._grammars.state(spec)
        except ValueError as err:
            raise InvalidGrammarError(str(err)) from None
        except GrammarCompilerBusy as err:  # (a 429: try again once the running compiles are done)
            raise GrammarCompilerBusyError(str(err)) from None

    def abort_request(self, request_id: str) -> bool:
        seq = self._requests.get(request_id)
        if seq is None:
            return False
        seq.finish("abort", flush=False)
        self._release(seq)
        return True

    def shutdown(self) -> None:
        """Release the other tensor-parallel ranks (no-op at TP=1)."""
        tp = getattr(self.model, "tp", None)
        if tp is not None and tp.size > 1:
            tp.stop()
        if self.ranks is not None:
            self.ranks.shutdown()
            self.ranks = None

    @property
    def proposer(self) -> Proposer:
        return self._proposer

    @proposer.setter
    def proposer(self, proposer: Proposer) -> None:
        """(a proposer wrapped after the engine was built, e.g. in pre-drafting: the scheduler follows)"""
        self._proposer = self.scheduler.proposer = proposer

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    @property
    def waiting(self):
        return self.scheduler.waiting

    @property
    def running(self) -> list[Sequence]:
        return self.scheduler.running

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_preemptions(self) -> int:
        """Sequences sent back to waiting because the KV blocks ran out."""
        return self.scheduler.num_preemptions

    def _release(self, seq: Sequence) -> None:
        self.scheduler.finish(seq)
        self._requests.pop(seq.request_id, None)

    # ---- the step ----------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        """One step: schedule (scheduler.py), run its prefill chunks and decode, postprocess."""
        self.num_steps += 1
        if self.overlap.in_flight is not None:  # a decode step queued ahead of its read (rayspec.engine.overlap)
            return self._postprocess(self.overlap.advance())
        scheduled = self.scheduler.schedule()
        if self.overlap.launch_first(scheduled):
            return []  # its tokens come with the next step's
        return self._postprocess(self._run(scheduled))

    def _run(self, scheduled: ScheduledStep) -> list[Sequence]:
        """The step's forwards; returns the sequences that took tokens (or failed)."""
        touched: list[Sequence] = []
        if scheduled.prefill:
            touched += self._prefill(scheduled.prefill)
        if scheduled.decode:
            touched += self._transact(self._decode_prepare, self._decode_commit, scheduled.decode)
        return touched

    def _postprocess(self, touched: list[Sequence]) -> list[RequestOutput]:
        self.scheduler.commit_verified()
        outputs = [request_output(s, whole=s.finished or not self.delta_outputs) for s in touched]
        self._commit_finished_features([s for s in touched if s.finished])
        for seq in touched:
            if seq.finished:
                self._release(seq)
        return outputs

    def _commit_finished_features(self, seqs: list[Sequence]) -> None:
        """Finishing sequences hand the proposer the target features it was not sent (all of the
        prompt's where a request ends at its prefill, max_tokens 1): an EAGLE head caches those
        positions, so the next prompt sharing the prefix reuses it in the target too (its cached
        prefix is cut to the head's)."""
        if self.feature_layers is None or not self.kv.prefix_caching:
            return
        requests = []
        for seq in seqs:
            if seq.features and seq.finish_reason not in ("abort", "error"):
                features, start = features_of(seq)
                requests.append(ProposeRequest(seq.request_id, seq.token_ids, 0, features=features,
                                               features_start=start, cache_salt=seq.params.cache_salt))
        if requests:
            try:
                self.proposer.commit_finished(requests)
            except Exception as err:  # noqa: BLE001 - only a later request's cache hit is lost
                logger.warning("caching the head's prefix of %d finished request(s) failed: %r", len(requests), err)

    def _transact(self, prepare, commit, items: list) -> list[Sequence]:
        """Run a batch as a transaction; returns the sequences commit touched, and those failed.

        prepare(batch) (forwards, drafts, the verdict) changes no sequence and no KV book, so when it
        raises the batch is tried again in halves, down to one request, which then fails alone
        (finish_reason "error"): an error one request causes (an out-of-memory on its prompt, a
        processor that fails) fails only that request. commit(batch, prepared) applies the result and
        returns the sequences it touched; when it raises, the batch's sequences fail (some may have
        taken tokens: nothing is retried). An error marked `fatal` (the engine itself is broken: a
        tensor-parallel rank died) is raised. items: sequences, or (sequence, n) prefill chunks."""
        touched: list[Sequence] = []
        work = deque([items])
        while work:
            batch = work.popleft()
            try:
                prepared = prepare(batch)
            except Exception as err:  # noqa: BLE001 - one request's failure must not fail the others
                if getattr(err, "fatal", False):
                    raise
                if len(batch) > 1:
                    logger.warning("a forward over %d requests failed (%r); retrying them in halves", len(batch), err)
                    half = len(batch) // 2
                    work.extendleft([batch[half:], batch[:half]])  # the first half next, then the second
                else:
                    touched += self._fail_all(batch, err)
                continue
            try:
                touched += commit(batch, prepared)
            except Exception as err:  # noqa: BLE001 - as above, but past the commit point: no retry
                if getattr(err, "fatal", False):
                    raise
                touched += self._fail_all(batch, err)
        return touched

    def _fail_all(self, items: list, err: BaseException) -> list[Sequence]:
        seqs = [item[0] if isinstance(item, tuple) else item for item in items]
        for seq in seqs:
            if not seq.finished:
                self._fail(seq, err)
        return seqs

    @staticmethod
    def _fail(seq: Sequence, err: BaseException, where: str = "") -> None:
        logger.error("request %s failed%s: %r", seq.request_id, where, err, exc_info=err)
        seq.error = f"{type(err).__name__}: {err}"
        seq.finish("error", flush=False)

    def _target_forward(self, ids, inputs, trees=None, packed=False, static=False, advance=True, lengths=None):
        """Target forward returning (hidden [B, Q, H], features [B, Q, F] or None); with
        `packed`, [N, H] and [N, F] over the real tokens only (batch_layout.packed_offsets). static: a
        decode or verification forward (the compiled step's, when it is on). advance: the rows count
        as cached at once (else the caller's commit says what stays; ModelRunner.forward_hidden)."""
        kwargs = dict(trees=trees, packed=packed, static=static, advance=advance, lengths=lengths)
        if self.feature_layers is None:
            return self.runner.forward_hidden(ids, inputs, **kwargs)[0], None
        if self.feature_layers == ():
            hidden = self.runner.forward_hidden(ids, inputs, **kwargs)[0]
            return hidden, hidden
        return self.runner.forward_hidden(ids, inputs, aux_layers=self.feature_layers, **kwargs)[0]

    def _prefill(self, chunks: list[tuple[Sequence, int]]) -> list[Sequence]:
        """Prefill the chunks; returns the sequences that finished their prefill (their first token
        sampled) or failed."""
        # measured on CPU: a 1-token forward costs what prefilling ~13-26 more prompt tokens costs;
        # on a GPU padding is nearly free, so nearly everything goes in one batch
        overhead = 24 if self.device.type == "cpu" else 1024
        # attention sees rows padded to the longest: keep rows x longest within the budget too
        cap = self.config.max_num_batched_tokens
        touched: list[Sequence] = []
        for group in prefill_groups([n for _, n in chunks], overhead, max_padded_tokens=cap):
            batch = [chunks[i] for i in group]
            ids = [seq.request_id for seq, _ in batch]
            for fits in self.runner.padded_groups(ids, [n for _, n in batch]):  # padding must fit each cache row
                touched += self._transact(self._prefill_forward, self._prefill_commit, [batch[i] for i in fits])
        return touched

    def _prefill_forward(self, chunks: list[tuple[Sequence, int]]) -> Prefilled:
        """The chunks' target forward (their rows written, no cached length moved) and the logits of
        every prompt that ends in this step."""
        seqs = [seq for seq, _ in chunks]
        ids = [s.request_id for s in seqs]
        starts = [self.kv.cached_len(i) for i in ids]
        inputs = [s.token_ids[c: c + n] for (s, n), c in zip(chunks, starts)]
        hidden, features = self._target_forward(ids, inputs, packed=True, advance=False)  # [N, H], [N, F]
        offsets = packed_offsets([len(x) for x in inputs])
        complete = [i for i, (s, x, c) in enumerate(zip(seqs, inputs, starts)) if c + len(x) == len(s.token_ids)]
        ends = np.asarray([offsets[i] + len(inputs[i]) - 1 for i in complete], dtype=np.int64)  # prompts' last rows
        last = self.model.logits(hidden.index_select(0, to_device(ends, device=hidden.device)[0])) if complete else None
        return Prefilled(starts, offsets, hidden, features, complete, last)

    def _prefill_commit(self, chunks: list[tuple[Sequence, int]], done: Prefilled) -> list[Sequence]:
        """The chunks' rows count as cached; a finished prompt samples its first token. Returns the
        sequences that finished their prefill or failed."""
        touched, finishing = [], []
        for i, (seq, n) in enumerate(chunks):
            self.kv.extend(seq.request_id, done.starts[i] + n)
            try:
                c, rows = done.starts[i], slice(done.offsets[i], done.offsets[i] + n)
                if seq.params.prompt_logprobs is not None and not seq.output_token_ids:  # (a resumed one had them)
                    seq.prompt_logprobs = (seq.prompt_logprobs if c else []) + prompt_logprobs_rows(
                        self.model, self.tokenizer, seq.prompt_token_ids, done.hidden[rows], c,
                        seq.params.prompt_logprobs)
                if done.features is not None:
                    if c == seq.prefill_start:
                        seq.features, seq.features_start = [], c
                    seq.features.append(done.features[rows].clone())
                if i in done.complete:  # its last row's processed logits; the token after the loop
                    raw = done.last[done.complete.index(i)][None]
                    finishing.append((seq, raw, process_rows(raw, seq.params, seq.prompt_token_ids,
                                                             seq.output_token_ids, [[]], seq.grammar, seq.eos_token_ids)
                                      if needs_processing(seq.params) else raw))
            except Exception as err:  # noqa: BLE001 - this request's processing failed; the others go on
                self._fail(seq, err, " in its prefill")
                touched.append(seq)
        return touched + self._first_tokens(finishing)

    def _first_tokens(self, finishing: list[tuple[Sequence, torch.Tensor, torch.Tensor]]) -> list[Sequence]:
        """The token after each finished prefill, (sequence, its raw [1, vocab] last-row logits, those
        processed): greedy ones the argmax, sampled ones their coupled draw at this position when
        seeded, else from their own streams; read in one read for the lot."""
        if not finishing:
            return []
        params = [seq.params for seq, _, _ in finishing]
        sources = [coupled_key(p.seed, len(seq.token_ids)) if coupled(p) else seq.generator
                   for (seq, _, _), p in zip(finishing, params)]
        (tokens,) = to_host(choose_rows(torch.cat([rows for _, _, rows in finishing]), params, sources))
        for (seq, raw, _), tok in zip(finishing, tokens.tolist()):
            try:
                seq.prefilled = True
                seq.append_tokens([tok])
                self._record_logprobs(seq, raw, [tok])
            except Exception as err:  # noqa: BLE001 - as in _prefill_commit
                self._fail(seq, err, " in its prefill")
        return [seq for seq, _, _ in finishing]

    # ---- the decode step: propose -> verify -> commit ---------------------------------------
    def _decode_prepare(self, seqs: list[Sequence]) -> tuple[Proposal, Verdict, float]:
        """propose -> verify: drafts and the verdict on them, no sequence or KV book changed (the
        verification's rows are written past each cached length, which only commit moves; a
        proposer that caught up on features it is sent again rewinds)."""
        started = time.perf_counter()
        proposal = self._propose(seqs)
        return proposal, self._verify(proposal), started

    def _decode_commit(self, seqs: list[Sequence], prepared: tuple[Proposal, Verdict, float]) -> list[Sequence]:
        proposal, verdict, started = prepared
        self._commit(proposal, verdict)
        self._observe_costs(proposal, verdict, time.perf_counter() - started)
        return seqs

    # ---- propose --------------------------------------------------------------------------
    def _propose(self, seqs: list[Sequence]) -> Proposal:
        tree, draft_lens = self._plan_drafts(seqs)
        catch_up = sum(self.proposer.catch_up_tokens(s.request_id, len(s.token_ids), self._max_catch_up(s))
                       for s, n in zip(seqs, draft_lens) if n)
        drafts, propose_s, features_sent = self._ask_proposer(seqs, draft_lens, tree)
        # under a grammar, draft what it forces even where the proposer was not asked (a large
        # batch, see disable_by_batch_size): those tokens are all but sure to be accepted
        drafts = [grammar_draft(s.grammar, d, max(n, self._draft_len(s, self.max_k))) if s.grammar is not None else d
                  for s, d, n in zip(seqs, drafts, draft_lens)]
        # the tokens without target KV yet (normally just the last one), verified before the drafts
        pending = [s.token_ids[self.kv.cached_len(s.request_id):] for s in seqs]
        return Proposal(seqs, drafts, draft_lens, tree, pending, propose_s, catch_up, features_sent)

    def _plan_drafts(self, seqs: list[Sequence]) -> tuple[bool, list[int]]:
        """(trees or chains, each sequence's draft budget): small batches verify token trees (of up
        to max_k nodes), larger ones chains, the largest (disable_by_batch_size) nothing; the
        planner sizes either per sequence."""
        if self.max_k == 0:
            return False, [0] * len(seqs)
        if self.disable_by_batch_size and len(seqs) >= self.disable_by_batch_size:
            if self.adaptive:  # the probe budget accrues over the stretch (rayspec.engine.drafting)
                self.planner.skip([PlanInput(s.drafting, s.params.greedy, len(s.token_ids), 0) for s in seqs])
            return False, [0] * len(seqs)
        tree = self.tree_topk > 1 and len(seqs) <= self.tree_max_batch
        return tree, self._draft_lens(seqs, tree)

    def _ask_proposer(self, seqs: list[Sequence], draft_lens: list[int], tree: bool
                      ) -> tuple[list[Draft], float, list[int] | None]:
        """One batched proposer call: (a draft per sequence, seconds it took, feature rows sent)."""
        if not any(draft_lens):
            return [Draft([]) for _ in seqs], 0.0, None
        defer = may_defer(self, seqs)
        requests = [ProposeRequest(s.request_id, s.token_ids, n, s.params.temperature, s.params.top_k,
                                   s.params.top_p, s.params.seed, *features_of(s), tree=tree,
                                   cache_salt=s.params.cache_salt, stream_seed=s.stream_seed,
                                   max_catch_up=self._max_catch_up(s), defer_read=defer)
                    for s, n in zip(seqs, draft_lens)]
        started = time.perf_counter()
        # a draft longer than asked (a remote proposer's reply) is cut: it would take KV blocks
        # and verification rows this step did not budget for
        drafts = [d if len(d.tokens) <= n else cut_draft(d, n) for d, n in zip(self.proposer.propose(requests), draft_lens)]
        propose_s = time.perf_counter() - started
        self.stats.propose_seconds += propose_s
        lost = [r.seq_id for r, d, n in zip(requests, drafts, draft_lens) if d.resend_features_from is not None and n]
        if lost:  # a remote proposer resends itself (deployments.transport.remote_proposer); here it is a bug
            raise RuntimeError(f"the proposer lost the target features of {lost}")
        return drafts, propose_s, [0 if r.features is None else len(r.features) for r in requests]

    def _max_catch_up(self, seq: Sequence) -> int | None:
        """A probe's catch-up limit (Proposer.probe_window); None for any other draft."""
        return self.proposer.probe_window if seq.drafting.probing else None

    def _draft_len(self, seq: Sequence, k: int) -> int:
        """k, capped by the request's own num_speculative_tokens and the tokens it has left."""
        if seq.params.num_speculative_tokens is not None:
            k = min(k, seq.params.num_speculative_tokens)
        return max(0, min(k, seq.remaining_tokens - 1))

    def _draft_lens(self, seqs: list[Sequence], tree: bool) -> list[int]:
        """Per sequence, the draft budget of this step: the full one, or with `adaptive` what pays
        (rayspec.engine.drafting). Any plan leaves the output as it is, a seeded request's too (its draws
        are coupled to positions, not to a stream the drafts consume: rayspec.sampling.sampler)."""
        caps = [self._draft_len(s, self.max_k) for s in seqs]
        if not self.adaptive:
            return caps
        # what the proposer can draft now (an n-gram lookup's match, else 0), known before the plan
        caps = [self.proposer.draftable(s.request_id, s.token_ids, c) if c else 0 for s, c in zip(seqs, caps)]
        closed = len(seqs) > 1 and self.scheduler.closed_batch()
        weights = self._token_weights(seqs, closed)
        window = self.proposer.probe_window
        catch_ups = [self.proposer.catch_up_tokens(s.request_id, len(s.token_ids)) for s in seqs]
        return self.planner.plan([PlanInput(s.drafting, s.params.greedy, len(s.token_ids), cap, catch_up=c,
                                            probe_catch_up=None if window is None else min(c, window),
                                            remaining=s.remaining_tokens, weight=w)
                                  for s, cap, w, c in zip(seqs, caps, weights, catch_ups)], tree, closed)

    def _token_weights(self, seqs: list[Sequence], closed: bool) -> list[float]:
        """What each sequence's accepted tokens are worth to the planner (PlanInput.weight): 1, but in
        a closed batch (Scheduler.closed_batch), which runs as many steps as its slowest sequences
        need, 0 for a sequence more than one draft ahead of the slowest (the most tokens left): its
        tokens end no step sooner (the planner then values the slowest's least advance:
        DraftPlanner._closed)."""
        if not closed:
            return [1.0] * len(seqs)
        slowest = max(s.remaining_tokens for s in seqs)
        return [1.0 if s.remaining_tokens + self.max_k >= slowest else 0.0 for s in seqs]

    # ---- verify ---------------------------------------------------------------------------
    def _verify(self, proposal: Proposal) -> Verdict:
        """One target forward over every sequence's pending tokens and drafts (token trees under a
        tree mask), then the rejection rule (rayspec.sampling.rejection.verify)."""
        seqs = proposal.seqs
        ids = [s.request_id for s in seqs]
        deferred = any(d.deferred is not None for d in proposal.drafts)
        lengths = row_lengths(proposal)
        inputs, trees = verification_inputs(proposal, self.device)  # (deferred drafts: placed on the device)
        row_context = sum(n * (self.kv.cached_len(i) + n) for i, n in zip(ids, lengths))
        # packed rows (the real tokens), written past each cached length, which only commit moves
        hidden, features = self._target_forward(ids, inputs, trees, packed=True, static=True, advance=False,
                                                lengths=lengths)  # [N, H], [N, F]
        raw = self.model.logits(hidden)  # [N, vocab]
        starts = packed_offsets(lengths)  # row i's tokens are logits[starts[i]: starts[i] + lengths[i]]
        params, pending = [s.params for s in seqs], [len(p) for p in proposal.pending]
        generators = [s.generator for s in seqs]
        # (deferred drafts: nothing to process, may_defer)
        logits = raw if deferred else process_verification_logits(raw, seqs, proposal.pending, proposal.drafts,
                                                                   starts, lengths)
        target_choice = None
        if any(p.greedy or coupled(p) for p in params):  # the target's choice at every row (a coupled draw, seeded)
            target_choice = coupled_choices(logits, argmax(logits), starts, pending, proposal.drafts, params,
                                            [len(s.token_ids) for s in seqs])  # (read in verify)
        if deferred:  # one read: the choices and sampled verdicts with the drafts
            plan = Verification(logits, target_choice, starts, pending, proposal.drafts, params, generators)
            emitted, kept_rows = plan.finish(read_verdict(proposal, plan.tensors))
        else:
            emitted, kept_rows = verify(logits, target_choice, starts, pending, proposal.drafts, params, generators)
        return Verdict(emitted, kept_rows, raw, features, starts, row_context)

    # ---- commit ---------------------------------------------------------------------------
    def _commit(self, proposal: Proposal, verdict: Verdict) -> None:
        """The one place a decode step changes state: the kept rows' KV and features stay, the
        features sent to the proposer leave the sequence, each sequence takes its emitted tokens."""
        self._keep_kv(proposal, verdict)
        for seq, n in zip(proposal.seqs, proposal.features_sent or ()):
            if n:  # (all it held: features_of sends every row)
                seq.features, seq.features_start = [], seq.features_start + n
        self._keep_features(proposal, verdict)
        for i, seq in enumerate(proposal.seqs):
            rows = slice(verdict.starts[i], verdict.starts[i] + len(proposal.pending[i]) + len(proposal.drafts[i].tokens))
            self._take_tokens(seq, proposal.drafts[i], bool(proposal.draft_lens[i]), proposal.tree,
                              len(proposal.pending[i]), verdict.emitted[i], verdict.kept_rows[i], verdict.raw_logits[rows])

    def _keep_kv(self, proposal: Proposal, verdict: Verdict) -> None:
        if proposal.has_tree:  # the accepted nodes' KV follows each prefix (one copy for the batch)
            self.kv.keep_paths([(s.request_id, rows) for s, rows in zip(proposal.seqs, verdict.kept_rows)])
            return
        for s, rows in zip(proposal.seqs, verdict.kept_rows):
            self.kv.set_cached_len(s.request_id, self.kv.cached_len(s.request_id) + len(rows))

    def _keep_features(self, proposal: Proposal, verdict: Verdict) -> None:
        """The kept rows' target features (an EAGLE head's input), gathered in one index_select."""
        features = verdict.features  # [N, F] or None
        if features is None:
            return
        index = [start + r for start, rows in zip(verdict.starts, verdict.kept_rows) for r in rows]
        (index,) = to_device(np.asarray(index, dtype=np.int64), device=features.device)
        kept = features.index_select(0, index).split([len(rows) for rows in verdict.kept_rows])
        for seq, part in zip(proposal.seqs, kept):
            seq.features.append(part)

    def _take_tokens(self, seq: Sequence, draft: Draft, asked: bool, tree: bool, num_pending: int,
                     emitted: list[int], rows: list[int], raw_logits: torch.Tensor) -> None:
        """raw_logits: [rows verified, vocab], the sequence's unprocessed target logits (logprobs).
        asked: the proposer was asked for this draft (its acceptance informs the planner)."""
        num_accepted = len(emitted) - 1
        kept = seq.append_tokens(emitted)
        # emitted token j was predicted by row rows[num_pending - 1 + j] (chain and tree alike)
        if seq.logprobs is not None:
            predicted_by = rows[num_pending - 1:][:kept]
            self._record_logprobs(seq, raw_logits[predicted_by], emitted[:kept])
        seq.num_steps += 1
        seq.num_draft_tokens += len(draft.tokens)
        seq.num_accepted_tokens += num_accepted
        if asked and seq.grammar is None:  # (a grammar's forced tokens say nothing of the proposer)
            self.planner.observe(seq.drafting, tree, seq.params.greedy, draft_depth(draft), num_accepted)
        self.stats.observe(len(draft.tokens), num_accepted)

    def _observe_costs(self, proposal: Proposal, verdict: Verdict, seconds: float) -> None:
        """The step's measured cost, for an adaptive engine's planner fit (MeasuredCosts; modelled ignore it)."""
        if not self.adaptive:
            return
        costs = self.planner.costs
        num_rows = int(verdict.raw_logits.shape[0])
        costs.observe_verify(len(proposal.seqs), num_rows, verdict.row_context, seconds - proposal.propose_s)
        if proposal.propose_s:
            drafting = [n for n in proposal.draft_lens if n]
            depth = max(self.planner.proposer_depth(n, proposal.tree) for n in drafting)
            costs.observe_propose(depth, len(drafting), proposal.propose_s, proposal.catch_up)

    def _record_logprobs(self, seq: Sequence, logits: torch.Tensor, tokens: list[int]) -> None:
        """logits: [len(tokens), vocab], the target rows that predicted `tokens`."""
        if seq.logprobs is not None and tokens:
            seq.logprobs += compute_logprobs(logits, tokens, seq.params.logprobs, self.tokenizer)

    # ---- convenience -------------------------------------------------------------------
    def generate(self, prompts: list[str | list[int]], params: SamplingParams | list[SamplingParams] | None = None
                 ) -> list[RequestOutput]:
        """Run prompts to completion (all admitted at once, batched as slots allow)."""
        params_list = params if isinstance(params, list) else [params] * len(prompts)
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, params_list)]
        final: dict[str, RequestOutput] = {}
        while len(final) < len(ids):
            for out in self.step():
                if out.finished:
                    final[out.request_id] = out
        return [final[i] for i in ids]
