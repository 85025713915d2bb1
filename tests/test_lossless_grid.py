"""Sampled losslessness in every topology (issue #53, item 1): unseeded requests at T > 0, every
random draw audited against its exact law (tests/audit.py).

Each cell runs one topology with one proposer: ~100 unseeded sampled requests, half at T = 1 with
no top-k / top-p (as clients send them), half at T = 0.7, top-k 20, top-p 0.9; 16 tokens each
after one of four prompts, on a 512-token tiny Llama (conftest's, the tokenizer cut to its first
512 ids: a real tokenizer for grammars and stop strings, rows small enough to audit). Every draw
is recorded (the prefill's token, every verification's outcome, every sampled draft token) and:
1. every target row the rejection rule read equals transformers' float64 forward at that context,
   processed in numpy (tests/reference.py), to within the rounding of the engine's dtype (see
   Tolerance): a topology that computes a wrong logit fails here, whatever the sample size;
2. every output is its draws' emitted tokens, cut only inside the last step;
3. every draw follows its exact conditional law (the prefill token ~ p, a sampled draft ~ its q,
   a verification's outcome ~ the rule's law from p, q and the drafts): Pearson's chi-square over
   20 bins of the randomized probability-integral transforms, outcomes and drafts tested apart.

The grid (proposers x topologies; x: a cell of test_cell; EAGLE-3 trees in every column):

| proposer       | TP 2 | preempt | chunked | prefix hit | compiled | bf16 | remote | async | failover | structured | penalties | stop |
|----------------|------|---------|---------|------------|----------|------|--------|-------|----------|------------|-----------|------|
| n-gram         |  x   |         |         |     x      |    x     |      |        |       |          |     x      |           |      |
| draft model    |      |    x    |         |            |          |  x   |   x    |   x   |          |            |           |  x   |
| EAGLE-1 chain  |      |         |    x    |            |          |      |        |       |          |            |           |      |
| EAGLE-1 tree   |      |         |         |            |          |      |        |       |    x     |            |           |      |
| EAGLE-3 chain  |      |         |         |            |          |      |        |       |          |            |     x     |      |
| EAGLE-3 tree   |  x   |    x    |    x    |     x      |    x     |  x   |   x    |   x   |    x     |     x      |     x     |  x   |

How each column runs (engine level; no Ray):
- TP 2: tensor_parallel_size 2, the other rank a spawned process (tests/tp_utils.ProcessLauncher, gloo);
- preempt: a KV pool of 12 blocks for 32 running requests: the youngest are preempted and recomputed
  (draws after a recompute are counted);
- chunked: max_num_batched_tokens 8, every prompt prefilled in 2-4 chunks;
- prefix hit: prefix caching on, the prompts' first blocks found cached (their requests counted);
- compiled: compile=True (torch.compile of the decode / verification step; batch <= 2 to keep its
  compiles few);
- bf16: the target (and draft) in bfloat16;
- remote: the proposer in deployments.replicas.proposer.ProposerServer behind its direct channel
  (deployments.transport.direct_channel), the engine's RemoteProposer calling it over the socket with the
  secret: what a served verifier does, without Serve (every call direct, counted);
- async: rayspec.proposers.pre_draft.PreDraftingProposer, every hypothesis drafted;
- failover: every request stopped mid-stream on one engine and resumed on a fresh one with the
  tokens it had (LLMEngine.add_request(resume_output_ids=...), as deployments.replicas.verifier does);
- structured: a regex grammar ([a-z ]{1,24}); the reference masks each row with this module's own
  reading of the regex over the tokenizer's strings, not llguidance;
- penalties: frequency, presence and repetition penalties and a logit bias;
- stop: a stop string; the output text must end before its first occurrence and no token after the
  one that completes it may be kept.

Tolerance (check 1): a row passes when, on the common support, its log-probabilities are within
4 tau / T of the reference's, tau the largest gap between transformers' own forward in the engine's
dtype and its float64 forward over the calibration contexts (an independent implementation's
rounding in that dtype; 4x for another kernel's order of reduction), and the supports are equal
unless a top-k / top-p cut lies within that of a tie. Measured here: float32 tau ~2.5e-6, bfloat16
~0.036.

Power (check 3). A per-cell run has ~1,500 outcomes; `audit.law_test` computes, from the run's
own draws, the per-outcome total variation at which each bias shape is detected with power 0.99
at ALPHA (the shapes: tests/audit.py, section 4), printed per cell and asserted below MAX_TV_099.
That is the statistical check's reach per topology (a bias of per-outcome TV ~0.2-0.3); TV 0.02
with power 0.99 for both shapes is met where the bias would come from, the rejection rule itself
(tests/test_sampling_distribution.py, test_rule_law_has_power), while what a topology changes
(the rows, the emitted tokens) is checked exactly by checks 1 and 2.

Injected faults (test_fault_is_caught, one per column, each asserting that the check named fails):
see FAULTS.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import audit
from conftest import make_tiny_model_dir
from engine_utils import cached_model, make_engine
from reference import HFLogits
from rayspec.config import EngineConfig, SpeculativeConfig
from rayspec.engine.llm_engine import LLMEngine
from rayspec.sampling.sampler import SamplingParams
from rayspec.sampling.structured import StructuredOutput

VOCAB = 512
TEXTS = ["one two three four one two three four one two", "The cat sat on the mat. The cat sat",
         "a b c a b c a b c", "Hello world, hello world, hello"]
MAX_TOKENS = 16
NUM_REQUESTS = 64
K = 3  # chains; EAGLE-3 trees: up to 5 nodes, 3 siblings a node, 3 levels
PLAIN = dict(temperature=1.0)
CUT = dict(temperature=0.3, top_k=20, top_p=0.9)
PENALTIES = dict(frequency_penalty=0.5, presence_penalty=0.3, repetition_penalty=1.3,
                 logit_bias={5: 2.0, 17: -3.0, 100: 1.5})
GRAMMAR = "[a-z ]{1,24}"
PREEMPT_BLOCKS, PREEMPT_BLOCK_SIZE = 24, 4  # the preempt column's KV pool: 96 tokens for requests of up to 46
COLUMNS = ["tp2", "preempt", "chunked", "prefix", "compiled", "bf16", "remote", "async", "failover", "structured",
           "penalties", "stop"]
SECOND = {"tp2": "ngram", "preempt": "draft", "chunked": "eagle1-chain", "prefix": "ngram", "compiled": "ngram",
          "bf16": "draft", "remote": "draft", "async": "draft", "failover": "eagle1-tree", "structured": "ngram",
          "penalties": "eagle3-chain", "stop": "draft"}
CELLS = [(c, p) for c in COLUMNS for p in ("eagle3-tree", SECOND[c])]
ALPHA = 1e-3 / (2 * len(CELLS))  # Bonferroni over every law test of the module
MAX_TV_099 = 0.5  # each cell's check 3 detects both shapes with power 0.99 below this per-outcome TV


# ---- the model, heads, references -----------------------------------------------------------------

@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return make_tiny_model_dir(tmp_path_factory.mktemp("grid") / "target", seed=5, vocab_size=VOCAB)


@pytest.fixture(scope="module")
def loaded(model_dir):
    return cached_model(str(model_dir))


@pytest.fixture(scope="module")
def prompts(loaded) -> list[list[int]]:
    return [loaded[1].encode(t) for t in TEXTS]


@pytest.fixture(scope="module")
def heads(model_dir, loaded, prompts, tmp_path_factory) -> dict[str, Path]:
    """Oracle heads (tests/eagle_utils.oracle_head) on the target's greedy continuations: drafts
    often accepted at T > 0, often not."""
    from eagle_utils import oracle_head
    from rayspec.eagle.checkpoint import save_eagle_head

    engine = make_engine(model_dir, "none", loaded=loaded)
    greedy = [o.token_ids for o in engine.generate(prompts, SamplingParams(temperature=0, max_tokens=32,
                                                                           ignore_eos=True))]
    args = loaded[0].args
    out = {}
    for kind in ("eagle", "eagle3"):
        head = oracle_head(model_dir, args.num_layers, args.hidden_size, [p + g for p, g in zip(prompts, greedy)],
                           kind=kind)
        out[kind] = save_eagle_head(head, tmp_path_factory.mktemp(f"grid-{kind}") / "head", dtype=torch.float32)
    return out


@pytest.fixture(scope="module")
def hf(model_dir) -> HFLogits:
    """The reference forward (transformers, float32)."""
    return HFLogits(model_dir, dtype=torch.float32)


@pytest.fixture(scope="module")
def tolerance(model_dir, prompts) -> dict[str, float]:
    """dtype -> tau: the largest gap of transformers' forward in that dtype from its float64
    forward (log-softmax, T = 1) over every prefix of the prompts continued by 24 random tokens."""
    exact = HFLogits(model_dir, dtype=torch.float64)
    gen = torch.Generator().manual_seed(0)
    contexts = []
    for p in prompts:  # (the continuations need not be the target's: any context will do)
        seq = list(p) + torch.randint(3, VOCAB, (24,), generator=gen).tolist()
        contexts += [tuple(seq[:n]) for n in range(len(p), len(seq) + 1)]
    exact.fill(contexts)
    out = {}
    for name, dtype in (("float32", torch.float32), ("bfloat16", torch.bfloat16)):
        other = HFLogits(model_dir, dtype=dtype)
        other.fill(contexts)
        gaps = []
        for c in contexts:
            a, b = exact(c), other(c)
            gaps.append(float(np.abs((a - np.logaddexp.reduce(a)) - (b - np.logaddexp.reduce(b))).max()))
        out[name] = max(gaps)
    print(f"rounding tau: {out}")
    return out


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
    own cache paid from it as the engine plans it (as tests/test_paged_kv.py does)."""
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
    common = dict(k=k, loaded=loaded, max_model_len=128, max_num_seqs=max_num_seqs, tree_max_batch=max_num_seqs,
                  engine_seed=seed)
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
    if column == "async":
        from rayspec.proposers.pre_draft import PreDraftingProposer

        engine.proposer = PreDraftingProposer(engine.proposer, 2, max_model_len=128, num_candidates=2)
    return engine, closing


