"""The topologies of tests/engine/test_lossless_grid.py (an engine of each column with each proposer, at
the engine level: no Ray), this module's own reading of the grammar the structured column uses, and
the fault injected into each column (not a test module)."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from engine_utils import make_engine
from rayspec.config import EngineConfig, SpeculativeConfig
from rayspec.engine.llm_engine import LLMEngine
from rayspec.sampling.sampler import SamplingParams
from rayspec.sampling.structured import StructuredOutput

VOCAB = 512
MAX_TOKENS = 16
K = 3  # chains; EAGLE-3 trees: up to 5 nodes, 3 siblings a node, 3 levels
PLAIN = dict(temperature=1.0)
CUT = dict(temperature=0.3, top_k=20, top_p=0.9)
DEEP = 6  # the "deep" column's tree depth
COLD = dict(temperature=0.2, top_k=3)  # its other half: the oracle heads' paths accepted deep
PENALTIES = dict(frequency_penalty=0.5, presence_penalty=0.3, repetition_penalty=1.3,
                 logit_bias={5: 2.0, 17: -3.0, 100: 1.5})
GRAMMAR = "[a-z ]{1,24}"
PREEMPT_BLOCKS, PREEMPT_BLOCK_SIZE = 24, 4  # the preempt column's KV pool: 96 tokens for requests of up to 46
STOPS = ["e", "("]  # "(": in the loops the oracle heads draft, so a stop falls inside multi-token steps too


def _proposer_spec(name: str, model_dir, heads) -> dict:
    return {"ngram": dict(method="ngram", prompt_lookup_min=1, prompt_lookup_max=3),
            "draft": dict(method="draft_model", draft_model=str(model_dir), draft_num_layers=1),
            "eagle1-chain": dict(method="eagle", draft_model=str(heads["eagle"])),
            "eagle1-tree": dict(method="eagle", draft_model=str(heads["eagle"]), eagle_topk=2, num_steps=2),
            "eagle3-chain": dict(method="eagle3", draft_model=str(heads["eagle3"])),
            "eagle3-tree": dict(method="eagle3", draft_model=str(heads["eagle3"]), eagle_topk=3, num_steps=3),
            }[name]


def _k(name: str) -> int:
    return 5 if name == "eagle3-tree" else (4 if name == "eagle1-tree" else K)


# ---- the grammar, this module's own reading of it ---------------------------------------------------

def token_strings(tokenizer) -> list[str | None]:
    """Each id's text (None: a special token, which a grammar never allows)."""
    special = set(tokenizer.all_special_ids)
    return [None if i in special else tokenizer.decode([i], clean_up_tokenization_spaces=False)
            for i in range(VOCAB)]


def grammar_allowed(strings: list[str | None], eos_ids, text: str) -> np.ndarray:
    """[V] bool: the tokens [a-z ]{1,24} allows after `text` (EOS once the text is not empty)."""
    allowed = np.array([s is not None and len(s) > 0 and re.fullmatch(r"[a-z ]+", s) is not None
                        and len(text) + len(s) <= 24 for s in strings])
    if text:
        allowed[list(eos_ids)] = True
    return allowed


def grammar_mask(tokenizer, eos_ids):
    """allowed(draw, context) for audit.expected_rows: the grammar's mask after the context's output."""
    strings = token_strings(tokenizer)

    def allowed(d, context):
        return grammar_allowed(strings, eos_ids, tokenizer.decode(list(context[d.prompt_len:]),
                                                                  skip_special_tokens=True))

    return allowed


# ---- the topologies -------------------------------------------------------------------------------

class _Reply:
    def __init__(self, value):
        self.value = value

    def result(self, timeout_s=None):
        return self.value

    def cancel(self):
        pass


class _ServerHandle:
    """The Serve handle a RemoteProposer holds, over a ProposerServer in this process: `pin` answers
    its direct channel's address (the per-step calls then go over the socket); a call through the
    handle itself (the fallback path) is counted, and must not happen here."""

    def __init__(self, server):
        self.server, self.handle_calls = server, 0

    def options(self, **kwargs):
        return self

    def __getattr__(self, name):
        outer = self

        class _Method:
            def remote(self, *args):
                if name == "propose":
                    outer.handle_calls += 1
                    return _Reply(outer.server._propose(*args))
                return _Reply({"feature_layers": outer.server.feature_layers,
                               "pin": lambda: {"channel": outer.server._channel_address()}}[name]())

        return _Method()


