"""LLMEngine: continuous batching with speculative decoding.

One `step()`:
  1. reserve KV blocks for the running requests' verification (preempting the youngest when the
     block pool runs out), admit waiting requests while their prompts' blocks are free (a cached
     prefix shared); prefill prompts in chunks within the
     step's prompt-token budget (`max_num_batched_tokens`; prompts cut at fixed places): a long
     prompt takes several steps, interleaved with the running requests' decoding, and samples
     its first token with its last chunk;
  2. for every running sequence whose prefill is done: pick the draft budget that pays
     (rayspec.drafting, zero when none does), ask the proposer for drafts (one batched call),
     verify all of them in one target forward,
     keep the accepted prefix plus one recovered/bonus token, and trim the KV cache.
Requests join and leave between steps. A forward that raises is retried in halves, so an
error one request causes (an out-of-memory on its prompt, a processor that fails) finishes that
request with finish_reason "error" and the others go on.
"""

from __future__ import annotations

import itertools
import json
import logging
import time
from collections import deque
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from rayspec.compiled import default_compile
from rayspec.config import EngineConfig, ProposerContext
from rayspec.device_io import to_device, to_host
from rayspec.drafting import DraftPlanner, MeasuredCosts, ModelledCosts, PlanInput
from rayspec.logits_processing import grammar_draft, needs_processing, process_rows, process_verification_logits
from rayspec.logprobs import TokenLogprob, compute_logprobs, prompt_logprobs_rows
from rayspec.malloc import keep_freed_memory
from rayspec.metrics import SpecDecodeStats
from rayspec.model import CausalLM
from rayspec.proposers import Draft, Proposer, ProposeRequest, build_proposer
from rayspec.rejection import (verify_greedy, verify_sampled, verify_tree_greedy, verify_tree_parents,
                               verify_tree_sampled)
from rayspec.batch_layout import TreeQuery, last_rows, packed_offsets, prefill_groups
from rayspec.runner import ModelRunner
from rayspec.sampling import SamplingParams, logits_to_probs, make_generator
from rayspec.sequence import IncrementalDetokenizer, Sequence, Status
from rayspec.structured import GrammarCompiler
from rayspec.tools import inline_tools, template_messages


logger = logging.getLogger(__name__)


class InvalidRequestError(ValueError):
    """The request cannot be served as asked (too long, bad token ids, duplicate id, ...)."""


class EngineOverloadedError(RuntimeError):
    """The waiting queue is full (EngineConfig.max_num_waiting): the request was not taken; try later."""


class InvalidGrammarError(InvalidRequestError):
    """The request's output constraint cannot be compiled (malformed, past llguidance's limits, or
    slower to compile than rayspec.structured.COMPILE_TIMEOUT_S)."""


