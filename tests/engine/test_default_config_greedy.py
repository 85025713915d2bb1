"""configs/default.yaml as users get it: greedy output equals target-only decoding, token for token.

The engine is built from the shipped YAML itself (its `speculative` and `engine` sections go
through deployments.config, as the verifier deployment builds its engine), on the real
SmolLM2-135M-Instruct with the shipped EAGLE-3 head. Requests join and leave mid-generation so
that the batch runs 1 -> 8 -> 1 and crosses the configuration's switches while requests are
running: token trees at batch <= tree_max_batch, no drafts at all from disable_by_batch_size
on, adaptive chains in between (the shipped YAML has no such band: disable_by_batch_size is
tree_max_batch + 1, so a second test moves the threshold up to exercise it). One prompt is over
1,900 tokens long and runs, next to short ones, into max_model_len, so its last trees are cut to
the room left in the context.

How the engine picks the mode (rayspec/engine/llm_engine.py, LLMEngine._plan_drafts): by the number of decoding
sequences only, never by time: trees while len(seqs) <= tree_max_batch (and eagle_topk > 1),
nothing while len(seqs) >= disable_by_batch_size, otherwise a chain. The draft planner
(rayspec.engine.drafting) sizes each tree or chain (0 included) from acceptance and step costs; where a
test asserts counts it weighs modelled costs (engine_utils.modelled_step_costs), so the counts are
the same on an idle and a busy machine. Greedy equality holds whatever budget is picked.

A tiny random model with a random head runs the same kind of schedule in seconds (not slow), and
checks besides that the head's cache after joins, leaves and undrafted stretches holds what a
fresh head computes from the whole history (output equality alone cannot see a head drafting
from the wrong state: it would only draft worse).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, replace
from pathlib import Path

import pytest
import torch
import yaml

from conftest import make_tiny_model_dir
from deployments.config import REPO_ROOT, AppArgs, load_app_args
from engine_utils import cached_model, modelled_step_costs
from rayspec.config import EngineConfig
from rayspec.eagle.checkpoint import new_eagle_config, save_eagle_head
from rayspec.eagle.head import attach_target, build_head
from rayspec.engine.llm_engine import LLMEngine, RequestOutput
from rayspec.sampling.sampler import SamplingParams

DEFAULT_YAML = REPO_ROOT / "configs" / "default.yaml"
CHAT_PROMPTS = REPO_ROOT / "data" / "train" / "chat_prompts.jsonl"
CODE_PROMPTS = REPO_ROOT / "data" / "train" / "code_prompts.jsonl"


# ---- the shipped configuration -----------------------------------------------------------------

def default_app_args() -> AppArgs:
    doc = yaml.safe_load(DEFAULT_YAML.read_text())
    (app,) = doc["applications"]
    assert app["import_path"] == "deployments.app:build_app"
    return load_app_args(app["args"])


def default_engine_config(**spec_overrides) -> EngineConfig:
    """EngineConfig exactly as the verifier deployment builds it from configs/default.yaml
    (AppArgs.engine_config()), with only test-time changes."""
    config = default_app_args().engine_config()
    # The YAML's num_threads (2) is for a dedicated server. LLMEngine calls torch.set_num_threads
    # with it, which is process-wide: keep the test process's setting (engine_utils: 1 thread, as
    # two spinning OpenMP threads make every step several times slower on a shared 2-core machine).
    # Threads change no result, only speed.
    config.num_threads = torch.get_num_threads()
    if spec_overrides:
        config.speculative = replace(config.speculative, **spec_overrides)
    return config


# ---- a step-level driver that records what the engine asked the proposer for ------------------

@dataclass
class Join:
    step: int  # added before this engine step (0: before the first)
    prompt: list[int]
    params: SamplingParams
    name: str = ""


@dataclass
class Trace:
    batches: list[int] = field(default_factory=list)  # decoding sequences per decode step
    modes: list[str] = field(default_factory=list)  # per decode step: "tree", "chain" or "none" (proposer not asked)
    tree_drafts: list[int] = field(default_factory=list)  # per decode step: drafts that came back as real trees
    # per proposer call, per request: (seq_id, tokens so far, draft budget, tree asked)
    calls: list[tuple[str, int, int, bool]] = field(default_factory=list)
    in_flight_at_join: list[int] = field(default_factory=list)  # requests unfinished when each one joined

    def steps(self, mode: str) -> int:
        return self.modes.count(mode)


def spy(engine: LLMEngine) -> Trace:
    """Record per decode step the batch size and what the proposer was asked for (instance
    attributes wrapping the engine's own methods: nothing in the engine changes)."""
    trace, current = Trace(), {}
    prepare, propose = engine._decode_prepare, engine.proposer.propose

    def propose_spy(requests):
        drafts = propose(requests)
        trees = {r.tree for r in requests if r.num_tokens > 0}
        assert len(trees) == 1, "one step asked for trees and chains at once"
        current.update(mode="tree" if trees.pop() else "chain", tree_drafts=sum(not d.is_chain for d in drafts))
        trace.calls += [(r.seq_id, len(r.token_ids), r.num_tokens, r.tree) for r in requests]
        return drafts

    def decode_spy(seqs):  # (propose -> verify; commit follows)
        current.clear()
        prepared = prepare(seqs)
        trace.batches.append(len(seqs))
        trace.modes.append(current.get("mode", "none"))
        trace.tree_drafts.append(current.get("tree_drafts", 0))
        return prepared

    engine._decode_prepare, engine.proposer.propose = decode_spy, propose_spy
    return trace


def drive(engine: LLMEngine, plan: list[Join], trace: Trace | None = None,
          max_steps: int = 5_000) -> list[RequestOutput]:
    """Add each request at its step (while others run), step until all finish; outputs in plan order."""
    ids: dict[int, str] = {}
    done: dict[str, RequestOutput] = {}
    order = sorted(range(len(plan)), key=lambda i: plan[i].step)
    for step in range(max_steps):
        while order and plan[order[0]].step <= step:
            i = order.pop(0)
            if trace is not None:
                trace.in_flight_at_join.append(engine.num_running + engine.num_waiting)
            ids[i] = engine.add_request(plan[i].prompt, plan[i].params)
        if not order and not engine.has_unfinished_requests():
            break
        for out in engine.step():
            if out.finished:
                assert out.request_id not in done, "a request finished twice"
                done[out.request_id] = out
    else:
        raise AssertionError("the engine did not finish")
    assert engine.num_running == engine.num_waiting == 0
    assert engine.kv.num_free_slots == engine.num_slots, "target KV slots leaked"
    if hasattr(engine.proposer, "runner"):
        assert engine.proposer.runner.kv.num_free_slots == engine.proposer.runner.kv.num_slots, "head slots leaked"
    return [done[ids[i]] for i in range(len(plan))]


def expected_mode(spec, batch: int) -> str:
    """What LLMEngine._decode_prepare asks the proposer for at this batch size (when anything)."""
    if spec.disable_by_batch_size and batch >= spec.disable_by_batch_size:
        return "none"
    if spec.eagle_topk > 1 and batch <= spec.tree_max_batch:
        return "tree"
    return "chain"


def check_modes_follow_batch_size(trace: Trace, spec) -> None:
    """Every step asked for what its batch size calls for: the switches go by batch size, not time.
    (A step in the tree or chain band may still ask nothing: every row has one token left, or the
    planned budget is 0.)"""
    for step, (batch, mode) in enumerate(zip(trace.batches, trace.modes)):
        want = expected_mode(spec, batch)
        assert mode in (want, "none"), f"decode step {step}: batch {batch} asked for {mode}, expected {want}"


def crossings(batches: list[int], low: int, high: int) -> tuple[int, int]:
    """(upward, downward) moves of the decode batch from <= low to >= high and back, step to step."""
    up = sum(a <= low and b >= high for a, b in zip(batches, batches[1:]))
    down = sum(a >= high and b <= low for a, b in zip(batches, batches[1:]))
    return up, down


# ---- prompts (from the repo's own prompt files) ------------------------------------------------

def _turns(path: Path) -> list[str]:
    return [json.loads(line)["turns"][0] for line in path.read_text().splitlines() if line.strip()]


def chat_ids(engine: LLMEngine, text: str) -> list[int]:
    return engine.encode_chat([{"role": "user", "content": text}])


def long_prompt(engine: LLMEngine, lo: int, hi: int) -> list[int]:
    """A chat prompt of lo..hi tokens: many of the repo's chat prompts as one document to answer."""
    texts = _turns(CHAT_PROMPTS)
    head = "Here is a list of requests from a help desk queue. Read them all, then answer the last one.\n\n"
    parts: list[str] = []
    ids = chat_ids(engine, head)
    for text in texts:
        trial = chat_ids(engine, head + "\n\n".join(parts + [text]))
        if len(trial) > hi:
            continue
        parts.append(text)
        ids = trial
        if len(ids) >= lo:
            break
    assert lo <= len(ids) <= hi, len(ids)
    return ids


# ---- real model, shipped head --------------------------------------------------------------------

# short requests: (file, index of the prompt in data/train/<file>_prompts.jsonl, max_tokens);
# staggered lengths, so that they leave at different steps
SHORT = [("chat", 0, 48), ("chat", 17, 12), ("code", 1, 30), ("chat", 5, 16), ("chat", 27, 22),
         ("code", 7, 36), ("chat", 20, 10)]
LONG_ROOM = (100, 130)  # the long prompt leaves this many tokens of max_model_len to generate


@pytest.fixture(scope="module")
def smol_engine(smollm2):
    """The shipped configuration, built as the deployment builds it (LLMEngine(config) loads the
    model and the head itself)."""
    engine = LLMEngine(default_engine_config())
    assert engine.config.speculative.method == "eagle3" and engine.proposer.head is not None
    return engine


@pytest.fixture(scope="module")
def smol_requests(smol_engine) -> dict[str, tuple[list[int], SamplingParams]]:
    """name -> (prompt ids, greedy params): the short chat/code requests A..G and LONG, a prompt of
    over 1,900 tokens (with ignore_eos and no max_tokens: it runs into max_model_len)."""
    files = {"chat": _turns(CHAT_PROMPTS), "code": _turns(CODE_PROMPTS)}
    requests = {name: (chat_ids(smol_engine, files[src][i]), _greedy(n))
                for name, (src, i, n) in zip("ABCDEFG", SHORT)}
    L = smol_engine.max_model_len
    requests["LONG"] = (long_prompt(smol_engine, L - LONG_ROOM[1], L - LONG_ROOM[0]), _greedy(None, ignore_eos=True))
    return requests


@pytest.fixture(scope="module")
def target_only(smol_engine, smol_requests) -> dict[str, list[int]]:
    """name -> target-only greedy output: the same configuration with method none, on the same
    weights, all requests in one batch (computed once for the module)."""
    config = default_engine_config()
    config.speculative = replace(config.speculative, method="none", draft_model=None)
    reference = LLMEngine(config, model=smol_engine.model, tokenizer=smol_engine.tokenizer)
    # given the model, an engine takes EOS ids from the tokenizer only; the deployment's engine
    # (which loads the model itself) also reads generation_config/config.json: use its set
    reference.eos_token_ids = set(smol_engine.eos_token_ids)
    assert reference.max_k == 0 and reference.max_model_len == smol_engine.max_model_len
    names = list(smol_requests)
    outputs = reference.generate([smol_requests[n][0] for n in names], [smol_requests[n][1] for n in names])
    assert reference.stats.num_drafts == 0
    return {n: list(o.token_ids) for n, o in zip(names, outputs)}


def _greedy(max_tokens: int | None, ignore_eos: bool = False) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=ignore_eos)