SECRET = b"g" * 32


def remote_proposer(model_dir, spec: dict, k: int):
    from deployments.replicas.proposer import ProposerServer
    from deployments.transport.remote_proposer import RemoteProposer
    from serve_utils import tiny_args

    server = ProposerServer(tiny_args(model_dir, speculative={**spec, "num_speculative_tokens": k, "adaptive": False},
                                      engine={"max_model_len": 128, "max_num_seqs": 32, "device": "cpu"}), SECRET)
    return RemoteProposer(_ServerHandle(server), affinity="grid", channel_secret=SECRET, vocab_size=VOCAB), server


def kv_budget_gb(loaded, spec: dict, model_dir, blocks: int, block_size: int) -> float:
    """kv_cache_memory_gb for a pool of `blocks` blocks (the scratch block besides), a draft model's
    own cache paid from it as the engine plans it (as tests/engine/test_paged_kv.py does)."""
    from rayspec.memory.plan import draft_kv_fraction
    from rayspec.model.kv_cache import KVCache

    speculative = SpeculativeConfig(method=spec["method"], num_speculative_tokens=K, adaptive=False,
                                    **{k: v for k, v in spec.items() if k != "method"})
    share = draft_kv_fraction(speculative, str(model_dir), loaded[0].args, torch.float32) \
        if spec["method"] == "draft_model" else 0.0
    per_token = KVCache.bytes_per_token(loaded[0].args, torch.float32) * (1 + share)
    return ((blocks + 1) * block_size + 0.5) * per_token / 2**30


def build_engine(column: str, proposer: str, model_dir, loaded, heads, seed: int, max_num_seqs: int = 32):
    """An engine of the column's topology with the proposer (and what to close after)."""
    spec, k = _proposer_spec(proposer, model_dir, heads), _k(proposer)
    if column == "deep":  # trees 6 levels deep (issue #50: a dynamic tree of depth 6 verified losslessly)
        spec, k = dict(spec, num_steps=DEEP), 12
    # adaptive off (here and in the EngineConfig below): a cell audits the draws of drafts verified (more
    # than a quarter of its requests, and the fault of its topology must show in them), and at these
    # settings the planner on modelled costs (make_engine's default) drafted little or nothing. The
    # planner's budgets under sampling: test_sampling_distribution.py's -costaware case. Prefix caching
    # stays on (make_engine's default) where make_engine builds the engine.
    common = dict(k=k, loaded=loaded, max_model_len=128, max_num_seqs=max_num_seqs, tree_max_batch=max_num_seqs,
                  engine_seed=seed, adaptive=False)
    closing = []
    if column in ("tp2", "bf16", "compiled"):
        config = EngineConfig(model=str(model_dir), device="cpu", max_model_len=128, max_num_seqs=max_num_seqs,
                              kv_cache_memory_gb=0.5, seed=seed, tensor_parallel_size=2 if column == "tp2" else 1,
                              dtype="bfloat16" if column == "bf16" else None, compile=column == "compiled",
                              speculative=SpeculativeConfig(num_speculative_tokens=k, adaptive=False,
                                                            tree_max_batch=max_num_seqs, **spec))
        if column == "tp2":
            from tp_utils import ProcessLauncher

            engine = LLMEngine(config, rank_launcher=ProcessLauncher())
            closing.append(engine.shutdown)
        elif column == "bf16":
            engine = LLMEngine(config)
        else:  # traced with aot_eager: see the module docstring
            from rayspec.model.compiled import CompiledForward

            with pytest.MonkeyPatch.context() as patch:
                patch.setattr(CompiledForward, "backend", "aot_eager")
                engine = LLMEngine(config, model=loaded[0], tokenizer=loaded[1])
    elif column == "remote":
        remote, server = remote_proposer(model_dir, spec, k)
        engine = make_engine(model_dir, "ngram", proposer=remote, **common)  # (k from the method is kept)
        engine.tree_topk = spec.get("eagle_topk", 1)
        closing += [remote.close, lambda: server._channel and server._channel.close()]
    elif column == "preempt":
        budget = kv_budget_gb(loaded, spec, model_dir, PREEMPT_BLOCKS, PREEMPT_BLOCK_SIZE)
        config = EngineConfig(model=str(model_dir), max_model_len=128, max_num_seqs=max_num_seqs,
                              kv_cache_memory_gb=budget, block_size=PREEMPT_BLOCK_SIZE, seed=seed,
                              speculative=SpeculativeConfig(num_speculative_tokens=k, adaptive=False,
                                                            tree_max_batch=max_num_seqs, **spec))
        engine = LLMEngine(config, model=loaded[0], tokenizer=loaded[1])
    elif column == "chunked":
        engine = make_engine(model_dir, max_num_batched_tokens=8, **common, **spec)
    elif column == "prefix":
        engine = make_engine(model_dir, enable_prefix_caching=True, **common, **spec)
    else:
        engine = make_engine(model_dir, **common, **spec)
    if column == "deferred":  # drafts left on the device until the verdict's read (counted)
        engine.config.defer_draft_reads = True
        engine.num_deferred, propose = 0, engine.proposer.propose

        def counted(requests, **kw):
            drafts = propose(requests, **kw)
            engine.num_deferred += sum(d.deferred is not None for d in drafts)
            return drafts

        engine.proposer.propose = counted
    if column == "overlap":  # batches of 17 or more queue their steps (rayspec.engine.overlap); smaller ones draft
        engine.config.overlap_scheduling, engine.disable_by_batch_size = True, 17
    if column == "async":
        from rayspec.proposers.pre_draft import PreDraftingProposer

        engine.proposer = PreDraftingProposer(engine.proposer, 2, max_model_len=128, num_candidates=2)
    return engine, closing