def request_params(column: str, proposer: str, i: int) -> SamplingParams:
    """Request i of a cell: every other one at T = 1 plain, the rest at T = 0.3 cut by top-k and
    top-p (the tiny model repeats itself, what n-gram lookups and the oracle heads need, only when
    nearly greedy)."""
    extra = {"penalties": PENALTIES, "stop": dict(stop=[STOP]),
             "structured": dict(structured=StructuredOutput("regex", GRAMMAR))}.get(column, {})
    return SamplingParams(**(PLAIN if i % 2 else CUT), max_tokens=MAX_TOKENS, ignore_eos=column != "structured",
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


# ---- the cells ------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def shared_engines(model_dir, loaded, heads):
    """The costly engines (TP 2: a rank process; compiled: torch.compile's shapes), built once with
    EAGLE-3 trees; the n-gram cells put an NgramProposer in their place for a while."""
    engines: dict = {}
    closing: list = []

    def get(column: str):
        if column not in engines:
            batch = 4 if column == "compiled" else 32  # the compiled step compiles each batch bucket
            engines[column], more = build_engine(column, "eagle3-tree", model_dir, loaded, heads, seed=11,
                                                 max_num_seqs=batch)
            closing.extend(more)
        return engines[column]

    yield get
    for close in closing:
        close()


def cell_engine(column, proposer, model_dir, loaded, heads, shared_engines, seed):
    """(engine, things to close, the EAGLE proposer to put back after an n-gram cell on a shared engine)."""
    if column in ("tp2", "compiled"):
        engine = shared_engines(column)
        if proposer == "ngram":
            from rayspec.proposers.ngram import NgramProposer

            eagle = engine.proposer
            engine.proposer = NgramProposer(1, 3)
            return engine, [], eagle
        return engine, [], None
    engine, closing = build_engine(column, proposer, model_dir, loaded, heads, seed)
    return engine, closing, None


STOP = "e"


def run_cell(column, proposer, model_dir, loaded, heads, shared_engines, prompts, monkeypatch, seed,
             num_requests=NUM_REQUESTS, fault=None):
    """Run a cell (with `fault(engine)` installed first, when given): (audit, outputs by id, resumed by
    id, the engine)."""
    n = num_requests // 2 if column == "compiled" else num_requests  # batch 4: slower steps
    cell_prompts = [prompts[i % len(prompts)] for i in range(n)]
    params = [request_params(column, proposer, i) for i in range(n)]
    record = audit.Audit()
    if column == "failover":
        def make(seed):
            return build_engine(column, proposer, model_dir, loaded, heads, seed + 100)[0]

        outputs, resumed, _ = run_failover(make, cell_prompts, params, monkeypatch, record,
                                           fault=fault)
        return record, outputs, resumed, None
    engine, closing, eagle = cell_engine(column, proposer, model_dir, loaded, heads, shared_engines, seed)
    try:
        if fault is not None:
            fault(engine)
        record.attach(engine, monkeypatch)
        ids = [f"r{i}" for i in range(n)]
        done = {}
        # prefix hits: a first wave caches the prompts' blocks, the rest find them
        for wave in ([slice(0, n // 4), slice(n // 4, n)] if column == "prefix" else [slice(0, n)]):
            done.update(run_requests(engine, cell_prompts[wave], params[wave], ids[wave]))
    finally:
        if eagle is not None:
            engine.proposer = eagle
        for close in closing:
            close()
    return record, done, {}, engine


def checks(column, record, outputs, resumed, hf, tolerance, tokenizer, eos_ids):
    """Checks 1-3 of the module docstring; returns (rows, outcome law, draft law)."""
    allowed = None
    if column == "structured":
        strings = token_strings(tokenizer)

        def allowed(d, context):
            text = tokenizer.decode(list(context[d.prompt_len:]), skip_special_tokens=True)
            return grammar_allowed(strings, eos_ids, text)

    started = time.perf_counter()
    hf.fill(audit.node_contexts(record.draws))
    tau = tolerance["bfloat16" if column == "bf16" else "float32"]
    rows = audit.check_rows(record.draws, audit.expected_rows(hf, allowed), delta=4 * tau)
    audit.check_bookkeeping(record.draws, outputs, resumed)
    outcomes, drafts = audit.law_test(record.draws)
    print(f"{column}: {rows}; outcomes {outcomes}; drafts {drafts}; audit {time.perf_counter() - started:.1f} s")
    for result in (outcomes, drafts):
        assert not result.impossible, result.impossible[:3]
        assert result.p_value > ALPHA, f"{column}: the draws do not follow their laws: {result}, bins {result.counts}"
    return rows, outcomes, drafts


def check_stops(outputs: dict, tokenizer) -> None:
    """Each output ends at its stop string's first occurrence: the token completing it is the last
    kept, and the text stops just before it."""
    for rid, out in outputs.items():
        text = tokenizer.decode(out.token_ids, skip_special_tokens=True)
        before = tokenizer.decode(out.token_ids[:-1], skip_special_tokens=True)
        if out.finish_reason == "stop":
            assert STOP in text and STOP not in before, (rid, text)
            assert out.text == text[:text.index(STOP)], (rid, out.text, text)
        else:
            assert STOP not in text and out.finish_reason == "length", (rid, text)


@pytest.mark.parametrize("column,proposer", CELLS, ids=[f"{c}-{p}" for c, p in CELLS])
def test_cell(model_dir, loaded, heads, hf, tolerance, prompts, shared_engines, monkeypatch, column, proposer):
    started = time.perf_counter()
    seed = 1000 * (CELLS.index((column, proposer)) + 1)
    record, done, resumed, engine = run_cell(column, proposer, model_dir, loaded, heads, shared_engines, prompts,
                                             monkeypatch, seed)
    ran = time.perf_counter() - started
    outputs = {rid: (o if isinstance(o, list) else o.token_ids) for rid, o in done.items()}
    eos_ids = sorted(engine.eos_token_ids) if engine is not None else [2]
    rows, outcomes, drafts = checks(column, record, outputs, resumed, hf, tolerance, loaded[1], eos_ids)
    draws = record.draws
    # what makes the cell mean something: drafts verified, accepted and rejected; trees with 3 siblings
    verified = [d for d in draws if d.kind != "prefill" and d.tokens]
    assert len(verified) > NUM_REQUESTS // 4, len(verified)
    assert any(d.path for d in verified) and any(len(d.path) < len(d.tokens) for d in verified)
    if proposer.endswith("tree"):
        trees = [d for d in verified if d.kind == "tree"]
        depths = np.bincount([len(d.path) for d in trees])
        print(f"{column}/{proposer}: {len(trees)} trees, accepted path lengths {depths.tolist()}")
        assert len(trees) > NUM_REQUESTS // 4 and len(depths) >= 2, depths
        if proposer == "eagle3-tree":
            assert any(max(d.parents.count(p) for p in set(d.parents)) >= 3 for d in trees)  # 3 siblings at a node
    if proposer == "draft" or proposer.endswith("chain") and proposer != "eagle1-chain":
        assert drafts.num_draws > NUM_REQUESTS, drafts  # sampled drafts with their q
    column_ran(column, engine, draws, done, resumed, loaded[1])
    for shape in ("chain", "proportional"):
        tv = outcomes.tv_detected(shape, ALPHA)
        print(f"{column}/{proposer}: a {shape} bias is detected with power 0.99 from per-outcome TV {tv:.3f}")
        assert tv < MAX_TV_099, (shape, tv)
    print(f"{column}/{proposer}: ran {ran:.1f} s, {len(draws)} draws, {len(verified)} verifications")


def column_ran(column, engine, draws, done, resumed, tokenizer) -> None:
    """The column's topology really ran."""
    if column == "tp2":
        assert engine.model.tp.size == 2
    elif column == "preempt":
        print(f"preempt: {engine.num_blocks} blocks, {engine.num_preemptions} preemptions")
        assert engine.num_preemptions > 0 and sum(d.preempted > 0 for d in draws) > 50, engine.num_preemptions
    elif column == "prefix":
        # (the two prompts of a full block and more, admitted after the first batch's blocks were cached)
        assert sum(o.num_cached_tokens > 0 for o in done.values()) >= NUM_REQUESTS // 8
    elif column == "chunked":
        assert engine.config.max_num_batched_tokens == 8
    elif column == "compiled":
        assert engine.runner.compiled is not None and len(engine.runner.compiled.shapes) >= 2
    elif column == "bf16":
        assert engine.dtype == torch.bfloat16
    elif column == "remote":
        remote = engine.proposer
        assert remote.num_direct_calls > 0 and remote.num_failed_calls == 0 and remote.handle.handle_calls == 0
    elif column == "async":
        assert engine.proposer.pre_drafter.stats.num_hits > 0
    elif column == "failover":
        assert sum(len(r) > 0 for r in resumed.values()) > NUM_REQUESTS // 8, resumed
    elif column == "structured":
        for out in done.values():
            assert re.fullmatch(r"[a-z ]{1,24}", out.text), out.text
    elif column == "stop":
        check_stops(done, tokenizer)
        reasons = [o.finish_reason for o in done.values()]
        assert reasons.count("stop") > 10 and reasons.count("length") > 0, reasons


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

    def wrong_token(ids, inputs, trees=None, packed=False, static=False, advance=True):
        if trees is None and not static:
            inputs = [list(x) for x in inputs]
            for rid, x in zip(ids, inputs):
                seq, start = engine._requests[rid], engine.kv.cached_len(rid)
                at = seq.num_prompt_tokens - start
                if seq.num_preemptions and 0 <= at < len(x):
                    x[at] = (x[at] + 1) % VOCAB
        return forward(ids, inputs, trees=trees, packed=packed, static=static, advance=advance)

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
        names, tensors = host(seq_ids, token_lists, lengths, starts, trees, kv_len)
        if inside and trees is None:
            i = names.index("positions")
            tensors = list(tensors)
            tensors[i] = tensors[i] + torch.tensor([[int(s > 0)] for s in starts], device=tensors[i].device)
        return names, tensors

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


# column -> (the proposer faulted, the fault, the check that must fail)
FAULTS = {
    "tp2": ("eagle3-tree", _fault_tp2, "rows"),
    "preempt": ("eagle3-tree", _fault_preempt, "rows"),
    "chunked": ("eagle3-tree", _fault_chunked, "rows"),
    "prefix": ("eagle3-tree", _fault_prefix, "rows"),
    "compiled": ("eagle3-tree", _fault_compiled, "rows"),
    "bf16": ("eagle3-tree", _fault_bf16, "rows"),
    "remote": ("draft", _fault_remote, "drafts"),
    "async": ("draft", _fault_async, "drafts"),
    "failover": ("eagle3-tree", lambda had: had[:-1], "bookkeeping"),  # the last token sent lost on the way
    "structured": ("eagle3-tree", _fault_structured, "rows"),
    "penalties": ("eagle3-tree", _fault_penalties, "rows"),
    "stop": ("draft", _fault_stop, "stops"),
}


@pytest.mark.parametrize("column", COLUMNS)
def test_fault_is_caught(model_dir, loaded, heads, hf, tolerance, prompts, shared_engines, monkeypatch, column):
    proposer, fault, check = FAULTS[column]
    installed = fault if column == "failover" else (lambda engine: fault(engine, monkeypatch))
    record, done, resumed, engine = run_cell(column, proposer, model_dir, loaded, heads, shared_engines, prompts,
                                             monkeypatch, seed=7, num_requests=16, fault=installed)
    monkeypatch.undo()  # (the audit's own wrappers too: nothing runs past here)
    outputs = {rid: (o if isinstance(o, list) else o.token_ids) for rid, o in done.items()}
    tau = tolerance["bfloat16" if column == "bf16" else "float32"]
    allowed = None
    if column == "structured":
        strings, eos_ids = token_strings(loaded[1]), sorted(engine.eos_token_ids)

        def allowed(d, context):
            return grammar_allowed(strings, eos_ids, loaded[1].decode(list(context[d.prompt_len:]),
                                                                       skip_special_tokens=True))

    with pytest.raises(AssertionError) as caught:
        if check == "rows":
            hf.fill(audit.node_contexts(record.draws))
            audit.check_rows(record.draws, audit.expected_rows(hf, allowed), delta=4 * tau)
        elif check == "bookkeeping":
            audit.check_bookkeeping(record.draws, outputs, resumed)
        elif check == "drafts":
            drafts = audit.law_test(record.draws)[1]
            assert drafts.p_value > ALPHA, f"drafts: {drafts}"
        else:
            check_stops(done, loaded[1])
    print(f"{column}: caught by {check}: {str(caught.value).splitlines()[0][:200]}")