def _plan(requests, schedule: list[tuple[int, str]]) -> list[Join]:
    return [Join(step, *requests[name], name=name) for step, name in schedule]


def _assert_equal(outputs, plan, target_only) -> None:
    for out, join in zip(outputs, plan):
        want = target_only[join.name]
        got = list(out.token_ids)
        if got != want:
            first = next((j for j, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
            raise AssertionError(f"{join.name}: speculative output diverges from target-only decoding at "
                                 f"output token {first} (got {got[first:first + 5]}, want {want[first:first + 5]}; "
                                 f"lengths {len(got)} / {len(want)})")


@pytest.mark.slow
def test_default_yaml_greedy_equals_target_only(smol_engine, smol_requests, target_only):
    """Batch 1 -> 8 -> 1 with requests joining and leaving mid-generation, a 1,900-token prompt
    among short ones running into max_model_len: every output is target-only's, token for token."""
    engine = smol_engine
    spec = engine.config.speculative
    T, D = spec.tree_max_batch, spec.disable_by_batch_size
    assert spec.eagle_topk > 1 and T >= 1 and D is not None and D > T  # the switches this test crosses
    assert engine.kv_plan.sequences_of(engine.kv.capacity) >= 8, "the YAML's KV budget no longer holds 8 sequences"
    L = engine.max_model_len
    long_ids = smol_requests["LONG"][0]
    assert len(long_ids) > 1000
    plan = _plan(smol_requests, [
        (0, "A"),  # alone: batch 1 (trees)
        (3, "LONG"),  # batch 2 (trees); LONG runs into max_model_len
        (6, "B"),  # batch 3: no drafts from here on (disable_by_batch_size)
        (7, "C"), (8, "D"), (9, "E"), (10, "F"),
        (11, "G"),  # batch 8; then they leave one by one, down to LONG alone (trees again)
    ])
    trace = spy(engine)
    before = engine.stats.as_dict()
    outputs = drive(engine, plan, trace)

    _assert_equal(outputs, plan, target_only)

    # LONG ran into the context limit, its last trees cut to the room left
    out = outputs[1]
    assert out.finish_reason == "length" and len(long_ids) + len(out.token_ids) == L, (out.finish_reason,
                                                                                      len(out.token_ids))
    # the engine asked only for what fits (+1 bonus token). Whether it drafts a tree at all near the
    # end is the cost-aware planner's choice from measured step costs (rayspec.engine.drafting), so this run
    # cannot insist on one there (when it drafts none, this run does not exercise the cut)
    near_end = [(n, budget) for sid, n, budget, tree in trace.calls
                if sid == out.request_id and tree and n + spec.num_speculative_tokens > L]
    assert all(n + budget < L for n, budget in near_end), near_end

    # the batch went 1 .. 8 and crossed the switches both ways while requests were running
    assert set(range(1, 9)) <= set(trace.batches), sorted(set(trace.batches))
    assert all(n > 0 for n in trace.in_flight_at_join[1:]), "a request joined an idle engine"
    up, down = crossings(trace.batches, T, D)
    assert up >= 1 and down >= 1, (up, down, trace.batches)
    check_modes_follow_batch_size(trace, spec)
    assert trace.steps("tree") > 0 and sum(trace.tree_drafts) > 0, "no token tree was drafted and verified"
    assert any(b >= D and m == "none" for b, m in zip(trace.batches, trace.modes)), "drafting never disabled"
    # trees after the disabled stretch: the head caught up on the features of the undrafted steps
    last_none = max(i for i, m in enumerate(trace.modes) if m == "none" and trace.batches[i] >= D)
    assert "tree" in trace.modes[last_none:]
    after = engine.stats.as_dict()
    assert after["num_accepted_tokens"] > before["num_accepted_tokens"], "the shipped head was never accepted"
    print(f"\ndefault.yaml run: {len(trace.batches)} decode steps, batches {trace.batches}, "
          f"modes tree={trace.steps('tree')} chain={trace.steps('chain')} none={trace.steps('none')}, "
          f"long prompt {len(long_ids)} tokens, stats {after}")


@pytest.mark.slow
def test_default_yaml_with_a_chain_band_greedy_equals_target_only(smol_engine, smol_requests, target_only):
    """The shipped YAML with disable_by_batch_size moved up to 6 (the only change): batches 3-5
    now draft adaptive chains between the trees below and the disabled batches above; requests
    join and leave across both switches, outputs stay target-only's."""
    base = smol_engine.config.speculative
    config = default_engine_config(disable_by_batch_size=6)
    engine = LLMEngine(config, model=smol_engine.model, tokenizer=smol_engine.tokenizer)
    engine.eos_token_ids = set(smol_engine.eos_token_ids)  # as in target_only
    modelled_step_costs(engine)  # planned budgets from a cost model, not the wall clock: deterministic counts
    spec = engine.config.speculative
    assert spec.adaptive and spec.tree_max_batch == base.tree_max_batch == 2
    plan = _plan(smol_requests, [(0, "A"), (2, "F"), (4, "C"), (5, "E"), (6, "D"), (7, "B"), (8, "G")])
    trace = spy(engine)
    outputs = drive(engine, plan, trace)

    _assert_equal(outputs, plan, target_only)
    check_modes_follow_batch_size(trace, spec)
    assert {1, 2, 3, 4, 5, 6, 7} <= set(trace.batches), trace.batches
    for low, high in ((2, 3), (5, 6)):
        up, down = crossings(trace.batches, low, high)
        assert up >= 1 and down >= 1, (low, high, trace.batches)
    # under the modelled costs the shipped head's chains and trees pay often enough to be drafted
    assert trace.steps("chain") > 0 and trace.steps("tree") > 0
    assert any(b >= 6 and m == "none" for b, m in zip(trace.batches, trace.modes))
    print(f"\nchain-band run: {len(trace.batches)} decode steps, batches {trace.batches}, modes {trace.modes}, "
          f"stats {engine.stats.as_dict()}")


# ---- tiny random model, random head: the same switches in a second ------------------------------

TINY_VOCAB, TINY_LAYERS, TINY_HIDDEN = 256, 4, 64


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny target and an untrained EAGLE-3 head for it (its drafts are mostly rejected; the
    n-gram branch of eagle_prompt_lookup gets some accepted on the tiny model's repetitive text)."""
    target_dir = make_tiny_model_dir(tmp_path_factory.mktemp("default-cfg-target") / "model", seed=5,
                                     num_layers=TINY_LAYERS, hidden=TINY_HIDDEN, vocab_size=TINY_VOCAB,
                                     with_tokenizer=False)
    loaded = cached_model(str(target_dir))
    torch.manual_seed(2)
    head = build_head(new_eagle_config("eagle3", target_dir, TINY_LAYERS, TINY_HIDDEN))
    attach_target(head, loaded[0], has_own_embedding=False)
    head_dir = save_eagle_head(head, tmp_path_factory.mktemp("default-cfg-head") / "head")
    return target_dir, loaded, head_dir


def _head_kv(runner, seq_id: str) -> list[torch.Tensor]:
    """A sequence's committed head-cache keys and values (ModelRunner internals, read only)."""
    rows = runner.kv.rows([seq_id], runner.kv.cached_len(seq_id))[0]  # its block table, row by row
    return [torch.stack(c)[:, rows] for c in (runner.cache.k, runner.cache.v)]


def fresh_head_oracle(engine: LLMEngine, fresh) -> list[tuple[bool, bool]]:
    """For every draft the engine's proposer makes from now on, compare its head state with that
    of `fresh` (another proposer on the same head) handed the request's whole feature history at
    once: (the draft is the same, the committed head KV cache is the same up to rounding)."""
    history: dict[str, list[torch.Tensor]] = {}
    checks: list[tuple[bool, bool]] = []
    mine, propose = engine.proposer, engine.proposer.propose

    def propose_and_compare(requests):
        for r in requests:
            if r.features is not None and len(r.features):
                assert r.features_start == sum(len(f) for f in history.get(r.seq_id, []))
                history.setdefault(r.seq_id, []).append(r.features.clone())
        drafts = propose(requests)
        for r, d in zip(requests, drafts):
            if r.num_tokens > 0:
                (want,) = fresh.propose([replace(r, features=torch.cat(history[r.seq_id]), features_start=0)])
                same_kv = (mine.runner.kv.cached_len(r.seq_id) == fresh.runner.kv.cached_len(r.seq_id) == len(r.token_ids) - 1
                           and all(torch.allclose(x, y, rtol=1e-3, atol=1e-4)
                                   for x, y in zip(_head_kv(mine.runner, r.seq_id), _head_kv(fresh.runner, r.seq_id))))
                fresh.release(r.seq_id)
                checks.append(((d.tokens, d.parents) == (want.tokens, want.parents), same_kv))
        return drafts

    engine.proposer.propose = propose_and_compare
    return checks


# drafting costs nothing but the step: the planner drafts every budget in full (the random head's
# drafts are mostly rejected, and at any real cost it would draft almost nothing)
FREE_DRAFTS = {"step_s": 0.010}


def _tiny_engine(tiny, costs: dict | None = None, **spec_overrides) -> LLMEngine:
    """The shipped YAML's speculative and engine settings, on the tiny model and head."""
    target_dir, loaded, head_dir = tiny
    config = default_engine_config(**{"draft_model": str(head_dir), **spec_overrides})
    config.model = str(target_dir)
    config.max_model_len = 160  # the tiny model: short prompts, short outputs
    engine = LLMEngine(config, model=loaded[0], tokenizer=None)
    modelled_step_costs(engine, costs)
    return engine


@pytest.mark.parametrize("disable,costs", [(None, FREE_DRAFTS), (5, FREE_DRAFTS), (None, None)],
                         ids=["yaml", "chain-band", "yaml-costed"])
def test_tiny_default_switches_greedy_equals_target_only(tiny, disable, costs):
    """yaml: the shipped speculative settings (trees at batch <= 2, none from 3). chain-band:
    disable_by_batch_size 5, so 3-4 draft adaptive chains. Joining and leaving across them.
    yaml-costed: at engine_utils.MODELLED_COSTS the planner drafts the random head's trees only
    where they pay, and probes: longer undrafted stretches for the head to catch up on."""
    engine = _tiny_engine(tiny, costs, **({} if disable is None else {"disable_by_batch_size": disable}))
    spec = engine.config.speculative
    gen = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, TINY_VOCAB, (n,), generator=gen).tolist() for n in (5, 9, 4, 7, 6, 8, 3, 10)]
    lengths = [60, 24, 47, 18, 30, 22, 36, 16]
    plan = [Join(step, prompts[i], _greedy(lengths[i], ignore_eos=True), name=f"r{i}")
            for i, step in enumerate((0, 2, 4, 5, 6, 7, 8, 9))]
    trace = spy(engine)
    oracle = fresh_head_oracle(engine, _tiny_engine(tiny).proposer)
    outputs = drive(engine, plan, trace)

    reference = _tiny_engine(tiny, method="none", draft_model=None)
    for out, join in zip(outputs, plan):
        assert list(out.token_ids) == list(reference.generate([join.prompt], join.params)[0].token_ids), join.name

    # The head's state survives joins, leaves (slots moving in its cache) and undrafted stretches
    # (it catches up on the features it missed): at every draft its cache holds what a fresh head
    # computes from the request's whole history at once, and the drafts agree. Drafts are counted,
    # not required equal everywhere: the two computations round differently, which may move a
    # near-tie among the head's top tokens.
    # (costed: the random head's trees rarely pay, so fewer drafts, each after a longer undrafted stretch)
    assert len(oracle) >= (10 if costs is FREE_DRAFTS else 2), len(oracle)
    if costs is not FREE_DRAFTS:  # trees sized to what pays: in the tree band, many plain decode steps
        tree_band = [m for b, m in zip(trace.batches, trace.modes) if b <= spec.tree_max_batch]
        assert tree_band.count("none") >= 5 and tree_band.count("tree") >= 2, tree_band
    assert all(same_kv for _, same_kv in oracle), f"{sum(not k for _, k in oracle)} of {len(oracle)} head caches differ"
    same = sum(same_draft for same_draft, _ in oracle)
    assert same >= 0.9 * len(oracle), f"{same} of {len(oracle)} drafts equal a fresh head's"
    check_modes_follow_batch_size(trace, spec)
    assert set(range(1, 9)) <= set(trace.batches), trace.batches
    assert trace.steps("tree") > 0 and sum(trace.tree_drafts) > 0
    D = spec.disable_by_batch_size
    assert any(b >= D and m == "none" for b, m in zip(trace.batches, trace.modes))
    up, down = crossings(trace.batches, spec.tree_max_batch, spec.tree_max_batch + 1)
    assert up >= 1 and down >= 1, trace.batches
    if D > spec.tree_max_batch + 1:
        assert trace.steps("chain") > 0
    print(f"\ntiny {disable}: batches {trace.batches}, modes {trace.modes}, stats {engine.stats.as_dict()}")