def request_params(column: str, proposer: str, i: int) -> SamplingParams:
    """Request i of a cell: every other one at T = 1 plain, the rest at T = 0.3 cut by top-k and
    top-p (the tiny model repeats itself, what n-gram lookups and the oracle heads need, only when
    nearly greedy)."""
    extra = {"penalties": PENALTIES, "stop": dict(stop=list(STOPS)),
             "structured": dict(structured=StructuredOutput("regex", GRAMMAR))}.get(column, {})
    odd = COLD if column == "deep" else PLAIN
    return SamplingParams(**(odd if i % 2 else CUT), max_tokens=MAX_TOKENS, ignore_eos=column != "structured",
                          **extra)


def run_requests(engine, prompts, params, ids) -> dict:
    """Request id -> its final RequestOutput."""
    for rid, prompt, p in zip(ids, prompts, params):
        engine.add_request(prompt, p, request_id=rid)
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    return done


def run_failover(make, prompts, params, monkeypatch, record, fault=None) -> tuple[dict, dict, dict]:
    """Every request starts on engine A, which is stopped after 6 steps (most requests mid-stream,
    some still waiting); the unfinished ones go on, on a fresh engine B, from the tokens they had
    (resume_output_ids). Returns (outputs by id: A's partial ones and B's final ones, B's resumed
    outputs by id, B id -> A id)."""
    first = make(seed=1)
    record.attach(first, monkeypatch)
    ids = [f"a{i}" for i in range(len(prompts))]
    for rid, prompt, p in zip(ids, prompts, params):
        first.add_request(prompt, p, request_id=rid)
    outputs = {}
    for _ in range(6):
        outputs.update({o.request_id: o.token_ids for o in first.step() if o.finished})
    partial = {rid: list(first._requests[rid].output_token_ids) for rid in ids if rid in first._requests}
    for rid in partial:
        first.abort_request(rid)
    second = make(seed=2)
    record.attach(second, monkeypatch)
    resumed, pairs = {}, {}
    for i, (rid, prompt, p) in enumerate(zip(ids, prompts, params)):
        if rid not in partial:
            continue
        had = partial[rid]
        if had:
            outputs[rid] = had
        sent = fault(had) if fault is not None and had else had
        resumed[f"b{i}"], pairs[f"b{i}"] = had, rid
        second.add_request(prompt, p, request_id=f"b{i}", resume_output_ids=sent or None)
    while second.has_unfinished_requests():
        outputs.update({o.request_id: o.token_ids for o in second.step() if o.finished})
    return outputs, resumed, pairs


# ---- injected faults: each column's own, each caught -----------------------------------------------

class _Perturbed:
    """The compiled step with its output's hidden states off by a relative 1e-3."""

    def __init__(self, compiled):
        self.compiled = compiled

    def __call__(self, *args, **kwargs):
        out = self.compiled(*args, **kwargs)
        return (out[0] * 1.001,) + tuple(out[1:]) if isinstance(out, tuple) else out * 1.001

    def __getattr__(self, name):
        return getattr(self.compiled, name)