@dataclass
class RequestOutput:
    request_id: str
    text: str  # all output text so far
    delta_text: str  # text added by this step
    token_ids: list[int]  # all output tokens so far
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_draft_tokens: int
    num_accepted_tokens: int
    num_steps: int
    # with SamplingParams.logprobs: one entry per token of token_ids (None for a resumed request's earlier ones)
    logprobs: list[TokenLogprob | None] | None = None
    # with SamplingParams.prompt_logprobs: one per prompt token (the first has logprob None)
    prompt_logprobs: list[TokenLogprob] | None = None
    error: str | None = None  # finish_reason "error": what failed (the engine went on with the others)
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache (OpenAI's cached_tokens)
    # what this output adds to the request's previous one: its tokens, and their logprobs (with
    # SamplingParams.logprobs). A server streams these; with `LLMEngine.delta_outputs` they are all
    # an unfinished output holds (text "", token_ids [], logprobs None): no copy of what came before
    delta_token_ids: list[int] = field(default_factory=list)
    delta_logprobs: list[TokenLogprob | None] | None = None
    num_output_tokens: int = -1  # all output tokens so far (-1: len(token_ids))

    def __post_init__(self):
        if self.num_output_tokens < 0:
            self.num_output_tokens = len(self.token_ids)


class LLMEngine:
    def __init__(self, config: EngineConfig, model: CausalLM | None = None, tokenizer=None,
                 proposer: Proposer | None = None, rank_launcher=None):
        """rank_launcher: starts the other ranks when config.tensor_parallel_size > 1
        (rayspec.tp_ranks.RankLauncher; deployments.tensor_parallel has Ray's)."""
        from rayspec import loader
        from rayspec.weights import hub

        self.config = config
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        eos_ids: set[int] = set()
        self.ranks = None  # the other tensor-parallel ranks (a launcher's handle)
        if model is None:
            if config.tensor_parallel_size > 1:
                from rayspec.tp_ranks import start_tensor_parallel

                model, tokenizer, self.ranks = start_tensor_parallel(config, rank_launcher)
            else:
                model, tokenizer = loader.load_model(config.model, device=config.device, dtype=config.dtype)
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
        self.max_model_len = min(config.max_model_len, model.args.max_position_embeddings)
        self.kv_plan = self._kv_plan(model, spec, in_process=getattr(proposer, "in_process", True))
        num_slots, num_blocks = self.kv_plan.num_slots, self.kv_plan.num_blocks
        self.compile = config.compile if config.compile is not None else default_compile(self.device)
        context = ProposerContext(config.model, self.max_model_len, num_slots, self.device, self.dtype, model,
                                  max_num_batched_tokens=config.max_num_batched_tokens, num_blocks=num_blocks,
                                  block_size=config.block_size, enable_prefix_caching=config.enable_prefix_caching,
                                  compile=self.compile)
        self.proposer = proposer if proposer is not None else build_proposer(spec, context)
        # EAGLE heads draft from target hidden states: () the final one, else inputs of those layers
        self.feature_layers = self.proposer.feature_layers
        self._warmed_up = False
        self.compile_timings: dict[str, float] | None = None  # the default's measurement (warm_up)
        self.runner = ModelRunner(model, self.max_model_len, num_slots, slack=self.max_k + 1, num_blocks=num_blocks,
                                  block_size=config.block_size, enable_prefix_caching=config.enable_prefix_caching,
                                  compile=self.compile, paged_attention=config.paged_attention)
        self.tree_topk, self.tree_max_batch = spec.eagle_topk, spec.tree_max_batch
        self.adaptive = spec.adaptive and self.max_k > 0
        costs = ModelledCosts(spec.draft_costs) if spec.draft_costs is not None else MeasuredCosts()
        self.planner = DraftPlanner(self.max_k, costs, topk=spec.eagle_topk, max_depth=spec.num_steps)
        self.disable_by_batch_size = spec.disable_by_batch_size
        self.stats = SpecDecodeStats()
        # unfinished outputs carry only what they add (RequestOutput.delta_*), not copies of the
        # whole output so far: a server that streams sets this (deployments.engine_loop)
        self.delta_outputs = False
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._requests: dict[str, Sequence] = {}
        self._ids = itertools.count()
        self._grammars = GrammarCompiler(tokenizer, model.args.vocab_size, eos_ids)
        self._committing = False  # _decode past the point where sequences take tokens
        self.num_steps = 0
        self.num_preemptions = 0  # sequences sent back to waiting because the KV blocks ran out
        if self.runner.compiled is not None:
            self.warm_up()
        if self.adaptive and not costs.deterministic:
            self._calibrate_costs(costs)

    def _calibrate_costs(self, costs: MeasuredCosts, context: int = 32, repeats: int = 3) -> None:
        """Seed the planner's verification cost fit: a dummy sequence of `context` tokens verifies 1,
        2 and 1 + num_speculative_tokens rows (forward and logits, the median of `repeats` each).
        The engine's own steps refine the fit from then on."""
        seq_id = "__calibrate_costs"
        if self.runner.num_free_slots == 0:
            return
        self.runner.allocate(seq_id)
        try:
            with torch.inference_mode():
                self._target_forward([seq_id], [[0] * context], packed=True)
                for rows in (1, 2, 1 + self.max_k, 1):
                    times = []
                    for _ in range(repeats):
                        self.runner.set_cached_len(seq_id, context)
                        started = time.perf_counter()
                        hidden, _ = self._target_forward([seq_id], [[0] * rows], packed=True, static=True)
                        to_host(self.model.logits(hidden).argmax(-1))
                        times.append(time.perf_counter() - started)
                    costs.observe_verify(1, rows, rows * (context + rows), sorted(times)[repeats // 2])
        finally:
            self.runner.free(seq_id)

    @torch.inference_mode()  # as step(): grad mode is part of what a compiled graph is guarded on
    def warm_up(self) -> list[tuple[int, int]]:
        """With the compiled step: compile (and on CUDA capture) the shapes a step takes most, before
        the first request: every batch bucket up to max_num_seqs at 1 row (decoding) and at the
        verification's rows (1 + num_speculative_tokens, bucketed). Other shapes compile when first
        seen. Where `compile` was left to its default, a decode forward is first timed eager and
        compiled, and the compiled step is kept only if it is the faster here (it measured 3.4x
        faster for SmolLM2's shapes on an H200 and 0.76x for Llama-3.1-8B's). Runs once (the
        engine calls it when built). Returns the (batch, rows) buckets compiled."""
        from rayspec.compiled import bucket

        compiled = self.runner.compiled
        if compiled is None or self._warmed_up:
            return []
        self._warmed_up = True
        if self.config.compile is None:
            eager_s, compiled_s = self._time_decode(False), self._time_decode(True)
            self.compile_timings = {"eager_s": eager_s, "compiled_s": compiled_s}
            if compiled_s >= eager_s:
                logger.info("compiled step off: a decode forward took %.2f ms compiled, %.2f ms eager",
                            compiled_s * 1e3, eager_s * 1e3)
                self.runner.compiled, self.compile = None, False
                proposer_runner = getattr(self.proposer, "runner", None)  # the proposer follows the target
                if proposer_runner is not None:
                    proposer_runner.set_compile(False)
                return []
        if self.runner.paged_attention and not self._paged_attention_agrees():
            self.runner.paged_attention = False
        done = []
        for rows in sorted({1, bucket(1 + self.max_k)}):
            b = 1
            while b <= bucket(self.config.max_num_seqs) and compiled.fits(b, rows):
                ids = [f"__warm_up_{i}" for i in range(min(b, self.runner.num_free_slots))]
                if len(ids) < b:
                    break
                try:
                    for i in ids:
                        self.runner.allocate(i)
                    self._target_forward(ids, [[0] * rows for _ in ids], packed=True, static=True)
                    done.append((b, rows))
                finally:
                    for i in ids:
                        self.runner.free(i)
                b *= 2
        self._sync()
        logger.info("compiled step warmed up for (batch, rows) %s", done)
        return done

    def _paged_attention_agrees(self, context: int = 40, tolerance: float = 0.02) -> bool:
        """Paged attention's self-check (EngineConfig.paged_attention): one decode forward of a dummy
        sequence through the compiled step with attention gathering the keys and reading the pool in
        place; they must agree to `tolerance` of the hidden states' largest magnitude (bfloat16
        kernels differ in their last bits, a wrong mask by far more). Where they do not, paged
        attention is turned off with an error in the log, so a kernel fault costs speed, not
        correctness."""
        seq_id, hiddens = "__paged_check", []
        self.runner.allocate(seq_id)
        try:
            prompt = [(7 * i + 3) % self.runner.model.args.vocab_size for i in range(context)]
            self.runner.forward_hidden([seq_id], [prompt])
            for paged in (False, True):
                self.runner.paged_attention = paged
                self.runner.set_cached_len(seq_id, context)
                hiddens.append(self.runner.forward_hidden([seq_id], [[5]], packed=True, static=True)[0].float())
        finally:
            self.runner.paged_attention = True
            self.runner.free(seq_id)
        gather, paged = hiddens
        diff, scale = (paged - gather).abs().max().item(), gather.abs().max().item()
        if not diff <= tolerance * max(scale, 1e-6):  # (NaN fails too)
            logger.error("paged attention off: its decode forward differs from the gather's by %.4g (hidden "
                         "states up to %.4g); please report this GPU and torch version", diff, scale)
            return False
        logger.info("paged attention on: agrees with the gather to %.3g (hidden states up to %.3g)", diff, scale)
        return True

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _time_decode(self, static: bool, repeats: int = 10) -> float:
        """Seconds per one-token forward of a dummy sequence (the first calls, which compile, untimed)."""
        seq_id = "__time_decode"
        self.runner.allocate(seq_id)
        try:
            for _ in range(2):
                self._target_forward([seq_id], [[0]], packed=True, static=static)
            self._sync()
            started = time.perf_counter()
            for _ in range(repeats):
                self._target_forward([seq_id], [[0]], packed=True, static=static)
            self._sync()
            return (time.perf_counter() - started) / repeats
        finally:
            self.runner.free(seq_id)

    def _kv_plan(self, model: CausalLM, spec, in_process: bool = True):
        """in_process: the proposer (a draft model's cache) shares this process's KV budget; a
        disaggregated one (deployments.remote_proposer) keeps its cache in its own deployment."""
        from rayspec.memory import kv_cache_plan  # the one sizing function (`rayspec plan` reports it too)

        return kv_cache_plan(model.args, self.dtype, self.max_model_len, self.max_k, self.config.max_num_seqs,
                             self.config.kv_cache_memory_gb, spec.method if in_process else "none",
                             self.config.block_size)

    @property
    def num_slots(self) -> int:
        """The most sequences running at once (max_num_seqs); their tokens share num_blocks blocks."""
        return self.runner.num_slots

    @property
    def num_blocks(self) -> int:
        return self.runner.num_blocks

    def kv_cache_usage(self) -> float:
        """The fraction of the target's KV blocks held by sequences, 0..1."""
        return self.runner.kv_cache_usage()

    # ---- requests ----------------------------------------------------------------------
    def encode_chat(self, messages: list[dict], tools: list[dict] | None = None,
                    add_generation_prompt: bool = True) -> list[int]:
        """The chat template's prompt; `tools` (function definitions, rayspec.tools) go to the
        template, or into the system message where the template has no place for them."""
        if self.tokenizer is None or not getattr(self.tokenizer, "chat_template", None):
            raise InvalidRequestError("this model has no chat template")
        if tools or any(m.get("tool_calls") or m.get("role") == "tool" for m in messages):
            template = self.tokenizer.chat_template
            if "tools" in (template if isinstance(template, str) else json.dumps(template)):
                messages = template_messages(messages)  # it renders tools, calls and results (Llama 3.1, Qwen)
            else:  # e.g. SmolLM2's: tools described in the system message, calls written out as JSON
                messages, tools = inline_tools(messages, tools or []), None
        text = self.tokenizer.apply_chat_template(
            messages, tools=[{"type": "function", "function": t} for t in tools] if tools else None,
            add_generation_prompt=add_generation_prompt, tokenize=False)
        return self.tokenizer.encode(text, add_special_tokens=False)

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
        if bound is not None and not resume_output_ids and len(self.waiting) - self.runner.num_free_slots >= bound:
            raise EngineOverloadedError(f"{self.num_running} requests run and {len(self.waiting)} wait for "
                                        f"a KV slot (max_num_waiting {bound})")
        if request_id in self._requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        prompt_ids = self.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not prompt_ids:
            raise InvalidRequestError("the prompt is empty")
        vocab = self.model.args.vocab_size
        if any(not 0 <= t < vocab for t in prompt_ids):
            raise InvalidRequestError(f"prompt token ids must be in [0, {vocab})")
        if params.logit_bias and any(not 0 <= t < vocab for t in params.logit_bias):
            raise InvalidRequestError(f"logit_bias token ids must be in [0, {vocab})")
        if any(not 0 <= t < vocab for t in params.stop_token_ids):
            raise InvalidRequestError(f"stop_token_ids must be in [0, {vocab})")
        room = self.max_model_len - len(prompt_ids)
        if room < 1:
            raise InvalidRequestError(
                f"the prompt has {len(prompt_ids)} tokens; this model serves at most {self.max_model_len} in all")
        max_tokens = params.max_tokens if params.max_tokens is not None else room
        if max_tokens > room:
            raise InvalidRequestError(
                f"prompt ({len(prompt_ids)} tokens) + max_tokens ({max_tokens}) exceeds "
                f"max_model_len ({self.max_model_len})")
        pool = self.runner.num_blocks * self.runner.block_size
        if len(prompt_ids) + max_tokens + self.max_k > pool:
            raise InvalidRequestError(
                f"prompt ({len(prompt_ids)} tokens) + max_tokens ({max_tokens}) + {self.max_k} draft positions "
                f"exceed the whole KV cache ({pool} tokens, kv_cache_memory_gb {self.config.kv_cache_memory_gb:g})")
        detok = (IncrementalDetokenizer(self.tokenizer, prompt_ids, params.skip_special_tokens)
                 if self.tokenizer is not None else None)
        if params.stop and detok is None:
            raise InvalidRequestError("stop strings need a tokenizer")
        gen = None if params.greedy else make_generator(params.seed, self.device)
        seq = Sequence(request_id, prompt_ids, params, max_tokens, self.eos_token_ids, detok, gen)
        if params.structured is not None:
            seq.grammar = grammar if grammar is not None else self.prepare_grammar(params.structured)
        if resume_output_ids:
            if any(not 0 <= t < vocab for t in resume_output_ids):
                raise InvalidRequestError(f"resumed output token ids must be in [0, {vocab})")
            if len(resume_output_ids) >= max_tokens:
                raise InvalidRequestError("the resumed output leaves no token to generate")
            seq.append_tokens(list(resume_output_ids))  # replays the text and the stop conditions
            if seq.finished:
                raise InvalidRequestError("the resumed output already ends the request")
            seq.first_token_time = None
            seq.mark_sent(resume_sent_chars)
            seq.num_reported_tokens = seq.num_output_tokens  # the other engine reported those
            if seq.logprobs is not None:  # those tokens' logprobs were handed out by the other engine
                seq.logprobs.extend([None] * seq.num_output_tokens)
        self._requests[request_id] = seq
        self.waiting.append(seq)
        return request_id

    def prepare_grammar(self, spec):
        """The grammar state a structured request starts from (thread-safe; can take up to ~1 s the
        first time a complex schema is seen, so a server calls it off the engine's thread; refused
        past rayspec.structured.COMPILE_TIMEOUT_S)."""
        try:
            return self._grammars.state(spec)
        except ValueError as err:
            raise InvalidGrammarError(str(err)) from None

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

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def _release(self, seq: Sequence) -> None:
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.runner.free(seq.request_id)
        self.proposer.release(seq.request_id)
        self._requests.pop(seq.request_id, None)

    # ---- the step ----------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        self.num_steps += 1
        decoding = self._reserve([s for s in self.running if s.prefilled])
        self._admit()
        chunks = self._prefill_chunks([s for s in self.running if not s.prefilled])
        touched: list[Sequence] = []
        if chunks:
            touched += self._prefill(chunks)
        if decoding:
            self._guarded(self._decode_batch, decoding, touched)
        for seq in self.running:  # their verified full blocks may serve later prompts (prefix caching)
            self.runner.commit(seq.request_id, seq.token_ids)
        outputs = [self._output(s) for s in touched]
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
        if self.feature_layers is None or not self.runner.prefix_caching:
            return
        requests = []
        for seq in seqs:
            if seq.features and seq.finish_reason not in ("abort", "error"):
                features, start = self._take_features(seq)
                requests.append(ProposeRequest(seq.request_id, seq.token_ids, 0, features=features,
                                               features_start=start))
        if requests:
            try:
                self.proposer.commit_finished(requests)
            except Exception as err:  # noqa: BLE001 - only a later request's cache hit is lost
                logger.warning("caching the head's prefix of %d finished request(s) failed: %r", len(requests), err)

    def _admit(self) -> None:
        """Running sequences take waiting ones while max_num_seqs allows and the KV blocks of the
        prompt (its cached prefix shared) are free, with one block to spare per running sequence:
        admitting one only to preempt it at the next verification would waste its prefill."""
        blocks = self.runner.blocks
        while self.waiting and self.runner.num_free_slots > 0:
            seq = self.waiting[0]
            # prompt logprobs need every prompt row computed: no cached prefix for those
            reuse = seq.params.prompt_logprobs is None or bool(seq.output_token_ids)
            limit = None
            if reuse and self.feature_layers is not None:
                # a cached prefix has no target features: an EAGLE head must hold its own keys for it
                prefix = getattr(self.proposer, "cached_prefix", None)
                limit = prefix(seq.request_id, seq.token_ids) if prefix is not None else None
                reuse = limit is not None
            cached = self.runner.allocate(seq.request_id, seq.token_ids if reuse else None, limit,
                                          seq.params.cache_salt)
            need = blocks.blocks_for(len(seq.token_ids)) - cached // self.runner.block_size
            if need + len(self.running) > self.runner.num_free_blocks:
                self.runner.free(seq.request_id)
                if limit is not None:  # (the head's place, taken by cached_prefix)
                    self.proposer.release(seq.request_id)
                break
            if limit is not None:
                self.proposer.trim_prefix(seq.request_id, cached)  # (the target's prefix may be shorter)
            seq.prefill_start = cached
            seq.features, seq.features_start = [], cached
            self.runner.grow(seq.request_id, len(seq.token_ids))
            self.waiting.popleft()
            if seq.num_cached_tokens is None:  # (a preempted one reports its first admission's)
                seq.num_cached_tokens = cached
            seq.status = Status.RUNNING
            self.running.append(seq)

    def _reserve(self, seqs: list[Sequence]) -> list[Sequence]:
        """KV blocks for this step's verification of every sequence in seqs (its tokens and up to
        max_k drafts), oldest first; when the pool runs out, the youngest running sequence is
        preempted (see _preempt). Returns those of seqs still running."""
        cap = self.runner.capacity
        for seq in seqs:
            if seq.status is not Status.RUNNING:
                continue
            while not self.runner.grow(seq.request_id, min(len(seq.token_ids) + self.max_k, cap)):
                victim = self.running[-1]
                self._preempt(victim)
                if victim is seq:
                    break
        return [s for s in seqs if s.status is Status.RUNNING]

    def _preempt(self, seq: Sequence) -> None:
        """Free a running sequence's KV cache and put it first in line, its tokens kept: admitted
        again, it is prefilled over prompt and output (its verified blocks likely still cached) and
        goes on where it stopped, as a resumed request does."""
        logger.info("KV cache full: request %s preempted (%d tokens), to be recomputed", seq.request_id,
                    len(seq.token_ids))
        self.running.remove(seq)
        self.runner.commit(seq.request_id, seq.token_ids)
        self.runner.free(seq.request_id)
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
        size = self.config.max_num_batched_tokens
        budget, chunks = size, []
        for seq in seqs:
            done = self.runner.cached_len(seq.request_id)
            n = len(seq.token_ids) - done
            if size is not None:
                n = min(n, size - done % size)  # up to the prompt's next cut
                if n > budget:
                    break
                budget -= n
            chunks.append((seq, n))
        return chunks

    def _guarded(self, run, items: list, touched: list[Sequence]) -> None:
        """touched += run(items); when it raises, retry the two halves on their own, down to one
        request, which then fails alone (finish_reason "error"). run must leave no trace when it
        raises, or raise _Applied (the batch is failed whole, nothing can be retried)."""
        try:
            touched += run(items)
            return
        except _Applied as applied:
            if getattr(applied.__cause__, "fatal", False):
                raise applied.__cause__
            err, retry = applied.__cause__, False
        except Exception as exc:  # noqa: BLE001 - one request's failure must not fail the others
            if getattr(exc, "fatal", False):  # the engine itself is broken (a tensor-parallel rank died)
                raise
            err, retry = exc, len(items) > 1
        seqs = [item[0] if isinstance(item, tuple) else item for item in items]
        if retry:
            logger.warning("a forward over %d requests failed (%r); retrying them in halves", len(items), err)
            half = len(items) // 2
            self._guarded(run, items[:half], touched)
            self._guarded(run, items[half:], touched)
            return
        for seq in seqs:
            logger.error("request %s failed: %r", seq.request_id, err, exc_info=err)
            self._fail(seq, err)
            touched.append(seq)

    @staticmethod
    def _fail(seq: Sequence, err: BaseException) -> None:
        seq.error = f"{type(err).__name__}: {err}"
        seq.finish("error", flush=False)

    def _target_forward(self, ids, inputs, trees=None, packed=False, static=False):
        """Target forward returning (hidden [B, Q, H], features [B, Q, F] or None); with
        `packed`, [N, H] and [N, F] over the real tokens only (batch_layout.packed_offsets). static: a
        decode or verification forward (the compiled step's, when it is on)."""
        if self.feature_layers is None:
            return self.runner.forward_hidden(ids, inputs, trees=trees, packed=packed, static=static)[0], None
        if self.feature_layers == ():
            hidden = self.runner.forward_hidden(ids, inputs, trees=trees, packed=packed, static=static)[0]
            return hidden, hidden
        return self.runner.forward_hidden(ids, inputs, trees=trees, packed=packed, static=static,
                                          aux_layers=self.feature_layers)[0]

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
                self._guarded(self._prefill_batch, [batch[i] for i in fits], touched)
        return touched

    def _prefill_batch(self, chunks: list[tuple[Sequence, int]]) -> list[Sequence]:
        seqs = [seq for seq, _ in chunks]
        ids = [s.request_id for s in seqs]
        starts = [self.runner.cached_len(i) for i in ids]
        inputs = [s.token_ids[c: c + n] for (s, n), c in zip(chunks, starts)]
        try:
            hidden, features = self._target_forward(ids, inputs, packed=True)  # [N, H], [N, F]
        except Exception:
            for i, c in zip(ids, starts):  # nothing of this forward stays
                self.runner.set_cached_len(i, c)
            raise
        offsets = packed_offsets([len(x) for x in inputs])
        complete = [i for i, (s, x, c) in enumerate(zip(seqs, inputs, starts)) if c + len(x) == len(s.token_ids)]
        last = self.model.logits(hidden[[offsets[i] + len(inputs[i]) - 1 for i in complete]]) if complete else None
        done: list[Sequence] = []
        for i, (seq, n) in enumerate(chunks):
            try:
                c, rows = starts[i], slice(offsets[i], offsets[i] + n)
                if seq.params.prompt_logprobs is not None and not seq.output_token_ids:  # (a resumed one had them)
                    seq.prompt_logprobs = (seq.prompt_logprobs if c else []) + prompt_logprobs_rows(
                        self.model, self.tokenizer, seq.prompt_token_ids, hidden[rows], c, seq.params.prompt_logprobs)
                if features is not None:
                    if c == seq.prefill_start:
                        seq.features, seq.features_start = [], c
                    seq.features.append(features[rows].clone())
                if i not in complete:
                    continue
                raw = last[complete.index(i)][None]  # [1, vocab]
                logits = raw
                if needs_processing(seq.params):
                    logits = process_rows(raw, seq.params, seq.prompt_token_ids, seq.output_token_ids, [[]],
                                          seq.grammar, seq.eos_token_ids)
                tok = int(logits[0].argmax()) if seq.params.greedy else self._sample(seq, logits[0])
                seq.prefilled = True
                seq.append_tokens([tok])
                self._record_logprobs(seq, raw, [tok])
                done.append(seq)
            except Exception as err:  # noqa: BLE001 - this request's processing failed; the others go on
                logger.error("request %s failed in its prefill: %r", seq.request_id, err, exc_info=err)
                self._fail(seq, err)
                done.append(seq)
        return done

    def _sample(self, seq: Sequence, logits: torch.Tensor) -> int:
        p = seq.params
        probs = logits_to_probs(logits[None], p.temperature, p.top_k, p.top_p)[0]
        return int(torch.multinomial(probs, 1, generator=seq.generator))

    def _draft_len(self, seq: Sequence, k: int) -> int:
        """k, capped by the request's own num_speculative_tokens and the tokens it has left."""
        if seq.params.num_speculative_tokens is not None:
            k = min(k, seq.params.num_speculative_tokens)
        return max(0, min(k, seq.remaining_tokens - 1))

    def _draft_lens(self, seqs: list[Sequence], tree: bool) -> list[int]:
        """Per sequence, the draft budget of this step: the full one, or with `adaptive` what pays
        (rayspec.drafting). A seeded sampled request's budget depends on its own history alone
        (its random stream is consumed per drafted token): the full budget under measured costs,
        planned as if alone under modelled ones."""
        caps = [self._draft_len(s, self.max_k) for s in seqs]
        if not self.adaptive:
            return caps
        modelled = self.planner.costs.deterministic
        seeded = [s.params.seed is not None and not s.params.greedy for s in seqs]
        return self.planner.plan([PlanInput(s.drafting, s.params.greedy, len(s.token_ids), cap,
                                            pinned=own and not modelled, isolated=own and modelled)
                                  for s, cap, own in zip(seqs, caps, seeded)], tree)

    def _decode_batch(self, seqs: list[Sequence]) -> list[Sequence]:
        """_decode, leaving no trace when it raises before a sequence took its tokens (see _guarded):
        the target's cache lengths and the features not yet drafted from go back; a proposer that
        already caught up on those features rewinds when they come again."""
        saved = [(s.features, s.features_start, self.runner.cached_len(s.request_id)) for s in seqs]
        self._committing = False
        try:
            self._decode(seqs)
        except Exception as err:
            if self._committing:
                raise _Applied() from err
            for seq, (features, start, cached) in zip(seqs, saved):
                seq.features, seq.features_start = features, start
                self.runner.set_cached_len(seq.request_id, cached)
            raise
        return seqs

    def _decode(self, seqs: list[Sequence]) -> None:
        step_start = time.perf_counter()
        # small batches verify token trees (of up to max_k nodes), larger ones chains; the planner
        # sizes either per sequence
        use_tree = self.tree_topk > 1 and len(seqs) <= self.tree_max_batch
        if self.max_k == 0 or (self.disable_by_batch_size and len(seqs) >= self.disable_by_batch_size):
            use_tree, draft_lens = False, [0] * len(seqs)
        else:
            draft_lens = self._draft_lens(seqs, use_tree)
        propose_s = 0.0
        if any(draft_lens):
            requests = [ProposeRequest(s.request_id, s.token_ids, n, s.params.temperature,
                                       s.params.top_k, s.params.top_p, s.params.seed,
                                       *self._take_features(s), tree=use_tree)
                        for s, n in zip(seqs, draft_lens)]
            started = time.perf_counter()
            # a draft longer than asked (a remote proposer's reply) is cut: it would take KV blocks
            # and verification rows this step did not budget for
            drafts = [d if len(d.tokens) <= n else _cut(d, n) for d, n in zip(self.proposer.propose(requests), draft_lens)]
            propose_s = time.perf_counter() - started
            self.stats.propose_seconds += propose_s
            lost = [r.seq_id for r, d, n in zip(requests, drafts, draft_lens) if d.resend_features_from is not None and n]
            if lost:  # a remote proposer resends itself (deployments.remote_proposer); here it is a bug
                raise RuntimeError(f"the proposer lost the target features of {lost}")
        else:
            drafts = [Draft([]) for _ in seqs]
        # under a grammar, draft what it forces even where the proposer was not asked (a large
        # batch, see disable_by_batch_size): those tokens are all but sure to be accepted
        drafts = [grammar_draft(s.grammar, d, max(n, self._draft_len(s, self.max_k))) if s.grammar is not None else d
                  for s, d, n in zip(seqs, drafts, draft_lens)]
        ids = [s.request_id for s in seqs]
        # the tokens without target KV yet (normally just the last one), then the drafts
        pending = [s.token_ids[self.runner.cached_len(s.request_id):] for s in seqs]
        inputs = [p + d.tokens for p, d in zip(pending, drafts)]
        # token trees (EAGLE greedy) are verified in the same forward under a tree mask
        trees = None
        if any(not d.is_chain for d in drafts):
            trees = [TreeQuery(verify_tree_parents(len(p), d)) for p, d in zip(pending, drafts)]
        row_context = sum(len(inp) * (self.runner.cached_len(i) + len(inp)) for i, inp in zip(ids, inputs))
        # packed: rows of different lengths cost only their real tokens (no padding computed)
        hidden, features = self._target_forward(ids, inputs, trees, packed=True, static=True)  # [N, H], [N, F]
        raw = self.model.logits(hidden)  # [N, vocab]
        lengths = [len(inp) for inp in inputs]
        starts = packed_offsets(lengths)  # row i's tokens are logits[starts[i]: starts[i] + lengths[i]]
        logits = process_verification_logits(raw, seqs, pending, drafts, starts, lengths)
        offsets = [len(p) - 1 for p in pending]
        flat = None
        if any(s.params.greedy for s in seqs):  # one read: the target's choice at every row
            (flat,) = to_host(logits.argmax(-1))
            flat = flat.tolist()
        self._committing = True  # from here sequences take their tokens: a failure cannot be retried
        verdicts: list[tuple[list[int], list[int]]] = []  # (emitted tokens, kept rows) per sequence
        for i, seq in enumerate(seqs):
            draft, b, n_rows, o = drafts[i], starts[i], lengths[i], offsets[i]
            if not draft.is_chain:
                if seq.params.greedy:
                    emitted, path = verify_tree_greedy(flat[b: b + n_rows], len(pending[i]), draft)
                else:
                    emitted, path = verify_tree_sampled(self._row_probs(seq, logits[b: b + n_rows]),
                                                        len(pending[i]), draft, seq.generator)
                rows = list(range(len(pending[i]))) + [len(pending[i]) + j for j in path]
            else:
                n = len(draft.tokens)  # rows o..o+n: the last pending token, then the drafts
                if seq.params.greedy:
                    emitted = verify_greedy([flat[b + o: b + o + n + 1]], [draft.tokens])[0]
                else:
                    probs = logits_to_probs(logits[b + o: b + o + n + 1], seq.params.temperature,
                                            seq.params.top_k, seq.params.top_p)
                    emitted = verify_sampled(probs, draft.tokens, draft.probs, seq.generator)
                rows = list(range(len(pending[i]) + len(emitted) - 1))
            verdicts.append((emitted, rows))
        if trees is not None:  # the accepted nodes' KV follows each prefix (one copy for the batch)
            self.runner.keep_paths([(s.request_id, rows) for s, (_, rows) in zip(seqs, verdicts)])
        else:
            for s, inp, (_, rows) in zip(seqs, inputs, verdicts):
                self.runner.set_cached_len(s.request_id, self.runner.cached_len(s.request_id) - len(inp) + len(rows))
        if features is not None:  # the kept rows' features, gathered in one index_select
            (index,) = to_device(np.asarray([starts[i] + r for i, (_, rows) in enumerate(verdicts) for r in rows],
                                            dtype=np.int64), device=features.device)
            kept = features.index_select(0, index).split([len(rows) for _, rows in verdicts])
            for seq, part in zip(seqs, kept):
                seq.features.append(part)
        for i, seq in enumerate(seqs):
            draft, (emitted, rows) = drafts[i], verdicts[i]
            num_accepted = len(emitted) - 1
            kept = seq.append_tokens(emitted)
            # emitted token j was predicted by row rows[len(pending) - 1 + j] (chain and tree alike)
            if seq.logprobs is not None:
                predicted_by = rows[len(pending[i]) - 1:][:kept]
                self._record_logprobs(seq, raw[starts[i]: starts[i] + lengths[i]][predicted_by], emitted[:kept])
            seq.num_steps += 1
            seq.num_draft_tokens += len(draft.tokens)
            seq.num_accepted_tokens += num_accepted
            if draft_lens[i] and seq.grammar is None:  # (a grammar's forced tokens say nothing of the proposer)
                self.planner.observe(seq.drafting, use_tree, seq.params.greedy, draft_depth(draft), num_accepted)
            self.stats.observe(len(draft.tokens), num_accepted)
        costs = self.planner.costs
        costs.observe_verify(len(seqs), sum(lengths), row_context, time.perf_counter() - step_start - propose_s)
        if propose_s:
            drafting = [n for n in draft_lens if n]
            costs.observe_propose(max(self.planner.proposer_depth(n, use_tree) for n in drafting), len(drafting),
                                  propose_s)

    def _record_logprobs(self, seq: Sequence, logits: torch.Tensor, tokens: list[int]) -> None:
        """logits: [len(tokens), vocab], the target rows that predicted `tokens`."""
        if seq.logprobs is not None and tokens:
            seq.logprobs += compute_logprobs(logits, tokens, seq.params.logprobs, self.tokenizer)

    @staticmethod
    def _row_probs(seq: Sequence, row_logits: torch.Tensor):
        """row -> the processed target distribution there (computed only for rows a walk visits)."""
        p = seq.params
        return lambda r: logits_to_probs(row_logits[r][None], p.temperature, p.top_k, p.top_p)[0]

    @staticmethod
    def _take_features(seq: Sequence) -> tuple[torch.Tensor | None, int]:
        if not seq.features:
            return None, seq.features_start
        feats = torch.cat(seq.features) if len(seq.features) > 1 else seq.features[0]
        start = seq.features_start
        seq.features, seq.features_start = [], start + len(feats)
        return feats, start

    def _output(self, seq: Sequence) -> RequestOutput:
        delta = seq.take_new_text()  # text keeps back a possible stop-string start, like delta
        n, start = seq.num_output_tokens, seq.num_reported_tokens
        seq.num_reported_tokens = n
        whole = seq.finished or not self.delta_outputs
        return RequestOutput(
            request_id=seq.request_id, text=seq.sent_text if whole else "", delta_text=delta,
            token_ids=seq.output_token_ids if whole else [], finished=seq.finished, finish_reason=seq.finish_reason,
            num_prompt_tokens=seq.num_prompt_tokens, num_draft_tokens=seq.num_draft_tokens,
            num_accepted_tokens=seq.num_accepted_tokens, num_steps=seq.num_steps,
            logprobs=list(seq.logprobs) if seq.logprobs is not None and whole else None,
            prompt_logprobs=seq.prompt_logprobs, error=seq.error, num_cached_tokens=seq.num_cached_tokens or 0,
            delta_token_ids=seq.token_ids[len(seq.token_ids) - (n - start):] if n > start else [],
            delta_logprobs=seq.logprobs[start:n] if seq.logprobs is not None else None, num_output_tokens=n)

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


def _cut(draft: Draft, n: int) -> Draft:
    """The first n tokens of a draft (a tree's first n nodes are a tree: parents come first)."""
    return replace(draft, tokens=draft.tokens[:n], probs=None if draft.probs is None else draft.probs[:n],
                   parents=None if draft.parents is None else draft.parents[:n])


def draft_depth(draft: Draft) -> int:
    """The deepest token of a draft (a chain's length; a tree's longest path)."""
    if draft.is_chain:
        return len(draft.tokens)
    depth: list[int] = []
    for p in draft.parents:
        depth.append(1 if p < 0 else depth[p] + 1)
    return max(depth, default=0)


class _Applied(Exception):
    """A decode failed after some sequences took their tokens: the batch cannot be retried."""


def engine_summary(engine: LLMEngine) -> str:
    kernels = getattr(engine.model, "cpu_kernels", None)
    return json.dumps({"model": engine.config.model, "method": engine.config.speculative.method,
                       "num_slots": engine.num_slots, "device": str(engine.device),
                       "dtype": str(engine.dtype).removeprefix("torch."),
                       "cpu_kernels": kernels.describe() if kernels is not None else None, **engine.stats.as_dict()})