def _fault_tp2(engine, monkeypatch):
    """Rank 0's shard of the LM head (half the vocabulary's logits) off by 1%."""
    head = engine.model.lm_head
    forward = head.forward
    monkeypatch.setattr(head, "forward", lambda x: forward(x) * 1.01)


def _fault_preempt(engine, monkeypatch):
    """A recompute after preemption writes the KV of a wrong token at the first output position."""
    forward = engine._target_forward

    def wrong_token(ids, inputs, trees=None, packed=False, static=False, advance=True, lengths=None):
        if trees is None and not static:
            inputs = [list(x) for x in inputs]
            for rid, x in zip(ids, inputs):
                seq, start = engine._requests[rid], engine.kv.cached_len(rid)
                at = seq.num_prompt_tokens - start
                if seq.num_preemptions and 0 <= at < len(x):
                    x[at] = (x[at] + 1) % VOCAB
        return forward(ids, inputs, trees=trees, packed=packed, static=static, advance=advance, lengths=lengths)

    monkeypatch.setattr(engine, "_target_forward", wrong_token)


def _fault_chunked(engine, monkeypatch):
    """Every chunk after a prompt's first at rope positions one too far (its KV rows where they belong)."""
    prefill, host = engine._prefill_forward, engine.runner._eager_host
    inside = []

    def flagged(chunks):
        inside.append(True)
        try:
            return prefill(chunks)
        finally:
            inside.pop()

    def shifted(seq_ids, token_lists, lengths, starts, trees, kv_len):
        t = host(seq_ids, token_lists, lengths, starts, trees, kv_len)
        if inside and trees is None:
            t = dict(t, positions=t["positions"] + torch.tensor([[int(s > 0)] for s in starts],
                                                                device=t["positions"].device))
        return t

    monkeypatch.setattr(engine, "_prefill_forward", flagged)
    monkeypatch.setattr(engine.runner, "_eager_host", shifted)


def _fault_prefix(engine, monkeypatch):
    """A prefix-cache hit served from blocks whose keys and values went stale (noise added to them)."""
    allocate = engine.scheduler._allocate
    gen = torch.Generator().manual_seed(0)

    def stale(seq):
        cached, limit = allocate(seq)
        if cached:
            rows = torch.as_tensor(engine.kv.rows([seq.request_id], cached)[0][:cached])
            for pool in engine.runner.cache.k + engine.runner.cache.v:
                pool[rows] += 0.1 * torch.randn(pool[rows].shape, generator=gen, dtype=pool.dtype)
        return cached, limit

    monkeypatch.setattr(engine.scheduler, "_allocate", stale)


def _fault_compiled(engine, monkeypatch):
    monkeypatch.setattr(engine.runner, "compiled", _Perturbed(engine.runner.compiled))


def _fault_bf16(engine, monkeypatch):
    """A logit error past bfloat16's rounding: +0.5 on the first half of the vocabulary (~15 tau)."""
    logits = engine.model.logits
    shift = torch.zeros(VOCAB)
    shift[: VOCAB // 2] = 0.5
    monkeypatch.setattr(engine.model, "logits", lambda hidden: logits(hidden) + shift)


def _sharpen(drafts):
    for d in drafts:
        if d.probs is not None:
            q = d.probs.double() ** 3
            d.probs = (q / q.sum(-1, keepdim=True)).to(d.probs.dtype)
    return drafts


def _fault_remote(engine, monkeypatch):
    """The proposer's replies carry q**3 (renormalised) for tokens drawn from q."""
    proposer = engine.proposer.handle.server.proposer
    propose = proposer.propose
    monkeypatch.setattr(proposer, "propose", lambda requests, **kw: _sharpen(propose(requests, **kw)))


def _fault_async(engine, monkeypatch):
    """Drafts handed over with q from the wrong context: each token's row is the next position's."""
    inner = engine.proposer.inner
    propose = inner.propose

    def shifted(requests, **kw):
        drafts = propose(requests, **kw)
        for d in drafts:
            if d.probs is not None and len(d.tokens) > 1:
                d.probs = torch.cat([d.probs[1:], d.probs[-1:]])
        return drafts

    monkeypatch.setattr(inner, "propose", shifted)


def _fault_structured(engine, monkeypatch):
    """The grammar's mask left out of every draft row (kept on the last committed token's)."""
    from rayspec.sampling.structured import GrammarState

    allowed_rows = GrammarState.allowed_rows

    def unmasked(self, row_extra, device):
        mask = allowed_rows(self, row_extra, device)
        for r, extra in enumerate(row_extra):
            if extra:
                mask[r] = True
        return mask

    monkeypatch.setattr(GrammarState, "allowed_rows", unmasked)


def _fault_penalties(engine, monkeypatch):
    """Each verification row penalised for the committed output only, not the drafts before it."""
    monkeypatch.setattr("rayspec.sampling.logits_processing.verification_row_extra",
                        lambda num_pending, tokens, parents: [[] for _ in range(num_pending + len(tokens))])


def _fault_deferred(engine, monkeypatch):
    """Deferred drafts verified with their tokens rotated by one (the read hands back the true ones)."""
    import rayspec.engine.llm_engine as llm_engine

    inputs = llm_engine.verification_inputs

    def rotated(proposal, device):
        for d in proposal.drafts:
            if d.deferred is not None and d.deferred.num_nodes > 1:
                d.deferred.tokens = d.deferred.tokens.roll(1)
        return inputs(proposal, device)

    monkeypatch.setattr(llm_engine, "verification_inputs", rotated)


def _fault_deep(engine, monkeypatch):
    """Tree nodes past depth 3 at depth 3's rope position (a layout that stops counting)."""
    import rayspec.model.batch_layout as batch_layout

    depths_of = batch_layout.tree_depths
    monkeypatch.setattr(batch_layout, "tree_depths", lambda parents: [min(d, 3) for d in depths_of(parents)])


def _fault_stop(engine, monkeypatch):
    """A step's emitted tokens all kept, past the stop string's."""
    from rayspec.engine.sequence import Sequence

    def keep_all(self, tokens):
        for tok in tokens:
            self.token_ids.append(tok)
            if not self.finished:
                self._check_stop(tok)
        return len(tokens)

    monkeypatch.setattr(Sequence, "append_tokens", keep_all)


# column -> (the fault, the check that must fail). The remote and async faults hand over a q that
# does not describe the drafted tokens: only sampled drafts carry a q (a token tree of point masses
# is verified losslessly whatever the proposer drafts), so there the EAGLE-3 tree cells have none.
def _fault_overlap(engine, monkeypatch):
    launch = engine.overlap._launch

    def rotated(seqs, inputs, ahead):  # each queued sequence fed its neighbour's last token
        if isinstance(inputs, torch.Tensor) and inputs.shape[0] > 1:
            inputs = inputs.roll(1, 0)
        return launch(seqs, inputs, ahead)

    monkeypatch.setattr(engine.overlap, "_launch", rotated)


FAULTS = {
    "tp2": (_fault_tp2, "rows"),
    "preempt": (_fault_preempt, "rows"),
    "chunked": (_fault_chunked, "rows"),
    "prefix": (_fault_prefix, "rows"),
    "compiled": (_fault_compiled, "rows"),
    "bf16": (_fault_bf16, "rows"),
    "remote": (_fault_remote, "drafts"),
    "async": (_fault_async, "drafts"),
    "failover": (lambda had: had[:-1], "bookkeeping"),  # the last token sent lost on the way
    "structured": (_fault_structured, "rows"),
    "penalties": (_fault_penalties, "rows"),
    "stop": (_fault_stop, "stops"),
    "deferred": (_fault_deferred, "rows"),
    "deep": (_fault_deep, "rows"),
    "overlap": (_fault_overlap, "rows"),
}

def check_stops(outputs: dict, tokenizer) -> None:
    """Each output ends at the first occurrence of a stop string: the token completing it is the last
    kept, and the text stops just before it."""
    for rid, out in outputs.items():
        text = tokenizer.decode(out.token_ids, skip_special_tokens=True)
        before = tokenizer.decode(out.token_ids[:-1], skip_special_tokens=True)
        assert not any(stop in before for stop in STOPS), (rid, before)
        if out.finish_reason == "stop":
            first = min(text.index(stop) for stop in STOPS if stop in text)
            assert out.text == text[:first], (rid, out.text, text)
        else:
            assert not any(stop in text for stop in STOPS) and out.finish_reason == "length", (rid, text)
